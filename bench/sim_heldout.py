"""`tandem simulate` against published async-vs-sync figures it was never calibrated on.

Each row is one published comparison (verl's fully-async and one-step-off tables, NeMo RL's
performance summary, AReaL's blog): its two arms' setups in tandem's terms, simulated on a
calibration built from datasheets and published kernel-level figures only (recipes/sim-calibration-
h20.yaml, -h100.yaml, -h800.yaml, each number's source beside it) plus the row's own trainer figure
where the stack differs (`cal`, sourced below). The workload is what the row's user knew: its max
response length and, where published (NeMo RL), its mean; where not, one rule for every row: a
lognormal of mean max/8 and sigma 1.0. No figure here was changed after the results were read
(docs/results.md, "Held-out published figures"; `git log` of this file and the calibrations).

    python bench/sim_heldout.py [--rows ID,...] [--json PATH] [--published bench/sim_heldout_published.yaml]
                                [--predicted PATH (an earlier --json: no simulation)]

Prints each row's predicted throughput ratio (the second arm's samples/s over the first's; per GPU
where the arms use different GPU counts) and, with --published, the published ratio, the error and
the median absolute error. --json writes `predicted_<row>`, `published_<row>`, `error_<row>` and
`median_abs_error`, flat.
"""

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tandem.runtime.startup import load_config
from tandem.sim.costs import Calibration
from tandem.sim.run import simulate_run

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Arm:
    gpus: int
    overrides: list[str]


@dataclass
class Row:
    id: str
    calibration: str  # recipes/sim-calibration-<this>.yaml
    base: list[str]  # both arms
    first: Arm  # the baseline (sync, or on-policy)
    second: Arm
    cal: dict[str, float] = field(default_factory=dict)  # the row's own trainer figures (sourced below)


def lengths(max_new: int, mean: float | None = None) -> list[str]:
    """The workload as its user knew it: the max, and the published mean or the rule's max / 8."""
    return [
        f"rollout.max_new_tokens={max_new}",
        "sim.lengths=lognormal",
        f"sim.length_mean={mean or max_new / 8:g}",
        "sim.length_sigma=1.0",
    ]


COMMON = ["run.val_every=0", "data.val_size=0", "data.train_size=100000", "sim.prompt_tokens=256"]
COLOCATED = ["placement.groups=[]", "placement.ratios=[]"]


def split(rollout: float) -> list[str]:
    return ["placement.groups=[[actor_train],[generate]]", f"placement.ratios=[{1 - rollout:g},{rollout:g}]"]


# -- verl fully-async (verl/experimental/fully_async_policy/README.md, setups in the module doc) ----
# One tandem step = one verl local update (require_batches x ppo_mini_batch_size prompts), weights
# pushed every trigger_parameter_sync_step steps, max_staleness = trigger x (1 + staleness) - 1
# rounded down, partial rollout = abort; the sync baseline: 512 prompts per step, colocated.
VERL_7B = [
    *COMMON, "sim.model=qwen2.5-7b", "sim.tensor_parallel=4", "sim.kv_memory_fraction=0.8",
    "rollout.n=16", "rollout.max_batch_size=1024", *lengths(28672),
]  # fmt: skip
VERL_SYNC = Arm(0, [
    "run.mode=sync", "run.steps=5", "sim.warmup_steps=1", "rollout.batch_size=512",
    "train.mini_batch_size=512", "algo.corrections=[]", "sync.every=1", *COLOCATED,
])  # fmt: skip


def verl_async(staleness: int, partial: bool, rollout_share: float = 0.5, steps: int = 25) -> list[str]:
    return [
        "run.mode=async", f"run.steps={steps}", "sim.warmup_steps=4", f"run.max_staleness={staleness}",
        "rollout.batch_size=128", "train.mini_batch_size=512", "algo.corrections=[bypass]",
        "sync.every=4", f"rollout.on_update={'abort' if partial else 'drain'}", "rollout.chunk_groups=1",
        "rollout.calls_per_worker=64", "sim.generate_calls=64", *split(rollout_share),
    ]  # fmt: skip


