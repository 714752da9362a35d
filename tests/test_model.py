"""The one decoder matches transformers on tiny random Qwen2, Qwen3 and Llama checkpoints."""

from copy import deepcopy

import pytest
import torch
import transformers

from tandem.errors import TandemError
from tandem.model import KVCache, fuse_projections, load_model, save_model

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
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


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
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask).logits, ours, atol=1e-4, rtol=0)
        torch.testing.assert_close(tandem_logits(again, ids, mask), ours, atol=0, rtol=0)


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
    torch.testing.assert_close(stepped[mask], full[mask], atol=1e-5, rtol=0)


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
        torch.testing.assert_close(cached_decode(fused), plain(ids, positions, mask), atol=1e-5, rtol=0)
        # A weight update, as the engines' weight sync writes it: copy_ into each parameter by name.
        live = dict(fused.named_parameters())
        for name, p in plain.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            live[name].copy_(p)
            assert live[name].is_contiguous()
        torch.testing.assert_close(cached_decode(fused), plain(ids, positions, mask), atol=1e-5, rtol=0)
        # A deep copy (tests clone engine models) is relinked when an engine fuses it again.
        copy = fuse_projections(deepcopy(fused))
        for name, p in copy.named_parameters():
            p.copy_(dict(plain.named_parameters())[name] * 0.5)
        plain.load_state_dict({n: p * 0.5 for n, p in plain.state_dict().items()})
        torch.testing.assert_close(cached_decode(copy), plain(ids, positions, mask), atol=1e-5, rtol=0)


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
