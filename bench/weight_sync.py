"""Weight sync throughput: every transport, one message per parameter vs bucketed, vs a memcpy;
and delta pushes (sync.delta=true), full against delta.

    python bench/weight_sync.py [--hidden 1024 --layers 2] [--produce-mb 32] [--repeats 5] [--json PATH]
                                [--delta-steps 5] [--qwen-layers N] [--bytes-only]

One sender and one receiver actor on local Ray (a gloo world of two for `broadcast`). A push is
what the driver waits for: the trainer packs and sends version v, the receiver stages all of it
(timed from the driver: send and receive started together, until both return). The baseline is
`dst.copy_(src)` of the same number of bytes in one process. Medians of --repeats pushes after one
warm-up. The default model has the shape of tandem/assets/warmstart-addition (random weights);
--hidden / --layers make a bigger one (--hidden 1024 --layers 2 is about 90 MB in fp32).

Delta pushes, same actors: `delta_push_speedup_<transport>` is the median time of a full push over
a delta push, both in bf16, each after an Adam-sized step of the sender's fp32 weights (every
weight moves by 1e-6, up or down, as Adam's first step at lr 1e-6 moves it), the delta's chain
still short of its next full push; `delta_push_speedup` is the default transport's
(object_store). Then, without Ray, bench/delta_bytes.py's byte figures: `delta_bytes_ratio` (delta
/ full bytes per push over the pushes of the default run's first --delta-steps steps, as resolved
on this machine), `delta_bytes_ratio_bf16` (the same run pushing in bf16, as rollout.dtype=auto
resolves on a GPU), `delta_bytes_ratio_qwen05b` (the Qwen2-0.5B-shaped random model after one
optimizer step at lr 1e-6 in bf16; --qwen-layers fewer layers for a quick check) beside the
encodings it was chosen over (`..._index32`, `..._xor_zlib`) and each one's encode speed
(`delta_encode_bytes_per_s_<encoding>`). --bytes-only skips the pushes on Ray.
"""

import argparse
import dataclasses
import json
import statistics
import time

import ray
import torch
from delta_bytes import default_run_ratio, qwen_ratios
from engine import RANDOM_MODELS

from tandem.config import Config
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.model.decoder import CausalLM, init_weights
from tandem.sync import TRANSPORTS, BucketPlan, StagingBuffer
from tandem.sync import dist as sync_dist

MB = 1 << 20
DELTA_STEP = 1e-6  # how far each weight moves between two delta-timed pushes


def model_config(hidden: int | None, layers: int | None) -> ModelConfig:
    """The warm-start model's shape, optionally wider (intermediate = 2.5 x hidden) or deeper."""
    path = resolve_model_path("builtin:addition") / "config.json"
    cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    if hidden:
        heads = cfg.num_attention_heads
        cfg = dataclasses.replace(
            cfg, hidden_size=hidden, intermediate_size=hidden * 5 // 2, head_dim=hidden // heads
        )
    if layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    return cfg