def at(arm: Arm, gpus: int) -> Arm:
    return Arm(gpus, arm.overrides)


VERL_FA = [
    Row("verl-fa-7b-32", "h20", VERL_7B, at(VERL_SYNC, 32), Arm(32, verl_async(5, True))),
    Row("verl-fa-7b-64", "h20", VERL_7B, at(VERL_SYNC, 64), Arm(64, verl_async(5, True))),
    Row("verl-fa-7b-128", "h20", VERL_7B, at(VERL_SYNC, 128), Arm(128, verl_async(5, True))),
    Row("verl-fa-mode-128-stream", "h20", VERL_7B, at(VERL_SYNC, 128), Arm(128, verl_async(3, False))),
    Row("verl-fa-stale-128-0.1", "h20", VERL_7B, at(VERL_SYNC, 128), Arm(128, verl_async(3, True))),
    Row("verl-fa-stale-128-0.3", "h20", VERL_7B, at(VERL_SYNC, 128), Arm(128, verl_async(4, True))),
    # Qwen3-30B-A3B-Base, Megatron trainer, GRPO with a KL loss (a reference forward), 8K responses,
    # 96 rollout : 32 train, require_batches 1 (the script) x 128 prompts, trigger 4, staleness 0.5.
    # Trainer: Megatron-Bridge's Qwen3-30B-A3B on 16 H100s, 205-208 TFLOP/s per GPU (26.02-26.04):
    # 0.21 of a BF16 peak, the only MoE training figure published for this model. Push: verl's own
    # checkpoint-engine table, NCCL path, 30B-A3B 16:16 in 15.76 s: 61 GB / 15.76 s.
    Row(
        "verl-fa-30b",
        "h20",
        [
            *COMMON,
            "sim.model=qwen3-30b-a3b",
            "sim.tensor_parallel=4",
            "sim.kv_memory_fraction=0.7",
            "rollout.n=16",
            "rollout.max_batch_size=1024",
            "algo.kl_coef=0.001",
            *lengths(8192),
        ],
        Arm(128, [*VERL_SYNC.overrides, "train.mini_batch_size=2048"]),
        Arm(128, [*verl_async(5, True, rollout_share=0.75), "train.mini_batch_size=2048"]),
        cal={"train_mfu": 0.21, "forward_mfu": 0.21, "link_bytes_per_s": 61.1e9 / 15.76},
    ),  # fmt: skip
]

# -- verl one-step-off (recipe/one_step_off_policy/README.md) -----------------------------------------
# 512 prompts x n 12 (the scripts: the README gives no n), mini-batches of 32 prompts, pi_old
# recomputed; one_step_off on 4 generation : 12 training GPUs against all 16 colocated; vLLM TP 2.
OSP = [*COMMON, "sim.model=qwen2.5-7b", "sim.tensor_parallel=2", "sim.kv_memory_fraction=0.8", "rollout.n=12",
       "rollout.batch_size=512", "train.mini_batch_size=384", "algo.corrections=[]", "run.steps=6",
       "sim.warmup_steps=2", "rollout.max_batch_size=1024"]  # fmt: skip
OSP_SYNC = Arm(16, ["run.mode=sync", *COLOCATED])
OSP_OFF = Arm(16, ["run.mode=one_step_off", "run.generate_ahead_steps=1", *split(0.25)])
# Megatron-LM's GPT weak scaling on H100: 41-48% MFU (its README): 0.44 for a Megatron trainer.
MEGATRON_DENSE = {"train_mfu": 0.44, "forward_mfu": 0.44}
VERL_OSP = [
    Row("verl-osp-7b-fsdp", "h20", [*OSP, *lengths(20480)], OSP_SYNC, OSP_OFF),
    Row("verl-osp-7b-mcore", "h20", [*OSP, *lengths(8192)], OSP_SYNC, OSP_OFF, cal=MEGATRON_DENSE),
    # PR #4307's 128-card figure: its 64:64 script (28K, n 16, TP 4) against the 128-card colocated run
    Row(
        "verl-osp-7b-128",
        "h20",
        [
            *VERL_7B,
            "rollout.batch_size=512",
            "train.mini_batch_size=512",
            "algo.corrections=[]",
            "run.steps=6",
            "sim.warmup_steps=2",
        ],
        Arm(128, ["run.mode=sync", *COLOCATED]),
        Arm(128, ["run.mode=one_step_off", "run.generate_ahead_steps=1", *split(0.5)]),
    ),  # fmt: skip
]

