"""A train worker's resumable state: master weights, optimizer, LR schedule, samplers and RNGs.

The worker's `Learner` saves and loads it (`Learner.save`, `Learner.load`); here are the
checkpoint's layout, the process's RNGs and the checks of a checkpoint before loading it.
The weights and Adam's moments go through `torch.distributed.checkpoint` (DCP), whatever the
strategy: under fsdp2 every rank writes only its own shards (no rank ever holds the whole optimizer
state), and a DCP checkpoint loads into another world size too. The rest is small and per rank:
the LR schedule, the mini-batch shuffle's generator, the process's RNGs and the worker's counters.

Loading after `parallelize` puts back bit for bit what `save_state` saw, so the next train step
computes exactly what it would have computed without the interruption.
"""

import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem import checksums


def dcp():
    """`torch.distributed.checkpoint`, imported when a checkpoint is first saved or loaded: it takes
    ~1 s (2 cores; sympy and DTensor's ops with it), which every process that imports tandem.train
    paid at start-up before."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


SHARDS = "trainer"  # the policy's DCP directory inside a checkpoint
CRITIC = "critic"  # the value model's (algo.adv_estimator=gae)


def rng_states() -> dict[str, Any]:
    """Every RNG of this process: Python's, NumPy's, torch's on the CPU and on each CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(worker, path: Path, directory: str = SHARDS) -> None:
    """Every rank, collectively: `path/<directory>/` (DCP: master weights and optimizer state, each
    rank its shards) and `path/<directory>/rank_<r>.pt` (the rest of this rank's state).
    worker: a `TrainWorker` or `CriticWorker` (its `learner` and its `version`)."""
    worker.learner.save(path / directory, {"version": worker.version})


def load_state(worker, path: Path, directory: str = SHARDS) -> None:
    """Every rank, collectively, after `parallelize`: the state `save_state` wrote into `path`."""
    worker.version = worker.learner.load(path / directory)["version"]


def damaged_state(path: Path, directory: str = SHARDS, ranks: int = 1) -> list[str]:
    """What keeps `load_state` from reading `path/<directory>/` into `ranks` ranks, checked without
    loading it: every file as the checkpoint's `checksums.json` recorded it (a flipped byte inside a
    shard shows only there; an older checkpoint has no record), DCP's `.metadata` unpickles, every
    shard file it names is there and long enough for the bytes it reads, and every rank's
    `rank_<r>.pt` is a whole torch.save archive. [] = intact."""
    root = path / directory
    if not root.is_dir():
        return [f"{root}/ is missing"]
    bad = checksums.damage(path, lambda name: name.startswith(f"{directory}/"))
    if root / ".metadata" in bad:  # what it says of the shards cannot be trusted
        return list(bad.values())
    try:
        metadata = dcp().FileSystemReader(str(root)).read_metadata()
    except Exception as e:  # a missing, truncated or foreign file: unpickling raises anything
        return [f"{root / '.metadata'} is unreadable ({type(e).__name__}: {e})"]
    needed: dict[str, int] = {}  # shard file -> the bytes it must hold
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    found = list(bad.values())
    for name, size in sorted(needed.items()):
        file = root / name
        if file in bad:
            continue
        if not file.is_file():
            found.append(f"{file} is missing")
        elif file.stat().st_size < size:
            found.append(f"{file} is truncated ({file.stat().st_size} of at least {size} bytes)")
    own = sorted({*(root / f"rank_{r}.pt" for r in range(ranks)), *root.glob("rank_*.pt")} - set(bad))
    return found + [problem for file in own if (problem := torch_file_damage(file))]


def torch_file_damage(file: Path) -> str | None:
    """None when `file` is a whole `torch.save` archive: a zip whose every record's CRC matches
    (truncation, a flipped byte and a missing file all show), else what is wrong with it."""
    if not file.is_file():
        return f"{file} is missing"
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"{file} is not a whole torch.save file ({e})"
    return f"{file} is corrupt (record {bad} fails its checksum)" if bad else None


def saved_version(path: Path, directory: str = SHARDS) -> int:
    """The policy version a checkpoint's rank 0 saved (after `damaged_state` found nothing)."""
    return torch.load(path / directory / "rank_0.pt", weights_only=False)["version"]
