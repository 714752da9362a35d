"""`tandem simulate --calibrate`: a calibration file measured on this machine, from parts only.

Every figure comes from a microbenchmark of one part of a run, on the recipe's model, engine and
dtypes, never from a run the simulator is then compared with (docs/simulate.md, "Calibration"):

    peak_flops                 matmuls of the model's projection shapes at 2,048 rows, one device
    memory_bytes_per_s         a 256 MB tensor copy, one device
    decode_mfu, *_overhead_s   the rollout engine's decode step (EOS ignored) at batch 1, 8, 32 and
    kv_bandwidth_efficiency    128, and at batch 32 with a long context (the KV cache's per-token cost)
    prefill_mfu                the engine's prefill of long prompts
    train_mfu, forward_mfu     the train worker's step and its logprob forward on a synthetic batch of
                               the workload's lengths (sim.prompt_tokens, sim.length_mean)
    optimizer_update_s         one optimizer step over the policy's parameters
    *_scaling_exponent         the matmuls and the train step on every core against one
    oversubscription_exponent  the matmuls on every core while one more thread computes beside them
    startup_s, call_s          the recipe's actors on Ray: their start-up spans, an empty call
    link_bytes_per_s           a weight push through the run's transport (trainer -> rollout actor)
    reward_s_per_sample        a reward call on the task's held-out prompts

On a CPU a "device" is one core (torch.set_num_threads(1)); the run's threads scale it by the
exponents. On a GPU a device is one GPU and the scaling exponents stay 1 (tensor and data
parallelism are not measured on one device); the Ray parts need Ray (`--calibrate` skips them
with a note where it is not installed, keeping the defaults).
"""

import dataclasses
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
import yaml

from tandem import devices
from tandem.config import Config
from tandem.controller.lengths import TailLengths
from tandem.dtypes import DTYPES
from tandem.model.config import ModelConfig, model_dir
from tandem.model.decoder import CausalLM, meta_model
from tandem.rollout.group import make_groups
from tandem.runtime.roles import build_engine, build_trainer, load_checked_tokenizer
from tandem.sample import Prompt, Sample, SamplingParams, Status
from tandem.sim.costs import Calibration, Costs
from tandem.sim.lengths import response_lengths
from tandem.sim.run import shape_of

PEAK_ROWS = 2048
DECODE_BATCHES = (1, 8, 32, 128)