# -- NeMo RL performance summary (docs/about/performance-summary.md) ------------------------------------
# GRPO, prompts x n per step, 512 samples per update, pi_old recomputed; on-policy: colocated
# (vLLM at gpu_memory_utilization 0.6); k-step off: async with max_staleness k on a gen : train
# split, in-flight weight updates (continue). Lengths: the max and the published mean generated
# length of the row. Trainer: Megatron (dense: 0.44 above; MoE: 0.21 above for Qwen3-30B-A3B,
# Megatron-Bridge's Qwen3-235B-A22B on 256 H100s 233-253 TFLOP/s per GPU: 0.24).


def nemo(model: str, prompts: int, n: int, max_len: int, mean: float, tp: int) -> list[str]:
    return [
        *COMMON, f"sim.model={model}", f"sim.tensor_parallel={tp}", f"rollout.batch_size={prompts}",
        f"rollout.n={n}", "train.mini_batch_size=512", "algo.corrections=[]", "run.steps=12",
        "sim.warmup_steps=3", "rollout.max_batch_size=1024", *lengths(max_len - 256, mean),
    ]  # fmt: skip


def nemo_on(gpus: int, *more: str) -> Arm:
    return Arm(gpus, ["run.mode=sync", *COLOCATED, "sim.kv_memory_fraction=0.6", *more])


def nemo_off(gpus: int, gen_share: float, age: int = 1) -> Arm:
    return Arm(
        gpus,
        ["run.mode=async", f"run.max_staleness={age}", "rollout.on_update=continue",
         "sim.kv_memory_fraction=0.8", "rollout.chunk_groups=1", "rollout.calls_per_worker=64",
         "sim.generate_calls=64", *split(gen_share)],
    )  # fmt: skip


# The Qwen3-32B and -30B-A3B recipes check-point no activations (the calibration's default does).
NO_AC = {"activation_checkpointing": False}
MOE_30B = {"train_mfu": 0.21, "forward_mfu": 0.21, **NO_AC}
MOE_235B = {"train_mfu": 0.24, "forward_mfu": 0.24}
NEMO = [
    Row("nemo-v0.5-llama8b-1off-16", "h100", nemo("llama-3.1-8b", 64, 32, 4096, 1123, 1),
        nemo_on(16), nemo_off(16, 0.5), cal=MEGATRON_DENSE),
    Row("nemo-v0.5-q32b-1off-64", "h100", nemo("qwen3-32b", 64, 32, 4096, 3252, 4),
        nemo_on(32), nemo_off(64, 0.5), cal={**MEGATRON_DENSE, **NO_AC}),
    Row("nemo-v0.6-q30b-1off-32", "h100", nemo("qwen3-30b-a3b", 64, 32, 4096, 3201, 2),
        nemo_on(32), nemo_off(32, 0.5), cal=MOE_30B),
    Row("nemo-v0.6-q30b-8off-192", "h100", nemo("qwen3-30b-a3b", 64, 32, 4096, 3206, 2),
        nemo_on(32), nemo_off(192, 64 / 192, age=8), cal=MOE_30B),
    Row("nemo-v0.6-q235b-1off-256", "h100", nemo("qwen3-235b-a22b", 16, 32, 8192, 5721, 8),
        nemo_on(256, "sim.tensor_parallel=16"), nemo_off(256, 0.5), cal=MOE_235B),
]  # fmt: skip

