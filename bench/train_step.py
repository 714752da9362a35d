"""The train step of the default workload: today's path against the new default, fsdp2 against ddp.

One batch of the default run (`tandem train`: 32 prompts x 8 samples of two-digit addition, sampled
by the built-in engine from `builtin:addition`; rewards drawn at random, which changes no cost) is
trained on, side by side in one run, each configuration in a fresh process so its peak RSS is its
own, alternating configurations between repeats:

- `legacy`: fp32 compute, padded micro-batches, π_old recomputed before the update (today's
  path: the trainer is one version ahead of the batch, so the step is not exactly on-policy);
- `default`: what `tandem train` runs now (train.dtype=auto: bf16 on a CPU with native bf16
  matmuls), packed micro-batches, the exactly-on-policy step skips the recompute;
- `ddp` and `fsdp2`: the default path on 2 ranks (gloo, 1 thread each) under each strategy.

    python bench/train_step.py [--repeats 3] [--steps 4] [--recipe PATH] [--json PATH]

`--recipe` takes the batch and every setting from a recipe instead of the default run: one batch of
`recipes/smollm2-addition.yaml` (8 prompts x 8 samples of SmolLM2-135M-Instruct) measures the
trainer on a real model.

Each configuration also states how far its step is from the machine's limit: `matmul_share` is the
ideal time of the step's matmuls — their FLOPs as PyTorch's FlopCounterMode counts them in one more
step (every mm, bmm and attention product, forward and backward, as they run: a shared prompt
once, the lm_head on response rows only), at the GFLOP/s that plain matmuls of the model's shapes
reach in the same process (`bench/engine.py: matmul_peak`, M = train.micro_batch_tokens rows, the
compute dtype) — over the step's measured time: 1 would be a step that is all matmuls at the
machine's peak.

`--json` writes step_speedup (legacy / default step time), fsdp2_vs_ddp_step_time (fsdp2 / ddp),
optimizer_bytes_per_rank_ratio (fsdp2 / ddp, rank 0's AdamW state), peak_rss_mb_<config>,
step_s_<config> (medians), matmul_share_<config>, `matmul_share` (the default configuration's),
`matmul_peak_gflops` (the default's dtype) and `cpu`.
"""

import argparse
import json
import pickle
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from engine import matmul_peak
from torch.utils.flop_counter import FlopCounterMode

from tandem import devices
from tandem.config.sampling import sampling_params
from tandem.determinism import machine
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.runtime.roles import (
    build_data,
    build_trainer,
    load_checked_tokenizer,
    load_policy,
    pad_token_id,
)
from tandem.runtime.startup import load_config
from tandem.sync import destroy_world, free_port, init_world

CONFIGS = {
    "legacy": ["train.dtype=float32", "train.padding_free=false"],
    "default": [],
    "ddp": ["train.num_workers=2", "train.strategy=ddp"],
    "fsdp2": ["train.num_workers=2", "train.strategy=fsdp2"],
}


def default_batch(path: Path, recipe: str | None) -> None:
    """Generate one batch of the recipe's run (None: the default run) and pickle it to `path`."""
    cfg = devices.resolve(load_config(recipe, ["rollout.dtype=float32"]), 0)
    data = build_data(cfg)
    tokenizer = load_checked_tokenizer(cfg)
    engine = BuiltinEngine(load_policy(cfg, "float32"), [tokenizer.eos_token_id], pad_token_id(tokenizer))
    prompts, ids = data.train.next_batch(cfg.rollout.batch_size)
    samples = make_groups(prompts, ids, cfg.rollout.n)
    engine.generate(samples, sampling_params(cfg, cfg.rollout.temperature))
    rng = random.Random(0)
    for s in samples:
        s.reward = float(rng.random() < 0.5)
    path.write_bytes(pickle.dumps(samples))


