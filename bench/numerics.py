"""The seeds' numerics, measured: how far the engine's logprobs are from the trainer's in each
precision, how often bf16 routing picks other experts, and what routing replay (R3) changes.

    python bench/numerics.py [--model builtin:addition] [--moe-model builtin:addition-moe]
                             [--device cpu] [--prompts 64] [--json PATH]

1. Engine vs trainer, on --model (the default task's): the built-in engine samples --prompts
   held-out prompts x 8 at temperature 1, the trainer (fp32 master weights) recomputes the logprobs
   of the sampled tokens; `mismatch_kl_*` is KL(μ ‖ π_old) by the k3 estimator (the run's
   `mismatch/kl`), `mismatch_max_*` the max |Δlogprob|. Rows: fp32 engine vs fp32 trainer; bf16 vs
   bf16; fp8 weights (fp32 block scales, then UE8M0 scales) with bf16 compute vs the bf16 trainer.
2. Router precision, on --moe-model: the responses of (1) sampled on the MoE model in bf16, each
   token's top-k experts per MoE layer with the router in fp32 (`model.router_dtype=float32`) and in
   bf16 (`model`); `router_topk_flip_rate_bf16` = share of token-layer top-k sets that differ.
3. Routing replay: the bf16 engine records its experts; the bf16 trainer's forward routes on its own
   (`routing_agreement_r3_off`, share of token-layer top-k sets equal to the engine's, and the
   mismatch) or replays the engine's (`routing_agreement_r3_on`).

`--json` writes every figure as one flat object. No Ray: runs on a GPU machine with torch only.
"""

import argparse
import json
from dataclasses import replace

import torch

from tandem.algo import mismatch_metrics
from tandem.config import AlgoConfig, TrainConfig
from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import TASKS
from tandem.data.template import encode_prompts
from tandem.data.tokenizer import load_tokenizer
from tandem.model.checkpoint import load_model
from tandem.model.config import resolve_model_path
from tandem.model.experts import Routing, agreement, routing, set_router_dtype
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.sample import Sample, SamplingParams
from tandem.train.batch import packed, pad_rows
from tandem.train.worker import TrainWorker

ENGINES = {  # name -> (engine dtype, quantization, fp8 scale, trainer compute dtype)
    "fp32": (torch.float32, "none", "fp32", torch.float32),
    "bf16": (torch.bfloat16, "none", "fp32", torch.bfloat16),
    "fp8_fp32scale": (torch.bfloat16, "fp8", "fp32", torch.bfloat16),
    "fp8_ue8m0": (torch.bfloat16, "fp8", "ue8m0", torch.bfloat16),
}


def batch(path: str, count: int, device: str, **engine_kw) -> tuple[list[Sample], BuiltinEngine]:
    """`count` held-out addition prompts x 8 samples from an engine on `path`, seeded per sample."""
    tokenizer = load_tokenizer(path)
    rows = TASKS.get("addition")().make_rows(count, seed=1, split="test")
    prompts = prompts_from_rows(rows)
    dtype = engine_kw.pop("dtype")
    model = load_model(path, dtype=dtype, device=device)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id
    engine = BuiltinEngine(model, [eos], pad, max_batch_size=1024, **engine_kw)
    samples = make_groups(prompts, encode_prompts(tokenizer, prompts, 64), n=8)
    for i, s in enumerate(samples):
        s.seed = i
    return engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=8)), engine


def trainer(path: str, dtype: torch.dtype, device: str, **algo) -> TrainWorker:
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    model = load_model(path, dtype=torch.float32, device=device)
    return TrainWorker(model, AlgoConfig(**algo), TrainConfig(dtype=name), 0, device=device, dtype=dtype)