# -- AReaL (blog/AReaL_v0_3.md, Table 2) ------------------------------------------------------------------
# R1-Distill-Qwen 1.5B on 128 and 7B on 192 GPUs (H800, inferred), 512 prompts x 16, 4 mini-batches,
# pi_old recomputed (decoupled PPO), interruptible generation (abort); 3/4 of the GPUs generate (its
# benchmark config), SGLang TP 1; async: staleness 4; sync: the same system at staleness 0. Max new
# tokens 27,648 (its default config; the table does not restate it). Trainer: Megatron-class (0.44).
AREAL = [
    *COMMON, "rollout.batch_size=512", "rollout.n=16", "train.mini_batch_size=2048", "algo.corrections=[]",
    "run.mode=async", "rollout.on_update=abort", "rollout.chunk_groups=1", "rollout.calls_per_worker=64",
    "sim.generate_calls=64", "sim.tensor_parallel=1", "sim.kv_memory_fraction=0.8", "run.steps=12",
    "sim.warmup_steps=3", "rollout.max_batch_size=1024", *split(0.75), *lengths(27648),
]  # fmt: skip
AREAL_ROWS = [
    Row("areal-1.5b-128", "h800", [*AREAL, "sim.model=r1-distill-qwen-1.5b"],
        Arm(128, ["run.max_staleness=0"]), Arm(128, ["run.max_staleness=4"]), cal=MEGATRON_DENSE),
    Row("areal-7b-192", "h800", [*AREAL, "sim.model=qwen2.5-7b"],
        Arm(192, ["run.max_staleness=0"]), Arm(192, ["run.max_staleness=4"]), cal=MEGATRON_DENSE),
]  # fmt: skip

ROWS = [*VERL_FA, *VERL_OSP, *NEMO, *AREAL_ROWS]


def simulate(row: Row, arm: Arm, label: str):
    cal = Calibration.load(ROOT / "recipes" / f"sim-calibration-{row.calibration}.yaml")
    cal = dataclasses.replace(cal, **row.cal)
    cfg = load_config(None, [*row.base, *arm.overrides])
    return simulate_run(cfg, label, arm.gpus, cal)


def predict(row: Row) -> dict[str, float]:
    """The second arm's samples/s over the first's (per GPU where their GPU counts differ)."""
    first, second = simulate(row, row.first, "first"), simulate(row, row.second, "second")
    per_gpu = row.first.gpus / row.second.gpus
    return {
        f"predicted_{row.id}": second.samples_per_s / first.samples_per_s * per_gpu,
        f"step_s_first_{row.id}": first.step_s,
        f"step_s_second_{row.id}": second.step_s,
        f"samples_per_s_first_{row.id}": first.samples_per_s,
        f"samples_per_s_second_{row.id}": second.samples_per_s,
    }


def of_row(figures: dict[str, float], row: Row) -> dict[str, float]:
    """An earlier run's figures of this row (predicted_<id>, step_s_first_<id>, ...)."""
    return {k: v for k, v in figures.items() if k.endswith(f"_{row.id}")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", help="comma-separated row ids (default: every row)")
    p.add_argument("--published", help="a YAML of row id -> published ratio: adds the errors")
    p.add_argument("--predicted", help="take the predictions from an earlier --json instead of simulating")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    args = p.parse_args()
    earlier = json.loads(Path(args.predicted).read_text()) if args.predicted else None
    wanted = set(args.rows.split(",")) if args.rows else {r.id for r in ROWS}
    published = yaml.safe_load(Path(args.published).read_text()) if args.published else {}
    figures, errors = {}, []
    print(f"{'row':<28} {'predicted':>9} {'published':>9} {'error':>7}")
    for row in [r for r in ROWS if r.id in wanted]:
        figures |= predict(row) if earlier is None else of_row(earlier, row)
        got, line = figures[f"predicted_{row.id}"], f"{row.id:<28} {figures[f'predicted_{row.id}']:>8.2f}x"
        if row.id in published:
            want = float(published[row.id])
            errors.append(got / want - 1)
            figures |= {f"published_{row.id}": want, f"error_{row.id}": errors[-1]}
            line += f" {want:>8.2f}x {errors[-1]:>+7.0%}"
        print(line, flush=True)
    if errors:
        figures["median_abs_error"] = statistics.median(abs(e) for e in errors)
        print(f"median absolute error over {len(errors)} rows: {figures['median_abs_error']:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    sys.exit(main())
