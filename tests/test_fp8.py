"""FP8 blockwise weights: the round trip stays within the e4m3 rounding bound, scales are what the two
formats promise, and a quantised tandem decoder computes exactly what its dequantised weights do."""

import math
from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from helpers import matmul_tolerance
from torch import nn

from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, init_weights
from tandem.model.fp8 import (
    FP8,
    Fp8Linear,
    _scaled_mm_ok,
    dequantize_blockwise,
    quantizable,
    quantize_blockwise,
    quantize_model,
    quantize_rows,
    requantize,
)
from tandem.model.fuse import fuse_projections

SCALES = ["fp32", "ue8m0"]
# Multi-block and ragged: rows and columns that end mid-block, and smaller than one block.
SHAPES = [(256, 384), (300, 200), (129, 257), (5, 3)]
# Every dimension ends mid-block somewhere: q 192 rows, k/v 64, MLP 320, and parts that straddle.
CFG = ModelConfig(
    vocab_size=97,
    hidden_size=192,
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    o_bias=True,
    mlp_bias=True,
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wide_range(shape, seed=0):
    """Values over ~12 binades, so some land in e4m3's subnormals after scaling."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)


def per_element_scale(scales, shape, block=128):
    n, k = shape
    return scales.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def rounding_bound(w, scales, scale_format):
    """The largest |w - deq(q(w))| the arithmetic allows, element by element (float64).

    With s the element's block scale and v = |w| / s <= 448: e4m3 has 3 mantissa bits and
    exponents down to -6 (below 2^-6 the subnormals, spaced 2^-9), so the grid spacing around v is
    ulp(v) = 2^(max(floor(log2 v), -6) - 3) and round-to-nearest errs by at most ulp(v) / 2, i.e.
    |w - s·q| <= s · 2^(max(floor(log2 v), -6) - 4). (At the top binade [256, 448], ulp = 32.)
    UE8M0: s is a power of two, so w / s and q · s are exact in fp32: that is the whole bound.
    FP32 scales: w / s, the clamp of its last-bit overshoot past 448 and q · s each round in fp32
    (<= 2^-24 relative): add 2^-22 · |w|.
    """
    s = per_element_scale(scales, w.shape).double()
    a = w.double().abs()
    exponent = torch.floor(torch.log2(a / s)).clamp(min=-6)  # log2(0) = -inf -> the subnormal spacing
    bound = s * torch.exp2(exponent - 4)
    return bound if scale_format == "ue8m0" else bound + a * 2.0**-22


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_within_the_e4m3_bound(shape, scale):
    w = wide_range(shape)
    q, scales = quantize_blockwise(w, scale=scale)
    assert q.dtype == FP8 and q.shape == w.shape
    assert scales.dtype == torch.float32
    assert scales.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    err = (w.double() - dequantize_blockwise(q, scales).double()).abs()
    bound = rounding_bound(w, scales, scale)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    if w.numel() > 1000:  # and the bound is tight: random values come close to half a step
        assert (err / bound).max() > 0.9
        qa = q.float().abs()
        assert ((qa > 0) & (qa < 2.0**-6)).any(), "the data should reach e4m3's subnormals"


@pytest.mark.parametrize("scale", SCALES)
def test_scales_are_each_blocks_own_amax_over_448(scale):
    w = wide_range((300, 200), seed=1)
    q, scales = quantize_blockwise(w, scale=scale)
    for i in range(3):
        for j in range(2):
            amax = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
            s = scales[i, j]
            if scale == "fp32":
                assert s == amax / 448
            else:  # the smallest power of two that keeps amax within e4m3's range
                mantissa, _ = torch.frexp(s)
                assert mantissa == 0.5
                assert 448 * s >= amax > 448 * s / 2
            # the block's largest element lands at the top of e4m3's range, unsaturated
            block_q = q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs()
            top = block_q.max()
            assert top == 448 if scale == "fp32" else 224 <= top <= 448


def test_ue8m0_never_saturates_at_the_power_of_two_edges():
    # amax exactly 448·2^k needs scale 2^k (q = 448 exactly); one fp32 step above needs 2^(k+1).
    for k in (-20, -3, 0, 5):
        edge = 448.0 * 2.0**k
        above = torch.nextafter(torch.tensor(edge), torch.tensor(math.inf)).item()
        for amax, expected in ((edge, 2.0**k), (above, 2.0 ** (k + 1))):
            w = torch.full((4, 4), 0.25 * amax)
            w[1, 2] = -amax
            q, scales = quantize_blockwise(w, scale="ue8m0")
            assert scales.item() == expected
            assert q.float().abs().max() <= 448
        assert dequantize_blockwise(*quantize_blockwise(torch.tensor([[edge]]), scale="ue8m0")) == edge


@pytest.mark.parametrize("scale", SCALES)
def test_zero_blocks_give_zeros_not_nan(scale):
    w = wide_range((256, 300), seed=2)
    w[:128, 128:256] = 0  # one zero block among others
    q, scales = quantize_blockwise(w, scale=scale)
    back = dequantize_blockwise(q, scales)
    assert torch.isfinite(scales).all() and torch.isfinite(back).all()
    assert scales[0, 1] == 1 and (back[:128, 128:256] == 0).all()
    assert (back[128:, 128:256] != 0).any()
    q, scales = quantize_blockwise(torch.zeros(3, 130), scale=scale)
    assert (scales == 1).all() and (dequantize_blockwise(q, scales) == 0).all()


def test_values_on_the_grid_round_trip_exactly():
    gen = torch.Generator().manual_seed(3)
    grid = torch.randn(200, 140, generator=gen).mul(100).to(FP8)  # e4m3 values
    grid[0, 0], grid[128, 128] = 448, -448  # every block reaches the top: scale 2^-3 exactly
    w = grid.float() * 2.0**-3
    q, scales = quantize_blockwise(w, scale="ue8m0")
    assert (scales == 2.0**-3).all()
    assert torch.equal(dequantize_blockwise(q, scales), w)
    assert torch.equal(dequantize_blockwise(q, scales, torch.float64), w.double())


def test_bad_scale_format_is_refused():
    with pytest.raises(ValueError, match="ue8m0"):
        quantize_blockwise(torch.ones(2, 2), scale="e8m0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
def test_fp8_linear_on_the_cpu_is_the_dequantised_matmul(scale, dtype):
    linear = nn.Linear(257, 300).to(dtype)
    with torch.no_grad():
        linear.bias.normal_()
    fp8 = Fp8Linear.from_linear(linear, scale)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    x = torch.randn(2, 3, 257, dtype=dtype)
    q, scales = quantize_blockwise(linear.weight, scale=scale)
    expected = F.linear(x, dequantize_blockwise(q, scales, dtype), linear.bias)
    got = fp8(x)
    assert got.dtype == dtype and got.shape == (2, 3, 300)
    assert torch.equal(got, expected)
    assert not torch.equal(got, linear(x))  # and it is not the high-precision matmul


def test_fused_parts_are_quantised_one_by_one():
    # A fused q|k|v whose k starts mid-block: one block grid per part, the numbers of each alone.
    gen = torch.Generator().manual_seed(4)
    parts = [torch.randn(n, 160, generator=gen) * (i + 1) for i, n in enumerate((192, 64, 64))]
    fused = Fp8Linear(torch.cat(parts), parts=(192, 64, 64), scale="ue8m0")
    alone = [Fp8Linear(p, scale="ue8m0") for p in parts]
    assert fused.scales.shape == (2 + 1 + 1, 2)
    assert torch.equal(fused.scales, torch.cat([a.scales for a in alone]))
    assert torch.equal(fused.dequantized(), torch.cat([a.dequantized() for a in alone]))
    x = torch.randn(5, 160)
    # One GEMM against three of other shapes: their kernels may sum the 160 products in other
    # orders (2.6e-5 apart on an Intel Xeon with AMX), so the tolerance is the rounding bound of
    # a length-160 fp32 dot product, K·eps·(|x|·|w|ᵀ), not fp32's default.
    bound = matmul_tolerance(x, fused.dequantized())
    assert ((fused(x) - torch.cat([a(x) for a in alone], dim=-1)).abs() <= bound).all()
    with pytest.raises(ValueError, match="parts"):
        Fp8Linear(torch.cat(parts), parts=(192, 64))


def test_the_selection_rule():
    assert all(quantizable(f"model.layers.3.self_attn.{p}", nn.Linear(2, 2)) for p in PROJECTIONS[:4])
    assert all(quantizable(f"model.layers.3.mlp.{p}", nn.Linear(2, 2)) for p in PROJECTIONS[4:])
    for name in (
        "model.layers.0.mlp.experts.7.gate_proj",  # Qwen-MoE experts
        "model.layers.0.mlp.shared_expert.down_proj",
        "model.layers.0.block_sparse_moe.experts.1.w2",  # Mixtral experts
    ):
        assert quantizable(name, nn.Linear(2, 2)), name
    for name in (
        "model.layers.0.mlp.gate",  # MoE routers
        "model.layers.0.block_sparse_moe.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "lm_head",
        "model.embed_tokens",
        "model.norm",
    ):
        assert not quantizable(name, nn.Linear(2, 2)), name
    assert not quantizable("model.layers.0.self_attn.q_proj", nn.Embedding(2, 2))


def model(seed=0, std=0.02):
    m = CausalLM(CFG).eval().requires_grad_(False)
    init_weights(m, seed, std=std)
    with torch.no_grad():  # biases and norms off their init, so a dropped one shows
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def logits(m, ids):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    return m(ids, positions, torch.ones_like(ids, dtype=torch.bool))


def dequantised_twin(quantised, reference):
    """`reference` (unfused) with each projection's weight replaced by what `quantised` multiplies by."""
    twin = deepcopy(reference)
    for name, m in quantised.named_modules():
        if isinstance(m, Fp8Linear):
            twin.get_submodule(name).weight.copy_(m.dequantized())
    return twin


@pytest.mark.parametrize("scale", SCALES)
def test_quantized_decoder_computes_what_its_dequantised_weights_do(scale):
    reference = model()
    engine = fuse_projections(deepcopy(reference))  # as the engines hold it
    names = {n: id(p) for n, p in engine.named_parameters()}
    quantize_model(engine, scale)

    # What a weight push sees is unchanged: the same parameter objects under the same names.
    assert {n: id(p) for n, p in engine.named_parameters()} == names
    assert engine.state_dict().keys() == reference.state_dict().keys()
    chosen = {n for n, m in engine.named_modules() if isinstance(m, Fp8Linear)}
    assert chosen == {f"model.layers.{i}.{p}" for i in range(2) for p in _paths()}
    assert type(engine.lm_head) is nn.Linear and type(engine.model.embed_tokens) is nn.Embedding

    ids = torch.randint(0, CFG.vocab_size, (3, 17), generator=torch.Generator().manual_seed(5))
    got = logits(engine, ids)
    assert torch.equal(got, logits(dequantised_twin(engine, reference), ids))
    delta = (got.log_softmax(-1) - logits(reference, ids).log_softmax(-1)).abs().max().item()
    print(f"fp8 {scale}: max |Δlogprob| vs fp32 = {delta:.4f}")
    assert 0 < delta < 0.05


def _paths():
    attn = [f"self_attn.{p}" for p in PROJECTIONS[:4]]
    return attn + [f"mlp.{p}" for p in PROJECTIONS[4:]]


def test_requantize_after_a_weight_push_serves_the_new_weights():
    engine = quantize_model(fuse_projections(model(seed=0)), "ue8m0")
    new = model(seed=1)
    ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    old_logits = logits(engine, ids)
    targets = dict(engine.named_parameters())
    with torch.no_grad():  # what `Engine.load_weights` does with a push
        for name, tensor in new.named_parameters():
            targets[name].copy_(tensor)
    assert requantize(engine) == 2 * 7
    fresh = quantize_model(fuse_projections(new), "ue8m0")
    assert torch.equal(logits(engine, ids), logits(fresh, ids))
    assert not torch.equal(logits(engine, ids), old_logits)


def test_requantize_refuses_a_forward_that_would_bypass_the_fp8_weights():
    engine = quantize_model(model(), "fp32")
    fuse_projections(engine)  # re-fused: the forward would read the high-precision fused tensor
    with pytest.raises(ValueError, match="fused again"):
        requantize(engine)
    engine = quantize_model(model(), "fp32")
    engine.batch_invariant = True
    with pytest.raises(ValueError, match="batch-invariant"):
        requantize(engine)
    with pytest.raises(ValueError, match="batch-invariant"):
        quantize_model(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(
    "shape",
    [((3, 50), 512, 768), ((7,), 1024, 1152), ((7,), 896, 1152)],
    ids=["M150-K512", "M7-K1024", "M7-K896"],
)
def test_gpu_fp8_linear_agrees_with_the_dequantised_matmul(scale, shape):
    """On an H100/H200 (sm90, CUDA >= 12.9) fp8_linear runs torch._scaled_mm where K / 128 is a
    multiple of 4; it also quantises the activations (1x128 blocks), so it must equal the fp32 matmul
    of both dequantised operands up to its bf16 output, and stay within fp8's error of the unquantised
    activations. M = 150 and 7 (not multiples of 4) are what cuBLAS refused before M was padded
    (CUBLAS_STATUS_NOT_SUPPORTED); K = 896 (7 blocks) is what gave wrong numbers without an error
    through torch 2.11's _scaled_mm, and must take the bf16 dequantising path, as every other GPU."""
    lead, k, n = shape
    gen = torch.Generator().manual_seed(7)
    linear = nn.Linear(k, n).to("cuda", torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    fp8 = Fp8Linear.from_linear(linear, scale)
    x = torch.randn(*lead, k, generator=gen).to("cuda", torch.bfloat16)
    w, bias = fp8.dequantized(torch.float32), linear.bias.float()
    got = fp8(x)
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, n)
    unquantised = F.linear(x.float(), w, bias)
    cosine = F.cosine_similarity(got.float().flatten(), unquantised.flatten(), dim=0)
    assert cosine > 0.999
    rows = x.reshape(-1, k)
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    scaled = torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9) and k % 512 == 0
    assert _scaled_mm_ok(rows, fp8.qweight, fp8.parts, 128) == scaled
    # Measured on an H100/H200, not derived: fp8 tensor cores accumulate in less than fp32 within a
    # block, so fp32's rounding bound (`helpers.matmul_tolerance`) does not hold for cuBLAS here.
    if scaled:
        xq, xs = quantize_rows(rows, 128, scale)
        x_deq = (xq.float().view(-1, k // 128, 128) * xs[..., None]).view(*lead, k)
        torch.testing.assert_close(got.float(), F.linear(x_deq, w, bias), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got.float(), unquantised, atol=0.05, rtol=0.05)


# ------------------------------------------------------------- the engines' receiving side


def fp8_engine(engine_cls, model: CausalLM, scale: str):
    from tandem.rollout.engine import BuiltinEngine

    kw = dict(max_batch_size=8) if engine_cls is BuiltinEngine else dict(block_size=4, num_kv_blocks=64)
    return engine_cls(model, [2], 0, seed=1, quantization="fp8", fp8_scale=scale, **kw)


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    from tandem.rollout.group import make_groups
    from tandem.sample import Prompt, SamplingParams

    prompts = [[5, 9, 11, 20], [7, 7, 30], [40, 3, 8, 9, 10]]
    samples = make_groups([Prompt(text="p")] * 3, prompts, 2)
    engine.generate(samples, SamplingParams(temperature=0.0, max_new_tokens=6))
    return [(s.response_ids, s.logprobs) for s in samples]


@pytest.mark.parametrize("engine", ["builtin", "paged"])
@pytest.mark.parametrize("scale", SCALES)
def test_an_fp8_engine_quantises_each_push_and_its_sleep_frees_the_fp8_copy(engine, scale):
    """rollout.quantization=fp8: after a push the engine serves the new weights in fp8 (exactly what
    an engine built on them serves), its sleep frees the fp8 copy with the weights, and after wake +
    push it answers as before, bit for bit."""
    from tandem.rollout.engine import BuiltinEngine
    from tandem.rollout.paged_engine import PagedEngine

    cls = {"builtin": BuiltinEngine, "paged": PagedEngine}[engine]
    old, new = CausalLM(CFG), CausalLM(CFG)
    init_weights(old, 0, std=0.1)
    init_weights(new, 1, std=0.1)
    pushed, built = fp8_engine(cls, deepcopy(old), scale), fp8_engine(cls, deepcopy(new), scale)
    assert isinstance(pushed.model.model.layers[0].self_attn.q_proj, Fp8Linear)
    before = greedy(pushed)
    pushed.load_weights(new.named_parameters(), version=1)
    after = greedy(pushed)
    assert after == greedy(built) and after != before
    held = pushed.engine_bytes()
    fp8_bytes = sum(b.nbytes for b in pushed.model.buffers())
    assert fp8_bytes > 0 and pushed.sleep()["memory/engine_bytes"] == held
    assert pushed.engine_bytes() == 0  # the fp8 copy and the weights alike
    pushed.load_weights(new.named_parameters(), version=2)
    assert greedy(pushed) == after