def best_s(fn: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls after one warm-up (the machine is shared: the minimum is
    the part's own cost, the rest is others' work)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# -- matmuls and memory ------------------------------------------------------------------------------
def projection_shapes(model: CausalLM) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of the model's forward (lm_head included), one per layer."""
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def matmul_flops(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: int = PEAK_ROWS) -> float:
    """FLOP/s of x (rows, in) @ W.T over the model's distinct projection shapes, weighted by count."""
    flops = seconds = 0.0
    for (fan_in, fan_out), count in Counter(shapes).items():
        x, w = torch.randn(rows, fan_in, dtype=dtype), torch.randn(fan_out, fan_in, dtype=dtype)
        flops += 2 * rows * fan_in * fan_out * count
        seconds += best_s(lambda x=x, w=w: F.linear(x, w)) * count
    return flops / seconds


def copy_bytes_per_s(mb: int = 256) -> float:
    """Bytes moved per second (read + write) by a tensor copy far larger than the caches."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_s(lambda: dst.copy_(src))


def contended_speed(shapes: list[tuple[int, int]], dtype: torch.dtype, alone: float) -> float:
    """The matmuls on every core (torch's threads) while one more thread runs matmuls in another
    process, as a fraction of `alone`, their FLOP/s without it: what one thread beyond the cores
    leaves each."""
    rival = subprocess.Popen(
        [sys.executable, "-c", _RIVAL],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        rival.stdout.readline()  # it is computing
        shared = matmul_flops(shapes, dtype)
    finally:
        rival.kill()
        rival.wait()
    return shared / alone


_RIVAL = (
    "import torch, sys\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(512, 512)\n"
    "print('go', flush=True)\n"
    "while True:\n"
    "    a @ a\n"
)


# -- the rollout engine ------------------------------------------------------------------------------
def decode_step_s(engine, batch: int, prompt_len: int, vocab: int, steps: tuple[int, int] = (8, 40)) -> float:
    """Seconds per decode step at `batch` rows: two generate calls of different lengths (EOS
    ignored), so the prefill and the call's fixed cost cancel."""
    t = [best_s(lambda k=k: _generate(engine, batch, prompt_len, k, vocab), repeats=2) for k in steps]
    return (t[1] - t[0]) / (steps[1] - steps[0])


def _generate(engine, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> None:
    rng = random.Random(batch * 1000 + prompt_len)
    ids = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    samples = make_groups([Prompt(text="") for _ in ids], ids, n=1)
    engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True))


def engine_figures(cfg: Config, costs: Costs, flops: float) -> dict[str, float]:
    """decode_mfu, decode_step_overhead_s, kv_bandwidth_efficiency and prefill_mfu
    from the engine's own decode steps and prefill, one device."""
    engine = build_engine(cfg, load_checked_tokenizer(cfg), cfg.run.seed)
    model = _model_cfg(cfg)
    vocab, short = model.vocab_size, 8
    long = max(model.max_position_embeddings - 48, 16)  # room for the longer call's 40 tokens
    steps = {n: decode_step_s(engine, n, short, vocab) for n in DECODE_BATCHES}
    wide = decode_step_s(engine, 32, long, vocab)
    # the KV cache's cost per token of context: the long context's extra time over the short's (a
    # cost under the timing noise reads as the copy's full bandwidth)
    mid = 24  # the mean new-token position of the two calls (8 and 40)
    per_token = max(wide - steps[32], 1e-12) / (32 * (long - short))
    kv_efficiency = costs.kv_bytes_per_token / (per_token * costs.cal.memory_bytes_per_s)
    kv = {n: n * (short + mid) * per_token for n in DECODE_BATCHES}
    # the compute term's slope between the two largest batches, then the fixed cost as the rest
    # (the weights are read at the copy's bandwidth: bandwidth_efficiency 1 of it)
    big, bigger = DECODE_BATCHES[-2:]
    slope = max((steps[bigger] - kv[bigger]) - (steps[big] - kv[big]), 1e-12) / (bigger - big)
    decode_mfu = 2 * costs.shape.active_params / (flops * slope)
    weights = {
        n: costs.shape.params_read(n) * costs.cal.bytes_per_param / costs.cal.memory_bytes_per_s
        for n in steps
    }
    rest = [steps[n] - kv[n] - max(weights[n], n * slope) for n in DECODE_BATCHES]
    prompt = best_s(lambda: _generate(engine, 8, long, 1, vocab), repeats=2) - steps[8]
    fitted = {
        "decode_mfu": min(decode_mfu, 1.0),
        "decode_step_overhead_s": max(statistics.median(rest), 0.0),
        "bandwidth_efficiency": 1.0,
        "kv_bandwidth_efficiency": min(kv_efficiency, 1.0),
        "prefill_mfu": min(2 * costs.shape.active_params * 8 * long / (flops * max(prompt, 1e-9)), 1.0),
    }
    # held out: batch 64, which the figures above never saw, against what they predict
    held = decode_step_s(engine, 64, short, vocab)
    model = Costs(costs.shape, replace(costs.cal, **fitted))
    predicted = model.decode_step_fixed(64, 1) + 64 * (short + mid) * model.kv_s_per_token(1)
    return fitted | {
        **{f"measured_decode_step_s_b{n}": s for n, s in steps.items()},
        "measured_decode_step_s_b32_long": wide,
        "measured_context_long": long,
        "measured_decode_step_s_b64": held,
        "check_decode_step_b64_predicted_over_measured": predicted / held,
    }


# -- the trainer -------------------------------------------------------------------------------------
def workload(cfg: Config, vocab: int) -> list[Sample]:
    """One train step's batch of the workload as the recipe describes it: rollout.batch_size x n
    samples of sim.prompt_tokens prompt tokens and response lengths from the run's own length
    model (rollout.length_tail_alpha's tail where set, else sim.lengths), random token ids."""
    rng = random.Random(cfg.run.seed)
    lengths = _lengths(cfg)
    samples = []
    for g in range(cfg.rollout.batch_size):
        ids = [rng.randrange(3, vocab) for _ in range(cfg.sim.prompt_tokens)]
        for i in range(cfg.rollout.n):
            s = Sample(prompt=Prompt(text=""), prompt_ids=ids, group_id=g, index=i)
            n = lengths(s)
            s.response_ids = [rng.randrange(3, vocab) for _ in range(n)]
            s.logprobs, s.versions, s.loss_mask = [-1.0] * n, [0] * n, [1] * n
            s.reward, s.status, s.finish_reason = float(rng.random() < 0.5), Status.FINISHED, "length"
            samples.append(s)
    return samples


def _lengths(cfg: Config) -> Callable[[Sample], int]:
    r = cfg.rollout
    if r.length_tail_alpha > 0:
        tail = TailLengths(r.length_tail_alpha, r.max_new_tokens, cfg.run.seed)
        return lambda sample: tail.draw()
    return response_lengths(cfg).of


def train_figures(cfg: Config, costs: Costs, flops: float, cores: int) -> dict[str, float]:
    """train_mfu, forward_mfu, optimizer_update_s (one device) and train_scaling_exponent (every
    core against one) from the train worker's own step on the workload's batch."""
    worker = build_trainer(cfg, load_checked_tokenizer(cfg), keep_ref=False)
    samples = workload(cfg, _model_cfg(cfg).vocab_size)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    fwd_flops = costs.forward_flops(lengths)
    updates = len(worker.learner.mini_batches(len(samples))) * cfg.train.epochs
    optimizer = worker.learner.optimizer
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    update = best_s(optimizer.step)
    forward = best_s(lambda: worker.compute_logprobs(samples), repeats=2)
    one = best_s(lambda: worker.train_step(samples), repeats=2)
    torch.set_num_threads(cores)
    every = best_s(lambda: worker.train_step(samples), repeats=2)
    torch.set_num_threads(1)
    fitted = {
        "train_mfu": min(3 * fwd_flops / (flops * max(one - updates * update, 1e-9)), 1.0),
        "forward_mfu": min(fwd_flops / (flops * forward), 1.0),
        "optimizer_update_s": update,
    }
    # held out: half the batch (whole groups), which the figures above never saw
    half = samples[: len(samples) // 2]
    held = best_s(lambda: worker.train_step(half), repeats=2)
    model = Costs(costs.shape, replace(costs.cal, **fitted))
    half_updates = len(worker.learner.mini_batches(len(half))) * cfg.train.epochs
    predicted = model.train_s(lengths[: len(half)], 1, half_updates)
    return fitted | {
        "train_scaling_exponent": _exponent(one / every, cores),
        "measured_train_step_s_half_batch": held,
        "check_train_step_half_batch_predicted_over_measured": predicted / held,
        "measured_train_step_s": one,
        "measured_train_step_s_every_core": every,
        "measured_forward_s": forward,
        "measured_train_tokens": float(sum(lengths)),
    }


def _exponent(speedup: float, cores: int) -> float:
    """x in speedup = cores^x, within (0, 1]."""
    if cores < 2:
        return 1.0
    return min(max(math.log(max(speedup, 1e-9)) / math.log(cores), 0.01), 1.0)


# -- the actors on Ray -------------------------------------------------------------------------------
def ray_figures(cfg: Config, costs: Costs, repeats: int = 20) -> dict[str, float]:
    """startup_s, call_s, link_bytes_per_s and reward_s_per_sample from the recipe's own actors."""
    import ray

    from tandem.runtime.cluster import RayCluster
    from tandem.runtime.roles import build_data

    scratch = tempfile.mkdtemp(prefix="tandem-calibrate-")  # the reward actor's output log goes here
    cfg = replace(cfg, run=replace(cfg.run, out_dir=scratch))
    started_here = not ray.is_initialized()
    if started_here:
        cpus = cfg.placement.num_cpus or None  # a Ray of its own, not a cluster `ray start` recorded
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR")
    cfg = devices.resolve(cfg, ray.cluster_resources().get("GPU", 0))  # as a run on this Ray would
    cluster = RayCluster.start(cfg)
    try:
        ray.get(cluster.built[1], timeout=cfg.run.timeout_s)  # every actor built
        up = cluster.startup()
        startup = max(s.end - s.start for s in up)
        call = _timed_calls(cluster, "reward/0", "ready", repeats)
        push = best_s(lambda: _push(cluster, cfg), repeats=3)
        data = build_data(cfg)
        prompts = data.val_prompts[:64] or [Prompt(text="")]
        samples = [Sample(prompt=p, prompt_ids=[], group_id=i, index=0) for i, p in enumerate(prompts)]
        for s in samples:
            s.response_text = "42"
        score = best_s(lambda: cluster.get([cluster.submit("reward/0", "score", samples)], 600), repeats=2)
    finally:
        cluster.close()
        if started_here:
            ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "startup_s": startup,
        "call_s": call,
        # the weights' bytes as the cost model counts them, so that it gives the push its time
        "link_bytes_per_s": costs.weight_bytes / max(push - call, 1e-9),
        "reward_s_per_sample": max(score - call, 0.0) / len(samples),
        "measured_push_s": push,
    }


def _timed_calls(cluster, worker: str, method: str, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        cluster.get([cluster.submit(worker, method)], 60)
    return (time.perf_counter() - start) / repeats


_versions = iter(range(1, 10**9))


def _push(cluster, cfg: Config) -> None:
    """One weight push as the loop makes it: the trainer sends, every rollout worker receives."""
    version = next(_versions)
    sent = cluster.submit("train/0", "send_weights", version)
    got = [cluster.submit(name, "receive_weights", sent, version) for name in cluster.names["rollout"]]
    cluster.get(got, cfg.run.timeout_s)


# -- the whole calibration ---------------------------------------------------------------------------
def calibrate(cfg: Config, with_ray: bool = True, say=print) -> tuple[Calibration, dict[str, float]]:
    """Measure every part on this machine -> (the calibration, every figure measured)."""
    cfg = devices.resolve(cfg, torch.cuda.device_count(), "this machine")
    gpu = cfg.run.device == "cuda"
    cores = 1 if gpu else int(cfg.placement.num_cpus or torch.get_num_threads())
    dtype = DTYPES[cfg.rollout.dtype]
    shape = shape_of(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shapes = projection_shapes(meta_model(_model_cfg(cfg)))
        say("calibrating: matmuls and memory")
        flops, bandwidth = matmul_flops(shapes, dtype), copy_bytes_per_s()
        base = Calibration(
            device=_device_name(gpu),
            peak_flops=flops,
            memory_bytes_per_s=bandwidth,
            memory_bytes=_memory_bytes(gpu),
            bytes_per_param=float(dtype.itemsize),
            kv_bytes_per_value=float(dtype.itemsize),
        )
        costs = Costs(shape, base)
        say("calibrating: the rollout engine's decode and prefill")
        figures = engine_figures(cfg, costs, flops)
        say("calibrating: the train step")
        figures |= train_figures(cfg, costs, flops, cores)
        if not gpu and cores > 1:
            say("calibrating: every core, and one thread more than cores")
            figures |= core_figures(shapes, dtype, cores, flops)
    finally:
        torch.set_num_threads(threads)
    if with_ray:
        say("calibrating: the recipe's actors on Ray (start-up, calls, a weight push, rewards)")
        figures |= ray_figures(cfg, costs)
    figures |= {"peak_flops": flops, "memory_bytes_per_s": bandwidth}
    known = {f.name for f in dataclasses.fields(Calibration)}
    cal = replace(base, **{k: v for k, v in figures.items() if k in known})
    cal.local_copy_bytes_per_s = cal.link_bytes_per_s  # one machine: the same transport either way
    return cal, figures


def core_figures(shapes: list[tuple[int, int]], dtype: torch.dtype, cores: int, flops: float) -> dict:
    """engine_scaling_exponent (the matmuls on every core against one) and
    oversubscription_exponent (x in: cores + 1 threads on `cores` cores run at (cores / (cores + 1))^x)."""
    torch.set_num_threads(cores)
    try:
        every = matmul_flops(shapes, dtype)
        speed = contended_speed(shapes, dtype, every)
    finally:
        torch.set_num_threads(1)
    oversubscription = math.log(speed) / math.log(cores / (cores + 1))
    return {
        "engine_scaling_exponent": _exponent(every / flops, cores),
        "oversubscription_exponent": min(max(oversubscription, 0.0), 4.0),
        "measured_contended_speed": speed,
    }


def _model_cfg(cfg: Config) -> ModelConfig:
    return ModelConfig.load(model_dir(cfg.model.path))


def _memory_bytes(gpu: bool) -> float:
    if gpu:
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _device_name(gpu: bool) -> str:
    if gpu:
        return torch.cuda.get_device_name()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"cpu-core ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return "cpu-core"


def write(cal: Calibration, figures: dict[str, float], path: str, command: str) -> None:
    """The calibration as YAML, each number's source beside it."""
    lines = [
        f"# Measured by `{command}` on {time.strftime('%Y-%m-%d')}",
        f"# ({cal.device}), torch {torch.__version__}.",
        "# Every number is a microbenchmark of one part (tandem/sim/calibrate.py says which); none comes",
        "# from a run the simulator is compared with. A device is one CPU core (one GPU on a GPU).",
    ]
    for f in dataclasses.fields(Calibration):
        value = getattr(cal, f.name)
        lines.append(f"{f.name}: {_yaml(value)}{_source(f.name, figures)}")
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")


def _yaml(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return yaml.safe_dump(value).strip().removesuffix("\n...")


SOURCES = {
    "device": "this machine's processor",
    "memory_bytes": "this machine's memory (a GPU's own)",
    "bytes_per_param": "rollout.dtype's size",
    "kv_bytes_per_value": "rollout.dtype's size",
    "peak_flops": "matmuls of the model's projection shapes at 2,048 rows",
    "memory_bytes_per_s": "a 256 MB tensor copy (read + write)",
    "bandwidth_efficiency": "weights read at the copy's bandwidth",
    "kv_bandwidth_efficiency": "the decode step's cost per token of context against the copy's bandwidth",
    "decode_mfu": "the decode step's slope from batch 32 to 128",
    "decode_step_overhead_s": "the decode step at batch 1-128 less its matmuls and KV reads",
    "prefill_mfu": "a generate call of one token on long prompts, less a decode step",
    "train_mfu": "the train worker's step on the workload's batch, less its optimizer updates",
    "forward_mfu": "the train worker's logprob forward on the same batch",
    "optimizer_update_s": "one optimizer step over the policy's parameters",
    "train_scaling_exponent": "the train step on every core against one",
    "engine_scaling_exponent": "the matmuls on every core against one",
    "oversubscription_exponent": "the matmuls on every core beside one more thread",
    "startup_s": "the recipe's actors' start-up spans on Ray (the slowest)",
    "call_s": "an empty actor call's round trip",
    "link_bytes_per_s": "a weight push through the run's transport, trainer to rollout actor",
    "local_copy_bytes_per_s": "the same push (one machine)",
    "reward_s_per_sample": "a reward call on the task's held-out prompts, less a call",
}


def _source(key: str, figures: dict[str, float]) -> str:
    measured = key in figures or key in ("device", "memory_bytes", "bytes_per_param", "kv_bytes_per_value")
    if key == "local_copy_bytes_per_s":
        measured = "link_bytes_per_s" in figures
    return f"  # {SOURCES[key]}" if measured else "  # not measured here: the default"