def mismatch(samples: list[Sample], worker: TrainWorker) -> dict[str, float]:
    """The run's mismatch/* between the samples' behaviour logprobs and the worker's recompute."""
    width = max(len(s.response_ids) for s in samples)
    old = worker.compute_logprobs(samples)[:, :width]
    behaviour = pad_rows([s.logprobs for s in samples], width)
    mask = pad_rows([[1.0] * len(s.response_ids) for s in samples], width)
    return mismatch_metrics(old, behaviour, mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:addition")
    ap.add_argument("--moe-model", default="builtin:addition-moe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    results: dict[str, float] = {}
    path = resolve_model_path(args.model)
    print(f"engine vs trainer on {args.model} ({args.prompts} prompts x 8, temperature 1)")
    for name, (dtype, quantization, scale, train_dtype) in ENGINES.items():
        samples, _ = batch(path, args.prompts, args.device, dtype=dtype, quantization=quantization,
                           fp8_scale=scale)  # fmt: skip
        m = mismatch(samples, trainer(path, train_dtype, args.device))
        results[f"mismatch_kl_{name}"] = m["mismatch/kl"]
        results[f"mismatch_max_{name}"] = m["mismatch/logprob_abs_diff_max"]
        print(f"  {name:14s} mismatch_kl {m['mismatch/kl']:.3g}   max |Δlogprob| "
              f"{m['mismatch/logprob_abs_diff_max']:.3g}")  # fmt: skip
    results.update(moe_figures(resolve_model_path(args.moe_model), args.prompts, args.device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def routed(model, samples: list[Sample], trace_of) -> torch.Tensor:
    """The experts `model` routes the samples' tokens to, packed, under the `Routing` that
    `trace_of(rows)` gives -> (tokens, L, k): what the layers used."""
    rows = packed(samples, next(model.parameters()).device)
    with torch.no_grad(), routing(model, trace_of(rows)) as trace:
        model(rows.ids, rows.positions, rows.mask, targets=rows.targets)
    return trace.table()


def moe_figures(path, count: int, device: str) -> dict[str, float]:
    """Parts 2 and 3 of the module docstring, on the MoE model at `path`."""
    samples, _ = batch(path, count, device, dtype=torch.bfloat16, record_routing=True)
    engine = packed(samples).routing  # (tokens, L, k) the bf16 engine's experts
    model = load_model(path, dtype=torch.bfloat16, device=device)
    fp32_router = routed(model, samples, lambda rows: Routing(record=True))
    set_router_dtype(model, "model")
    bf16_router = routed(model, samples, lambda rows: Routing(record=True))
    set_router_dtype(model, "float32")
    replayed = routed(model, samples, lambda rows: Routing.replay(rows.routing, model, record=True))
    out = {
        "router_topk_flip_rate_bf16": 1.0 - agreement(fp32_router, bf16_router),
        "routing_agreement_r3_off": agreement(engine, fp32_router),
        "routing_agreement_r3_on": agreement(engine, replayed),
    }
    without = [replace(s, routing=None) for s in samples]
    for name, rows in (("off", without), ("on", samples)):
        m = mismatch(rows, trainer(path, torch.bfloat16, device))
        out[f"mismatch_kl_moe_r3_{name}"] = m["mismatch/kl"]
        out[f"mismatch_max_moe_r3_{name}"] = m["mismatch/logprob_abs_diff_max"]
    print(f"MoE model ({count} prompts x 8, bf16 engine and trainer)")
    print(f"  router top-k flip rate, bf16 vs fp32 router: {out['router_topk_flip_rate_bf16']:.4f}")
    print(f"  routing agreement engine/trainer: R3 off {out['routing_agreement_r3_off']:.4f}, "
          f"on {out['routing_agreement_r3_on']:.4f}")  # fmt: skip
    for name in ("off", "on"):
        print(f"  R3 {name:3s} mismatch_kl {out[f'mismatch_kl_moe_r3_{name}']:.3g}   max |Δlogprob| "
              f"{out[f'mismatch_max_moe_r3_{name}']:.3g}")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