def measure(
    rank: int, name: str, world: int, port: int, batch: str, steps: int, out: str, recipe: str | None
) -> None:
    """One configuration in this process: a warm-up step, then `steps` timed steps."""
    torch.set_num_threads(2 // world)
    cfg = devices.resolve(load_config(recipe, CONFIGS[name]), 0)
    trainer = build_trainer(cfg, load_checked_tokenizer(cfg))
    if world > 1:
        init_world(rank, world, "127.0.0.1", port, timeout_s=120)
        trainer.parallelize(torch.distributed.group.WORLD)
    samples = pickle.loads(Path(batch).read_bytes())
    times = []
    for _ in range(steps + 1):
        # legacy: the trainer is a version ahead of the batch, so π_old is recomputed as before
        trainer.version = 1 if name == "legacy" else 0
        start = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - start)
    state = [t for s in trainer.learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in state]
    step_s = statistics.median(times[1:])
    result = dict(
        step_s=step_s,
        rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        optimizer_bytes=sum(t.numel() * t.element_size() for t in local),
        **ideal_matmuls(trainer, samples, step_s),
    )
    Path(out, f"{name}-{rank}.json").write_text(json.dumps(result))
    if world > 1:
        destroy_world()


def ideal_matmuls(trainer, samples, step_s: float) -> dict[str, float]:
    """The matmul FLOPs of one more step (this rank's; counted by PyTorch's FlopCounterMode: every
    mm, bmm and attention product forward and backward, so shared prompts and the lm_head's
    response-only rows count as they run), the peak GFLOP/s of the model's matmul shapes here, and
    the share of the step those FLOPs would take at that peak."""
    learner = trainer.learner
    with FlopCounterMode(display=False) as counter:
        trainer.version = 0
        trainer.train_step(samples)
    flops = counter.get_total_flops()
    peak = matmul_peak(learner.model, learner.cfg.micro_batch_tokens, dtype=learner.dtype)
    return dict(matmul_gflop=flops / 1e9, peak_gflops=peak, matmul_share=flops / (peak * 1e9) / step_s)


def run(name: str, batch: Path, steps: int, out: str, recipe: str | None) -> dict[str, float]:
    world = 2 if "num_workers=2" in " ".join(CONFIGS[name]) else 1
    args = (name, world, free_port(), str(batch), steps, out, recipe)
    mp.spawn(measure, args=args, nprocs=world, join=True)
    ranks = [json.loads(Path(out, f"{name}-{r}.json").read_text()) for r in range(world)]
    return dict(
        step_s=max(r["step_s"] for r in ranks),
        rss_mb=max(r["rss_mb"] for r in ranks),
        optimizer_bytes=ranks[0]["optimizer_bytes"],
        matmul_share=min(r["matmul_share"] for r in ranks),
        peak_gflops=ranks[0]["peak_gflops"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per process (after one warm-up)")
    ap.add_argument("--recipe", help="the batch and settings of this recipe (default: the default run's)")
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp, "batch.pkl")
        default_batch(batch, args.recipe)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
        for _ in range(args.repeats):
            for name in CONFIGS:
                results[name].append(run(name, batch, args.steps, tmp, args.recipe))
    step = {n: statistics.median(r["step_s"] for r in rs) for n, rs in results.items()}
    rss = {n: max(r["rss_mb"] for r in rs) for n, rs in results.items()}
    opt = {n: rs[0]["optimizer_bytes"] for n, rs in results.items()}
    share = {n: statistics.median(r["matmul_share"] for r in rs) for n, rs in results.items()}
    figures = {
        "step_speedup": step["legacy"] / step["default"],
        "fsdp2_vs_ddp_step_time": step["fsdp2"] / step["ddp"],
        "optimizer_bytes_per_rank_ratio": opt["fsdp2"] / opt["ddp"],
        **{f"step_s_{n}": v for n, v in step.items()},
        **{f"peak_rss_mb_{n}": v for n, v in rss.items()},
        **{f"matmul_share_{n}": v for n, v in share.items()},
        "matmul_share": share["default"],
        "matmul_peak_gflops": results["default"][0]["peak_gflops"],
        "cpu": machine("cpu"),
    }
    for n in CONFIGS:
        mb = opt[n] / 2**20
        print(
            f"{n:>8}: {step[n]:.3f} s/step  peak RSS {rss[n]:.0f} MB  AdamW state/rank {mb:.1f} MB  "
            f"matmuls at peak: {share[n]:.0%} of the step"
        )
    print(f"default vs legacy: {figures['step_speedup']:.2f}x faster per step ({figures['cpu']})")
    print(f"fsdp2 vs ddp (2 ranks): {figures['fsdp2_vs_ddp_step_time']:.2f}x the step time, "
          f"{figures['optimizer_bytes_per_rank_ratio']:.2f}x the optimizer bytes per rank")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
