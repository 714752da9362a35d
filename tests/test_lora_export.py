"""A LoRA checkpoint outside training: `tandem export` writes it merged (a full Hugging Face model
that transformers loads with PEFT's logits) or as the adapter alone (what PEFT loads), and `tandem
eval` / `generate` serve a LoRA run's step directory or a PEFT adapter directory on the base it
names. Both kinds of directory are tested: a step directory (the base's weights, the adapter
beside them) and an adapter directory alone."""

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import logit_tolerance, write_tiny_checkpoint

from tandem.cli.main import main
from tandem.config.schema import LoraConfig
from tandem.data.tokenizer import build_char_tokenizer
from tandem.model.checkpoint import load_model, save_model
from tandem.model.export import checkpoint_dir
from tandem.model.lora import apply_lora, base_weights
from tandem.model.peft_format import ADAPTER_CONFIG, save_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = LoraConfig(rank=4, alpha=8.0)  # every projection
IDS = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """base: a full checkpoint; step: its weights with a trained adapter beside them, as a LoRA run
    saves a step; adapter: the same adapter alone, naming base (with no tokenizer of its own)."""
    root = tmp_path_factory.mktemp("lora-export")
    base = write_tiny_checkpoint(root / "base")
    model = apply_lora(load_model(base), LORA, seed=0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.2, generator=g)  # trained: B is not zero
    save_model(model, root / "step", tensors=base_weights(model))
    save_adapter(model, root / "step", str(base))
    build_char_tokenizer().save_pretrained(str(root / "step"))
    save_adapter(model, root / "adapter", str(base))
    return {"base": base, "step": root / "step", "adapter": root / "adapter"}


def peft_logits(base: Path, adapter: Path) -> torch.Tensor:
    """PEFT's policy: transformers' model of the base, the adapter loaded onto it, in fp32."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).float().eval()
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(hf, adapter).eval()(input_ids=IDS).logits


def hf_logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()(input_ids=IDS).logits


@pytest.mark.parametrize("kind", ["step", "adapter"])
def test_a_merged_export_is_a_full_model_with_peft_s_logits(dirs, kind, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["export", str(dirs[kind]), "--merge", "--out", str(out)]) == 0
    assert "full Hugging Face checkpoint" in capsys.readouterr().out
    assert not (out / ADAPTER_CONFIG).exists() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"  # the base's
    expected = peft_logits(dirs["base"], dirs["adapter"])
    assert not torch.allclose(expected, hf_logits(dirs["base"]), atol=1e-2)  # the adapter matters
    # W + s·BA folded against W·x + s·B(A·x): other sums, within the rounding bound (~3e-5 here);
    # the adapter moves these logits by ~0.7, so a wrong scale s or a projection left out shows.
    atol = logit_tolerance(expected, load_model(dirs["base"]).cfg)
    torch.testing.assert_close(hf_logits(out), expected, rtol=0, atol=atol)


def test_a_merged_export_takes_the_dtype_asked_for(dirs, tmp_path):
    out = tmp_path / "bf16"
    assert main(["export", str(dirs["step"]), "--merge", "--dtype", "bfloat16", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in load_model(out, torch.bfloat16).parameters())
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}


def test_an_adapter_export_is_the_adapter_alone_that_peft_loads(dirs, tmp_path):
    out = tmp_path / "adapter"
    assert main(["export", str(dirs["step"]), "--out", str(out)]) == 0
    assert not (out / "model.safetensors").exists() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(dirs["base"])
    expected = peft_logits(dirs["base"], dirs["step"])
    assert torch.equal(peft_logits(dirs["base"], out), expected)  # the same adapter through the same kernels


def test_an_adapter_directory_loads_on_its_base_as_the_step_directory_does(dirs):
    with checkpoint_dir(dirs["adapter"]) as view:
        assert view.name == "adapter" and (view / "config.json").is_file()
        policy = load_model(view)
    step = load_model(dirs["step"])
    assert all(torch.equal(p, dict(step.named_parameters())[n]) for n, p in policy.named_parameters())
    with checkpoint_dir(dirs["base"]) as path:  # a directory with weights is taken as it is
        assert path == dirs["base"]
    base = dict(load_model(dirs["base"]).named_parameters())
    assert not all(torch.equal(p, base[n]) for n, p in policy.named_parameters())  # the adapter folded in


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eval_and_generate_serve_an_adapter_directory_as_its_merged_export(dirs, tmp_path, capsys, dtype):
    """In either dtype train.dtype=auto may pick on a CPU, named rather than left to this one."""
    served = f"train.dtype={dtype}"
    merged = tmp_path / "merged"
    assert main(["export", str(dirs["adapter"]), "--merge", "--out", str(merged)]) == 0
    capsys.readouterr()
    results = {}
    for name, path in (("adapter", dirs["adapter"]), ("step", dirs["step"]), ("merged", merged)):
        # a LoRA recipe's train.lora trains a new adapter: eval and generate serve the one given
        args = ["eval", "--model", str(path), "--show", "2", "data.val_size=6", "reward.num_workers=1"]
        assert main([*args, "train.lora.rank=8", served]) == 0, capsys.readouterr().err
        evaluated = capsys.readouterr().out
        assert main(["generate", "12+30=", "--model", str(path), "--max-new-tokens", "6", served]) == 0
        results[name] = (evaluated, capsys.readouterr().out)
    assert results["adapter"] == results["step"] == results["merged"]
    base = ["generate", "12+30=", "--model", str(dirs["base"]), "--max-new-tokens", "6", served]
    assert main(base) == 0 and capsys.readouterr().out != results["merged"][1]


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("no base", r"names no base model \(base_model_name_or_path\)"),
        ("hub base", r"adapter of the base 'Org/some-model'.*HF_HUB_OFFLINE.*hf download Org/some-model"),
        ("full", r"holds no LoRA adapter \(adapter_config.json\): it is a full Hugging Face checkpoint"),
        ("out", r"--out \S+ exists and is not an empty directory"),
        ("pointer", r"latest \(the checkpoint\) is a file naming the run's newest checkpoint: .*step"),
    ],
)
def test_what_export_and_eval_cannot_read_is_refused_by_name(
    dirs, case, pattern, tmp_path, capsys, monkeypatch
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the hub base: looked for in an empty cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source, out = dirs["adapter"], tmp_path / "out"
    if case in ("no base", "hub base"):
        source = tmp_path / "adapter"
        source.mkdir()
        config = json.loads((dirs["adapter"] / ADAPTER_CONFIG).read_text())
        config["base_model_name_or_path"] = None if case == "no base" else "Org/some-model"
        (source / ADAPTER_CONFIG).write_text(json.dumps(config))
    elif case == "full":
        source = dirs["base"]
    elif case == "pointer":  # a run's checkpoints/latest, which names its newest (once: "holds no adapter")
        source = dirs["step"].parent / "latest"
        source.write_text(dirs["step"].name)
    else:
        out.mkdir()
        (out / "file").write_text("")
    assert main(["export", str(source), "--merge", "--out", str(out)]) == 2
    assert re.search(pattern, capsys.readouterr().err)
    if case in ("hub base", "pointer"):
        assert main(["eval", "--model", str(source)]) == 2
        assert re.search(pattern.replace("the checkpoint", "--model"), capsys.readouterr().err)
