"""Mixture-of-experts in the one decoder: Qwen2-MoE, Qwen3-MoE and Mixtral checkpoints written by
transformers compute transformers' logits, the router's precision and tie-break, a fixed-order
combine (batch-invariant), routing record and replay (R3) through the engines and the trainer."""

import copy

import pytest
import torch
from helpers import assert_same_logits, chain_tolerance, logprob_tolerance, sample_logits, train_worker
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.errors import TandemError
from tandem.model.checkpoint import load_model, save_model
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM
from tandem.model.experts import Routing, SparseMoE, agreement, routing
from tandem.model.fuse import fuse_projections
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.sample import Prompt, SamplingParams
from tandem.train.batch import packed, padded, score

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
FAMILIES = {  # each with a dense layer where the family has one, norm_topk_prob both ways
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}  # fmt: skip


def hf_checkpoint(tmp_path, family: str, std: float = 0.2, **extra):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **BASE, **FAMILIES[family], **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family


def forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    return model(ids, torch.arange(t).expand(b, t), torch.ones(b, t, dtype=torch.bool))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoints_load_with_transformers_logits_and_save_back(tmp_path, family):
    hf, path = hf_checkpoint(tmp_path, family)
    ours = load_model(path)
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, forward(ours, ids)
        assert_same_logits(got, want, ours)
        save_model(ours, tmp_path / "back")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert_same_logits(back(ids).logits, want, ours)
    sparse = [i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse == {"qwen2_moe": [0, 2], "qwen3_moe": [1], "mixtral": [0, 1, 2]}[family]


def test_mixtral_keeps_its_checkpoint_names(tmp_path):
    _, path = hf_checkpoint(tmp_path, "mixtral")
    names = dict(load_model(path).named_parameters())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


@pytest.mark.parametrize(
    "field, value", [("router_jitter_noise", 0.1), ("sliding_window", 4096), ("num_experts_per_tok", 9)]
)
def test_what_the_decoder_does_not_implement_is_refused_by_name(field, value):
    hf = {"model_type": "mixtral", **BASE, **FAMILIES["mixtral"], field: value}
    with pytest.raises(TandemError, match=field):
        ModelConfig.from_hf(hf)


def moe_block(router_dtype: str = "float32") -> SparseMoE:
    cfg = ModelConfig(
        model_type="qwen3_moe", hidden_size=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, router_dtype=router_dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    block = SparseMoE(cfg, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def test_the_router_runs_in_fp32_or_the_compute_dtype():
    x = torch.randn(4000, 32).bfloat16()
    fp32, model = moe_block("float32").bfloat16(), moe_block("model").bfloat16()
    expected = torch.sort(x.float() @ fp32.gate.weight.float().T, dim=-1, descending=True, stable=True)
    experts, weights = fp32.route(x)
    assert torch.equal(experts, expected.indices[:, :2]) and weights.dtype == torch.float32
    in_bf16, _ = model.route(x)
    flips = (in_bf16.sort(-1).values != experts.sort(-1).values).any(-1).float().mean()
    assert 0 < flips < 0.2  # bf16 logits pick another top-2 for some near-tied tokens


def test_ties_go_to_the_lower_expert_index():
    block = moe_block()
    torch.nn.init.zeros_(block.gate.weight)  # every expert equally likely
    experts, weights = block.route(torch.randn(5, 32))
    assert experts.tolist() == [[0, 1]] * 5 and torch.all(weights == 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # a CPU's fp32 GEMMs are batch-dependent
def test_a_token_gets_the_same_output_in_any_batch_with_the_batch_invariant_forward(dtype):
    block = moe_block().to(dtype)
    block.batch_invariant = True
    x = torch.randn(1, 40, 32).to(dtype)
    alone = block(x[:, :1])
    for n in (2, 7, 40):
        assert torch.equal(block(x[:, :n])[:, :1], alone), n


def test_replayed_routing_is_used_and_recorded_routing_replays_to_the_same_logits(tmp_path):
    _, path = hf_checkpoint(tmp_path, "qwen3_moe")
    model = load_model(path)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), routing(model, Routing(record=True)) as seen:
        logits = forward(model, ids)
    table = seen.table()  # (18, 1, 2)
    with torch.no_grad(), routing(model, Routing.replay(table, model, record=True)) as again:
        assert torch.equal(forward(model, ids), logits)
    other = (table + 1) % 6  # every token to other experts
    with torch.no_grad(), routing(model, Routing.replay(other, model, record=True)) as moved:
        assert not torch.allclose(forward(model, ids), logits)
    assert torch.equal(moved.table(), other) and agreement(other, again.table()) == 0.0


@pytest.mark.parametrize("engine_cls", [BuiltinEngine, PagedEngine])
def test_routing_replay_makes_the_trainers_experts_the_engines(tmp_path, engine_cls):
    """The engine records every token's experts; the trainer's forward then uses exactly those, even
    where its own router (here: other router weights) would choose others."""
    _, path = hf_checkpoint(tmp_path, "qwen3_moe", std=0.3)
    kw = dict(block_size=4) if engine_cls is PagedEngine else {}
    engine = engine_cls(load_model(path), [2], 0, record_routing=True, seed=1, **kw)
    samples = make_groups([Prompt(text="p")] * 4, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 3]], 2)
    engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=6))
    for s in samples:  # every token fed to a forward recorded (the last one needs none)
        assert s.routing.shape[0] == len(s.prompt_ids) + len(s.response_ids)
        assert (s.routing[:-1] >= 0).all()
    trainer = load_model(path)
    with torch.no_grad():
        trainer.model.layers[1].mlp.gate.weight.add_(torch.randn(6, 32) * 0.5)  # another router
    for rows in (packed(samples), padded(samples, 0)):
        table = rows.routing
        with torch.no_grad(), routing(trainer, Routing.replay(table, trainer, record=True)) as used:
            trainer(rows.ids, rows.positions, rows.mask, targets=rows.targets)
        known = (table >= 0).all(-1)
        assert torch.equal(used.table()[known], table[known])
        assert agreement(table, used.table()) == 1.0
        assert agreement(table, torch.stack([used.own[i] for i in sorted(used.own)], 1)) < 1.0
        score(trainer, rows, 8)
        assert rows.agreement is not None and rows.agreement < 1.0


