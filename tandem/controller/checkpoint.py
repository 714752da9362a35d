"""Full checkpoints on disk: written atomically, found again for `run.resume`, pruned to the newest K.

    runs/<name>/checkpoints/
        step_10/          a Hugging Face directory (config.json, model.safetensors, tokenizer),
                          trainer/ (DCP shards of the master weights and Adam's state, rank_<r>.pt),
                          driver.pt (loop, buffer, data cursor, engines' RNGs), config.yaml,
                          checksums.json (each file's size and CRC-32 as written)
        final/            the same, after the last step
        latest            the name of the newest complete checkpoint, replaced last

A checkpoint is written into `.tmp-<name>/`, every file fsynced, then renamed into place, and only
then does `latest` move (its own temporary file, fsync, rename): a crash at any moment leaves the
previous checkpoint and the pointer to it intact. Before the rename, `checksums.json` records each
file's size and CRC-32 (`tandem.checksums`). A checkpoint damaged later (a copy cut short, a
deleted file, a flipped byte) is found before a resume starts (`tandem.runtime.resume`):
`run.resume=auto` falls back to the newest intact one, an explicit path is refused.
"""

import shutil
from pathlib import Path
from typing import Any

import torch

from tandem import checksums
from tandem.config import Config, save_config
from tandem.controller.calls import ROUTES, Kind
from tandem.controller.protocol import CallFailed, Cluster, WorkerDied
from tandem.controller.timeline import Span
from tandem.errors import TandemError
from tandem.paths import fsync, replace_dir

LATEST = "latest"
TMP = ".tmp-"


class Checkpoints:
    """The checkpoints directory of one run."""

    def __init__(self, run_dir: Path, keep: int = 0):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep  # newest step_* checkpoints kept; 0 = all

    def begin(self, name: str) -> Path:
        """A fresh temporary directory to write checkpoint `name` into."""
        tmp = self.root / f"{TMP}{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, name: str) -> Path:
        """Record every file's checksum (`tandem.checksums`), fsync everything under `tmp`, rename it
        to `name`, move `latest` to it, prune old ones."""
        checksums.record(tmp)
        final = self.root / name  # already there (`final` of a run resumed to go further): set aside first
        replace_dir(tmp, final, self.root / f"{TMP}old-{name}")
        pointer = self.root / f"{TMP}{LATEST}"
        pointer.write_text(name + "\n")
        fsync(pointer)
        pointer.replace(self.root / LATEST)
        fsync(self.root)
        self.prune()
        return final

    def prune(self) -> None:
        steps = sorted(
            (p for p in self.root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
        )
        latest = self.latest()
        for old in steps[: -self.keep] if self.keep else []:
            if old != latest:
                shutil.rmtree(old)

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if path.is_dir() else None

    def clear_partial(self) -> None:
        """Remove what a crash left half-written (never a complete checkpoint). A crash between an
        overwrite's two renames (`commit`) left the old checkpoint set aside and none in its place:
        the old one goes back, so a checkpoint is the old or the new one, never neither."""
        for old in self.root.glob(f"{TMP}old-*"):
            final = self.root / old.name.removeprefix(f"{TMP}old-")
            if not final.exists():
                old.rename(final)
        for tmp in self.root.glob(f"{TMP}*"):
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()


def write_driver_state(path: Path, state: dict[str, Any]) -> None:
    torch.save(state, path / "driver.pt")


def read_driver_state(path: Path) -> dict[str, Any]:
    # Not weights_only: it holds the loop's `Sample`s and Python's RNG state, written by this run.
    return torch.load(path / "driver.pt", weights_only=False)


def save_checkpoint(
    cluster: Cluster, cfg: Config, checkpoints: Checkpoints, name: str, driver: dict[str, Any]
) -> tuple[Path, list[Span]]:
    """A full checkpoint at this step boundary, written atomically -> its path, the ranks' spans.
    Every train (and critic) rank writes its part (under fsdp2 the weights are gathered from all
    shards, the optimizer state stays sharded); `driver` (`Loop.state_dict`) joins it with each
    engine's sampling stream. A rank that dies raises WorkerDied with its `worker` set."""
    tmp = checkpoints.begin(name)
    saves = {w: cluster.submit(w, ROUTES[Kind.SAVE].method, str(tmp)) for w in _ranks(cluster, Kind.SAVE)}
    streams = [cluster.submit(w, ROUTES[Kind.RNG_STATE].method) for w in _ranks(cluster, Kind.RNG_STATE)]
    spans = []
    try:
        for worker, handle in saves.items():
            try:
                spans += cluster.get([handle], cfg.run.timeout_s)
            except WorkerDied as e:
                e.worker = worker
                raise
        write_driver_state(
            tmp, {**driver, "engine_rngs": _engine_streams(cluster, streams, cfg.run.timeout_s)}
        )
        save_config(cfg, tmp / "config.yaml")
        return checkpoints.commit(tmp, name), spans
    except (CallFailed, OSError) as e:  # e.g. a full disk
        raise TandemError(
            f"Writing checkpoint {name} failed; the previous one ({checkpoints.latest()}) is intact: {e}"
        ) from None


def load_workers(cluster: Cluster, path: Path, timeout: float) -> dict[str, Any]:
    """The workers' part of a resume from the checkpoint at `path`: the trainers load their state,
    the engines their sampling streams -> the driver's state, for `Loop.load_state_dict`."""
    state = read_driver_state(path)
    load = ROUTES[Kind.LOAD].method
    versions = cluster.get([cluster.submit(w, load, str(path)) for w in _ranks(cluster, Kind.LOAD)], timeout)
    if set(versions) != {state["version"]}:
        raise TandemError(f"{path}: the trainers hold versions {versions}, driver.pt {state['version']}.")
    streams = zip(_ranks(cluster, Kind.SET_RNG_STATE), state["engine_rngs"], strict=True)
    set_rng = ROUTES[Kind.SET_RNG_STATE].method
    cluster.get([cluster.submit(w, set_rng, s) for w, s in streams if s is not None], timeout)
    return state


def _ranks(cluster: Cluster, kind: Kind) -> list[str]:
    """Every worker of the roles that run `kind`, role by role in the table's order."""
    return [w for role in ROUTES[kind].roles for w in cluster.names.get(role, [])]


def _engine_streams(cluster: Cluster, handles: list, timeout: float) -> list:
    out = []
    for handle in handles:
        try:
            out.extend(cluster.get([handle], timeout))
        except WorkerDied:  # a dead worker restarts with a fresh stream
            out.append(None)
    return out
