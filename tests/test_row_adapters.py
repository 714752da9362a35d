"""Rows of different LoRA adapters in one forward (`tandem.model.row_adapters`) and in one engine
call (`DecoderEngine.load_adapters`): each row computes what its adapter alone computes, the base's
rows what the base does; in the batch-invariant mode bit for bit what its own trainer computes in
the unmerged form (`set_lora_form`), whatever the other rows and the batch's make-up."""

import copy

import pytest
import torch
from helpers import EOS, VOCAB, prompts, tiny_model

from tandem.config import LoraConfig
from tandem.model import batch_invariant as bi
from tandem.model.fuse import fuse_projections
from tandem.model.lora import adapter_names, apply_lora, merge_lora, set_lora_form
from tandem.model.row_adapters import RowAdapters
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.paged_engine import PagedEngine
from tandem.sample import Prompt, Sample, SamplingParams
from tandem.train.batch import sequence_logprobs

# Every projection and the LM head (tied to the embedding: Tinker's train_unembed, its default)
LORA = LoraConfig(
    rank=4,
    alpha=8.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
)
NAMES = ["a", "b", "c"]


def trainer(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base (tiny_model(0)) with an adapter of its own: A from `seed`, B random (not zero)."""
    model = apply_lora(tiny_model(0), LORA, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.to(dtype).requires_grad_(False).eval()


def pushed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a push of `model` carries: its adapters, by name."""
    params = dict(model.named_parameters())
    return {n: params[n].detach().clone() for n in adapter_names(model)}


TRAINERS = {n: trainer(i + 1) for i, n in enumerate(NAMES)}
IDS = torch.randint(3, VOCAB, (5, 9), generator=torch.Generator().manual_seed(3))
ROWS = [0, 1, -1, 2, 0]  # an adapter per row (-1: the base's row)


def forward(model, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    with torch.no_grad():
        return model(ids, torch.arange(t).expand(b, t), torch.ones(b, t, dtype=torch.bool))


def engine_model(dtype: torch.dtype, invariant: bool) -> tuple[torch.nn.Module, RowAdapters]:
    model = fuse_projections(tiny_model(0).to(dtype)).requires_grad_(False)
    model.batch_invariant = invariant
    named = {n: {k: v.to(dtype) for k, v in pushed(TRAINERS[n]).items()} for n in NAMES}
    targets = [n.removesuffix(".lora_A.weight") for n in named["a"] if n.endswith(".lora_A.weight")]
    return model, RowAdapters(named, targets, LORA.alpha / LORA.rank)


def test_each_row_computes_its_own_adapter_and_the_base_rows_the_base():
    model, table = engine_model(torch.float32, invariant=False)
    with table.use(model, ROWS):
        mixed = forward(model, IDS)
    base = forward(model, IDS)
    for r, i in enumerate(ROWS):
        if i < 0:
            assert torch.equal(mixed[r], base[r])
            continue
        alone = forward(fuse_projections(merge_lora(copy.deepcopy(TRAINERS[NAMES[i]]))), IDS[r : r + 1])
        torch.testing.assert_close(mixed[r], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariant_rows_equal_their_unmerged_trainers_bit_for_bit_in_any_company(dtype):
    model, table = engine_model(dtype, invariant=True)
    with table.use(model, ROWS):
        mixed = forward(model, IDS)
    others = [2, 2, 1, 0, -1]  # the same rows beside other adapters, in another order and batch size
    order = [4, 3, 1, 0]
    with table.use(model, [ROWS[r] if r in (0, 3) else others[r] for r in order]):
        again = forward(model, IDS[order])
    for r, i in enumerate(ROWS):
        if i < 0:
            continue
        trained = copy.deepcopy(TRAINERS[NAMES[i]]).to(dtype)
        set_lora_form(trained, "unmerged")
        trained.batch_invariant = True
        assert torch.equal(mixed[r], forward(trained, IDS[r : r + 1])[0])
    assert torch.equal(again[order.index(0)], mixed[0]) and torch.equal(again[order.index(3)], mixed[3])


def test_the_merged_form_stays_tandem_train_s():
    """Without set_lora_form the batch-invariant trainer multiplies by the merged weight, as before;
    the unmerged form differs from it only in rounding."""
    merged, unmerged = copy.deepcopy(TRAINERS["a"]), copy.deepcopy(TRAINERS["a"])
    set_lora_form(unmerged, "unmerged")
    for m in (merged, unmerged):
        m.batch_invariant = True
    reference = forward(fuse_projections(merge_lora(copy.deepcopy(TRAINERS["a"]))), IDS)
    torch.testing.assert_close(forward(merged, IDS), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(forward(unmerged, IDS), reference, atol=1e-5, rtol=0)
    set_lora_form(unmerged, "merged")
    assert torch.equal(forward(unmerged, IDS), forward(merged, IDS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_batch_invariant_linear_gives_a_fused_weight_s_rows_the_separate_weights_bits(dtype):
    """The engine multiplies by the fused q|k|v weight; each projection's columns come out as that
    projection's own weight gives them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32, generator=g).to(dtype)
    parts = [torch.randn(n, 32, generator=g).to(dtype) for n in (32, 16, 16)]
    fused = bi.linear(x, torch.cat(parts))
    assert torch.equal(fused, torch.cat([bi.linear(x, w) for w in parts], dim=-1))


def lora_engine(dtype: torch.dtype, invariant: bool, engine=BuiltinEngine) -> BuiltinEngine:
    base = tiny_model(0).to(dtype)
    base.batch_invariant = invariant
    kw = dict(num_kv_blocks=64, block_size=4) if engine is PagedEngine else {}
    out = engine(base, [EOS], 0, lora=LORA, **kw)
    out.load_adapters({n: {k: v.to(dtype) for k, v in pushed(TRAINERS[n]).items()} for n in NAMES}, 1)
    return out


def asks(adapters: list[str | None]) -> list[Sample]:
    ids = prompts(len(adapters), seed=4)
    return [
        Sample(Prompt(text=""), p, group_id=g, max_new_tokens=6, seed=10 + g, adapter=a)
        for g, (p, a) in enumerate(zip(ids, adapters, strict=True))
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_call_of_three_adapters_and_the_base_samples_each_row_as_alone(dtype):
    """run.deterministic's engine: each sample of the mixed call gets exactly the tokens and
    logprobs it gets alone, which are its own trainer's logprobs (unmerged form) bit for bit."""
    engine = lora_engine(dtype, invariant=True)
    adapters = ["a", "b", None, "c", "a"]
    params = SamplingParams(temperature=1.0)
    together = engine.generate(asks(adapters), params)
    for g, adapter in enumerate(adapters):
        alone = engine.generate([asks(adapters)[g]], params)[0]
        assert (alone.response_ids, alone.logprobs) == (together[g].response_ids, together[g].logprobs)
        if adapter is None:
            continue
        trained = copy.deepcopy(TRAINERS[adapter]).to(dtype)
        set_lora_form(trained, "unmerged")
        trained.batch_invariant = True
        recompute = sequence_logprobs(trained, [together[g]], 4096, 1.0)[0, : len(alone.logprobs)]
        assert recompute.tolist() == together[g].logprobs


def test_rows_the_engine_holds_no_adapter_for_are_refused_and_a_push_drops_the_table():
    engine = lora_engine(torch.float32, invariant=False)
    with pytest.raises(ValueError, match="'d'"):
        engine.generate(asks(["a", "d"]), SamplingParams())
    engine.load_weights(pushed(TRAINERS["a"]).items(), 2)  # an ordinary push: merged, no table
    assert engine.row_table is None
    with pytest.raises(ValueError, match="does not hold"):
        engine.generate(asks(["a"]), SamplingParams())
    with pytest.raises(ValueError, match="rollout.engine=builtin"):
        lora_engine(torch.float32, invariant=False, engine=PagedEngine).generate(
            asks(["a"]), SamplingParams()
        )