def test_a_train_step_replays_and_logs_the_routing_agreement(tmp_path):
    _, path = hf_checkpoint(tmp_path, "qwen3_moe", std=0.3)
    engine = BuiltinEngine(load_model(path), [2], 0, record_routing=True, seed=1)
    samples = make_groups([Prompt(text="p")] * 4, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 3]], 2)
    engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=6))
    for s in samples:
        s.reward = float(s.response_ids[0] % 2)
    worker = train_worker(load_model(path), dict(routing_replay=True))
    metrics = worker.train_step(copy.deepcopy(samples))
    assert metrics["mismatch/routing_agreement"] == 1.0  # the same weights route the same
    # k3 = exp(d) - d - 1 ≈ d²/2 for the engine's and the trainer's logprobs d apart (at most `tol`,
    # other kernels), plus fp32's rounding of it near 1 (an ulp); other experts: d ~ 1e-1, k3 ~ 1e-3.
    tol = logprob_tolerance(sample_logits(load_model(path), samples), worker.model.cfg)
    assert metrics["mismatch/kl"] <= tol**2 / 2 + torch.finfo(torch.float32).eps


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoints_with_fused_experts_load(tmp_path, family):
    """transformers>=5 writes each layer's experts as two 3-D tensors when asked not to write the
    original format; tandem splits them into its per-expert (the checkpoints') names."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **BASE, **FAMILIES[family])).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path, save_original_format=False)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(tmp_path)
        assert_same_logits(forward(ours, ids), hf(ids).logits, ours)


def test_qwen2_moe_without_qkv_bias_loads_and_saves_back(tmp_path):
    hf, path = hf_checkpoint(tmp_path, "qwen2_moe", qkv_bias=False)
    ours = load_model(path)
    assert ours.model.layers[0].self_attn.q_proj.bias is None
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    save_model(ours, tmp_path / "back")
    with torch.no_grad():
        want = hf(ids).logits
        assert_same_logits(forward(ours, ids), want, ours)
        back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
        assert not any(info.values())  # no weight missing, unexpected or mismatched
        assert_same_logits(back.eval()(ids).logits, want, ours)


@pytest.mark.parametrize(
    "field, value", [("layer_types", ["full_attention", "sliding_attention"]), ("decoder_sparse_step", 0)]
)
def test_qwen_moe_fields_the_decoder_does_not_implement_are_refused_by_name(field, value):
    hf = {"model_type": "qwen2_moe", **BASE, **FAMILIES["qwen2_moe"], "num_hidden_layers": 2, field: value}
    with pytest.raises(TandemError, match=field):
        ModelConfig.from_hf(hf)


def test_every_expert_gets_a_gradient_even_without_tokens():
    """DDP fails on a parameter without a gradient, and FSDP2 would reduce-scatter different
    experts' gradients together when ranks route to different experts: every expert's is there."""
    block = moe_block()
    x = torch.randn(1, 5, 32)
    with routing(block, Routing({0: torch.tensor([[0, 1]] * 5)})):
        block(x).sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["experts.7.down_proj.weight"].abs().sum() == 0
    assert grads["experts.1.down_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize(
    "dtype, batch_invariant", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]
)
def test_the_graph_capturable_path_gives_the_grouped_outputs(dtype, batch_invariant):
    """`every_expert` (no host sync, for a recorded CUDA graph) computes what `grouped` does; with
    the batch-invariant forward bit for bit."""
    block = moe_block().to(dtype)
    block.batch_invariant = batch_invariant
    flat = torch.randn(9, 32).to(dtype)
    experts, _ = block.route(flat)
    with torch.no_grad():
        grouped, every = block.grouped(flat, experts), block.every_expert(flat, experts)
    if block.batch_invariant:
        assert torch.equal(every, grouped)
    # Other sums of the same products: the rounding bound of gate|up then down, contracting over
    # up to 32 (1e-4 here); a wrong expert, or the weights of two swapped, moves these outputs by ~10.
    torch.testing.assert_close(every, grouped, atol=chain_tolerance(grouped, 32, 2, dtype), rtol=0)


def test_a_padded_batch_replays_the_routing_of_its_real_tokens_only(tmp_path):
    """The decoder's forward takes a (B·T, k) routing per MoE layer in its (B, T) order: -1 rows
    (padding) route on their own; fuse_projections (the engines') leaves the experts alone."""
    _, path = hf_checkpoint(tmp_path, "mixtral")
    model = fuse_projections(load_model(path))
    assert all(layer.mlp.fused is None for layer in model.model.layers)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad(), routing(model, Routing(record=True)) as own:
        logits = model(ids, torch.arange(6).expand(2, 6), mask)
    table = own.table().long().view(2, 6, 3, 2)  # (B, T, L, k)
    table[1, 4:] = -1  # padding: nothing recorded for it
    table[0, 5] = (table[0, 5] + 1) % 4  # the last real token of row 0 to other experts
    with torch.no_grad(), routing(model, Routing.replay(table.flatten(0, 1), model, record=True)) as used:
        again = model(ids, torch.arange(6).expand(2, 6), mask)
    assert torch.equal(used.table().view(2, 6, 3, 2)[:, :5], own.table().view(2, 6, 3, 2)[:, :5])
    assert torch.equal(used.table()[5].long(), table[0, 5])
    # The other tokens keep their experts; only the grouping around them moved (the last bits).
    assert_same_logits(again[1, :4], logits[1, :4], model)
    assert_same_logits(again[0, :5], logits[0, :5], model)
    assert not torch.allclose(again[0, 5], logits[0, 5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_batch_invariant_switch_reaches_every_moe_layer(tmp_path, dtype):
    _, path = hf_checkpoint(tmp_path, "mixtral")
    model = load_model(path, dtype=dtype)
    model.batch_invariant = True
    assert all(layer.block_sparse_moe.batch_invariant for layer in model.model.layers)
    ids = torch.randint(0, 64, (6, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        alone = forward(model, ids[:1])
        assert torch.equal(forward(model, ids)[:1], alone)


def test_the_shipped_moe_warm_start_is_a_qwen3_moe_with_transformers_logits():
    """builtin:addition-moe loads in transformers (its own class) and in tandem to the same logits."""
    from tandem.model.config import resolve_model_path

    path = resolve_model_path("builtin:addition-moe")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf.config.model_type == "qwen3_moe" and hf.config.num_experts == 8
    ours = load_model(path)
    assert sum(isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers) == 4
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_same_logits(forward(ours, ids), hf(ids).logits, ours)