@ray.remote
class Peer:
    """The trainer's rank 0 (seed 0) or a rollout worker (another seed), with one transport."""

    def __init__(self, name: str, cfg: ModelConfig, seed: int):
        torch.set_num_threads(1)  # two actors share the machine's cores
        self.name = name
        self.model = CausalLM(cfg)
        init_weights(self.model, seed)

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", sync_dist.free_port()

    def join(self, rank: int, addr: str, port: int) -> None:
        self.group = sync_dist.sync_group(rank, 2, addr, port, timeout_s=120)

    def use(
        self, transport: str, produce_mb: float, consume_mb: float, delta: bool = False, bf16: bool = False
    ) -> int:
        """A fresh plan (in bf16: the weights are cast on the way), staging buffer, live weights
        and transport -> the number of buckets."""
        dtype = torch.bfloat16 if bf16 else None
        self.plan = BucketPlan.from_named_tensors(
            self.model.named_parameters(), produce_mb, consume_mb, dtype
        )
        self.staging = StagingBuffer(self.plan)
        self.live = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in self.plan.specs}
        factory = TRANSPORTS.get(transport)
        self.transport = factory(self.plan, self.name, group=self.group, timeout_s=120, delta=delta)
        return self.plan.num_buckets

    def step(self, seed: int) -> None:
        """Every weight moves by DELTA_STEP, up or down."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g).sign(), alpha=DELTA_STEP)

    def send(self, version: int):
        return self.transport.send(((n, p.detach()) for n, p in self.model.named_parameters()), version)

    def receive(self, handle, version: int) -> None:
        self.transport.receive(handle, version, self.staging, timeout_s=120)

    def swap_seconds(self) -> float:
        start = time.perf_counter()
        self.staging.swap_into(self.live)
        return time.perf_counter() - start


def push_seconds(sender, receiver, version: int, collective: bool) -> float:
    """Driver-side wall time of one push: send and receive launched together, until both return."""
    start = time.perf_counter()
    send = sender.send.remote(version)
    ray.get([send, receiver.receive.remote(None if collective else send, version)])
    return time.perf_counter() - start


def memcpy_bytes_per_s(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def measure(
    sender,
    receiver,
    transport: str,
    produce_mb: float,
    consume_mb: float,
    repeats: int,
    delta: bool | None = None,
):
    """-> (buckets, median push seconds, median swap seconds) for one transport and bucket size.
    delta None: the same weights, in their own dtype, every push; False / True: full / delta pushes
    in bf16, the sender stepping (`Peer.step`) before each."""
    options = (transport, produce_mb, consume_mb, bool(delta), delta is not None)
    buckets = ray.get([p.use.remote(*options) for p in (sender, receiver)])[0]
    collective = TRANSPORTS.get(transport).collective
    pushes, swaps = [], []
    for version in range(repeats + 1):  # version 0 warms up (and is a full push)
        if delta is not None:
            ray.get(sender.step.remote(version))
        seconds = push_seconds(sender, receiver, version, collective)
        swap = ray.get(receiver.swap_seconds.remote())
        if version:
            pushes.append(seconds)
            swaps.append(swap)
    return buckets, statistics.median(pushes), statistics.median(swaps)


def delta_speedups(sender, receiver, args) -> dict[str, float]:
    """Per transport: median full push time / median delta push time, bf16, after a step each."""
    figures = {}
    for transport in TRANSPORTS.names():
        push = {
            delta: measure(
                sender, receiver, transport, args.produce_mb, args.consume_mb, args.repeats, delta
            )[1]
            for delta in (False, True)
        }
        figures[f"delta_push_speedup_{transport}"] = push[False] / push[True]
        print(f"{transport:<14}delta push {push[True] * 1e3:.1f} ms, full {push[False] * 1e3:.1f} ms (bf16)")
    figures["delta_push_speedup"] = figures[f"delta_push_speedup_{Config().sync.transport}"]
    return figures


def push_figures(cfg: ModelConfig, args) -> dict[str, float]:
    """The timed figures: every transport per parameter and bucketed, then delta against full."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    sender, receiver = Peer.remote("trainer-0", cfg, 0), Peer.remote("rollout-0", cfg, 1)
    addr, port = ray.get(sender.rendezvous.remote())
    ray.get([sender.join.remote(0, addr, port), receiver.join.remote(1, addr, port)])
    probe = CausalLM(cfg)
    nbytes = BucketPlan.from_named_tensors(probe.named_parameters(), 0, 0).payload_bytes
    n_tensors = len(list(probe.named_parameters()))
    memcpy = memcpy_bytes_per_s(nbytes, args.repeats)
    figures: dict[str, float] = {"model_bytes": nbytes, "memcpy_bytes_per_s": memcpy}
    print(
        f"model: {nbytes / MB:.1f} MB in {n_tensors} tensors (hidden {cfg.hidden_size}, "
        f"{cfg.num_hidden_layers} layers); median of {args.repeats} pushes; 1 sender -> 1 receiver"
    )
    print(f"{'transport':<14}{'mode':<12}{'buckets':>8}{'MB/s':>10}{'vs memcpy':>11}{'swap MB/s':>11}")
    print(f"{'memcpy':<14}{'-':<12}{'-':>8}{memcpy / MB:>10.0f}{1.0:>10.2f}x{'-':>11}")
    for transport in TRANSPORTS.names():
        rates = {}
        for mode, produce_mb in (("per_tensor", 0.0), ("bucketed", args.produce_mb)):
            buckets, push, swap = measure(
                sender, receiver, transport, produce_mb, args.consume_mb, args.repeats
            )
            rates[mode] = nbytes / push
            figures[f"{transport}_{mode}_bytes_per_s"] = rates[mode]
            figures[f"{transport}_{mode}_swap_bytes_per_s"] = nbytes / swap
            print(
                f"{transport:<14}{mode:<12}{buckets:>8}{rates[mode] / MB:>10.0f}"
                f"{rates[mode] / memcpy:>10.3f}x{nbytes / swap / MB:>11.0f}"
            )
        figures[f"{transport}_bucketed_vs_memcpy"] = rates["bucketed"] / memcpy
        figures[f"{transport}_bucketed_vs_per_tensor"] = rates["bucketed"] / rates["per_tensor"]
    figures.update(delta_speedups(sender, receiver, args))
    ray.shutdown()
    return figures


def byte_figures(args) -> dict[str, float]:
    """What delta pushes send (bench/delta_bytes.py), no Ray, nothing timed but the encodings."""
    qwen = qwen_ratios(RANDOM_MODELS["qwen2-0.5b-random"], args.qwen_layers, Config().sync.produce_bucket_mb)
    return {
        "delta_bytes_ratio": default_run_ratio([], args.delta_steps),
        "delta_bytes_ratio_bf16": default_run_ratio(["rollout.dtype=bfloat16"], args.delta_steps),
        "delta_bytes_ratio_qwen05b": qwen.pop("delta_bytes_ratio_qwen05b_block_sparse"),
        **qwen,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, help="hidden size of a bigger random model")
    ap.add_argument("--layers", type=int, help="number of layers of a bigger random model")
    ap.add_argument("--produce-mb", type=float, default=32.0, help="bucketed: sender bucket size")
    ap.add_argument("--consume-mb", type=float, default=8.0, help="receiver copy chunk size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--delta-steps", type=int, default=5, help="default-run steps for delta_bytes_ratio")
    ap.add_argument("--qwen-layers", type=int, help="fewer layers of the Qwen2-0.5B shape (a quick check)")
    ap.add_argument("--bytes-only", action="store_true", help="only the delta byte figures, no pushes on Ray")
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the memcpy baseline gets one core, as each actor does
    figures = {} if args.bytes_only else push_figures(model_config(args.hidden, args.layers), args)
    figures.update(byte_figures(args))
    print(
        "ratios: "
        + ", ".join(
            f"{k} {v:.3f}"
            for k, v in figures.items()
            if k.endswith(("_memcpy", "_tensor")) or "ratio" in k or "speedup" in k
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
