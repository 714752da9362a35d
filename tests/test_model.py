"""The one decoder matches transformers on tiny random Qwen2, Qwen3 and Llama checkpoints."""

from copy import deepcopy

import pytest
import torch
import transformers
from helpers import assert_same_logits

from tandem.errors import TandemError
from tandem.model.checkpoint import load_model, save_model
from tandem.model.fuse import fuse_projections
from tandem.model.kv_cache import KVCache

SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1000.0, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(rope_theta=5000.0, head_dim=24, tie_word_embeddings=False)),
    "llama": (
        transformers.LlamaConfig,
        dict(rope_theta=20000.0, tie_word_embeddings=False, attention_bias=True),
    ),
}


def write_hf(family: str, path, **save_kw):
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra)).float().eval()
    with torch.no_grad():  # random biases and norms, so a missing one would show in the logits
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, **save_kw)
    return hf


def tandem_logits(model, ids, mask):
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(ids, positions, mask.bool())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = write_hf(family, tmp_path / "hf", max_shard_size="20KB")  # sharded on purpose
    model = load_model(tmp_path / "hf").eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 11))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = tandem_logits(model, ids, mask)
    assert_same_logits(got, expected, model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_round_trips_through_transformers(family, tmp_path):
    write_hf(family, tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    save_model(model, tmp_path / "ours", max_shard_mb=0.02)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    again = load_model(tmp_path / "ours").eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = tandem_logits(model, ids, mask)
        assert_same_logits(back(input_ids=ids, attention_mask=mask).logits, ours, model)
        assert torch.equal(tandem_logits(again, ids, mask), ours)  # the same kernels on the same weights


def test_kv_cache_decode_equals_full_forward_with_left_padding(tmp_path):
    write_hf("qwen3", tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 10))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False  # row 1 is left-padded by 3
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, positions, mask)
        cache = KVCache(model.cfg, 2, 10, torch.float32, torch.device("cpu"))
        pre = model(ids[:, :6], positions[:, :6], mask[:, :6], cache)
        steps = [
            model(ids[:, t : t + 1], positions[:, t : t + 1], mask[:, t : t + 1], cache) for t in range(6, 10)
        ]
    stepped = torch.cat([pre, *steps], dim=1)
    assert_same_logits(stepped[mask], full[mask], model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_projections_give_the_same_logits_and_follow_weight_updates(family, tmp_path):
    """The engines fuse q/k/v and gate/up; a weight update copied in by name must reach the fused
    matmul, and the cached decode must still equal the plain model's full forward."""
    write_hf(family, tmp_path / "hf")
    plain, fused = load_model(tmp_path / "hf").eval(), fuse_projections(load_model(tmp_path / "hf").eval())
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    positions = torch.arange(9).expand(2, -1)

    def cached_decode(model):
        cache = KVCache(model.cfg, 2, 9, torch.float32, torch.device("cpu"))
        pre = model(ids[:, :5], positions[:, :5], mask[:, :5], cache)
        steps = [
            model(ids[:, t : t + 1], positions[:, t : t + 1], mask[:, t : t + 1], cache) for t in range(5, 9)
        ]
        return torch.cat([pre, *steps], dim=1)

    with torch.no_grad():
        assert_same_logits(cached_decode(fused), plain(ids, positions, mask), plain)
        # A weight update, as the engines' weight sync writes it: copy_ into each parameter by name.
        live = dict(fused.named_parameters())
        for name, p in plain.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            live[name].copy_(p)
            assert live[name].is_contiguous()
        assert_same_logits(cached_decode(fused), plain(ids, positions, mask), plain)
        # A deep copy (tests clone engine models) is relinked when an engine fuses it again.
        copy = fuse_projections(deepcopy(fused))
        for name, p in copy.named_parameters():
            p.copy_(dict(plain.named_parameters())[name] * 0.5)
        plain.load_state_dict({n: p * 0.5 for n, p in plain.state_dict().items()})
        assert_same_logits(cached_decode(copy), plain(ids, positions, mask), plain)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(TandemError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TandemError, match="config.json"):
        load_model(tmp_path / "empty")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported.*SiLU"),
        (dict(hidden_act="relu"), r"hidden_act='relu' is not supported"),
        (dict(use_sliding_window=True, sliding_window=16), r"use_sliding_window=true \(sliding_window=16\)"),
    ],
)
def test_configs_that_compute_another_model_are_refused_by_name(change, message, tmp_path):
    import json

    write_hf("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(TandemError, match=message):
        load_model(tmp_path)


LONG = 256  # max_position_embeddings of the scaled checkpoints: 4x their original 64
SCALINGS = {
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "llama-llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-yarn-betas": (
        "llama",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
    ),
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


def write_scaled_hf(case: str, path):
    family, scaling = SCALINGS[case]
    config_cls, extra = FAMILIES[family]
    theta = extra["rope_theta"]
    shape = {**SHAPE, "max_position_embeddings": LONG}
    config = config_cls(**shape, **extra, rope_parameters={**scaling, "rope_theta": theta})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # sharp attention, so the logits depend on the rotation (near-uniform would not)
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("case", list(SCALINGS))
def test_scaled_rope_matches_transformers_beyond_the_original_length(case, tmp_path):
    """Long-context checkpoints (Llama 3.1 llama3, yarn Qwen, linear): logits equal transformers'
    at distances and positions past both the original and the scaled length, where the scaling
    decides them; the table grows on demand, and the saved config reads back into transformers as
    the same model."""
    hf = write_scaled_hf(case, tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    assert model.cfg.rope_scaling["rope_type"] == SCALINGS[case][1]["rope_type"]
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        # RoPE is relative, so a shifted block alone only tests rounding: the spread one puts
        # distances of 70 between tokens (over the original 64) and 770 across the block.
        spread = torch.linspace(0, 3 * LONG, 12).long()
        for positions in (torch.arange(3 * LONG, 3 * LONG + 12), spread, spread + 3 * LONG):
            positions = positions.expand(2, -1)
            expected = hf(input_ids=ids, position_ids=positions).logits
            got = model(ids, positions, mask)
            assert_same_logits(got, expected, model)
        save_model(model, tmp_path / "ours")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
        assert back.config.rope_parameters["rope_type"] == SCALINGS[case][1]["rope_type"]
        assert_same_logits(back(input_ids=ids, position_ids=positions).logits, got, model)


def test_dynamic_rope_matches_transformers_within_the_context_and_refuses_past_it(tmp_path):
    """Dynamic NTK changes nothing up to max_position_embeddings (tandem's whole context): logits
    equal transformers' at the last positions of it; a forward past it is refused, since there the
    frequencies would depend on the batch."""
    SCALINGS["llama-dynamic"] = ("llama", {"rope_type": "dynamic", "factor": 4.0})
    try:
        hf = write_scaled_hf("llama-dynamic", tmp_path)
    finally:
        del SCALINGS["llama-dynamic"]
    model = load_model(tmp_path).eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        for positions in (torch.arange(LONG - 12, LONG), torch.linspace(0, LONG - 1, 12).long()):
            positions = positions.expand(2, -1)
            expected = hf(input_ids=ids, position_ids=positions).logits
            assert_same_logits(model(ids, positions, mask), expected, model)
        with pytest.raises(ValueError, match=r"within max_position_embeddings=256.*position 256"):
            model(ids, torch.arange(LONG - 11, LONG + 1).expand(2, -1), mask)


def test_old_rope_scaling_spelling_loads(tmp_path):
    """Checkpoints saved by transformers<5 (Qwen2.5 long-context, Llama 3.1) spell it
    `rope_scaling` with `type`, rope_theta at the top level."""
    import json

    hf = write_scaled_hf("qwen2-yarn", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path).eval()
    assert model.cfg.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 8))
    positions = torch.arange(500, 508)[None]
    with torch.no_grad():
        got = model(ids, positions, torch.ones_like(ids, dtype=torch.bool))
        assert_same_logits(got, hf(input_ids=ids, position_ids=positions).logits, model)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "dynamic"}, r"rope_type 'dynamic' needs factor"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, r"rope_type 'longrope' is not supported.*llama3"),
        (
            {"rope_type": "made-up"},
            r"rope_type 'made-up' is not supported. Valid rope types: default, linear",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0},
            r"rope_type 'llama3' needs low_freq_factor, high_freq_factor",
        ),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ],
)
def test_rope_types_tandem_cannot_compute_are_refused_by_name(rope, message, tmp_path):
    import json

    write_hf("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {**rope, "rope_theta": 20000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TandemError, match=message):
        load_model(tmp_path)


def test_an_engine_s_bf16_rmsnorm_equals_transformers_bit_for_bit():
    """The engine's RMSNorm without autograd runs in two calls (torch's norm kernel, then the
    weight) where the trainer's runs in four; both must give Hugging Face's bits, on this CPU."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from tandem.model.decoder import RMSNorm

    torch.manual_seed(0)
    for dim in (576, 896, 100):
        ours, theirs = RMSNorm(dim, 1e-5).to(torch.bfloat16), LlamaRMSNorm(dim, 1e-5).to(torch.bfloat16)
        with torch.no_grad():
            ours.weight.copy_(torch.rand(dim) * 2)
            theirs.weight.copy_(ours.weight)
        x = (torch.randn(64, 3, dim) * torch.rand(64, 3, 1) * 10).to(torch.bfloat16)
        with torch.no_grad():
            fast, expected = ours(x), theirs(x)
        assert torch.equal(fast, expected)
        assert torch.equal(ours(x).detach(), expected)  # the trainer's path
