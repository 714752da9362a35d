"""Full checkpoints on disk: written atomically, found again for `run.resume`, pruned to the newest K.

    runs/<name>/checkpoints/
        step_10/          a Hugging Face directory (config.json, model.safetensors, tokenizer),
                          trainer/ (DCP shards of the master weights and Adam's state, rank_<r>.pt),
                          driver.pt (loop, buffer, data cursor, engines' RNGs), config.yaml
        final/            the same, after the last step
        latest            the name of the newest complete checkpoint, replaced last

A checkpoint is written into `.tmp-<name>/`, every file fsynced, then renamed into place, and only
then does `latest` move (its own temporary file, fsync, rename): a crash at any moment leaves the
previous checkpoint and the pointer to it intact.
"""

import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tandem.config import Config
from tandem.errors import TandemError

LATEST = "latest"
TMP = ".tmp-"

# Keys a resumed run must share with the checkpoint: they decide which prompts form which group,
# which weights and optimizer the state belongs to, and the staleness bound the buffer held.
FIXED = [
    "model.path",
    "model.tokenizer",
    "data.task",
    "data.train_files",
    "data.train_size",
    "data.prompt_key",
    "data.max_prompt_length",
    "data.shuffle",
    "run.seed",
    "run.mode",
    "run.generate_ahead_steps",
    "run.max_staleness",
    "rollout.batch_size",
    "rollout.n",
    "rollout.num_workers",
    "rollout.engine",
    "train.num_workers",
    "train.strategy",
    "train.offload",
    "algo.adv_estimator",  # gae's critic has its own state in the checkpoint; the others have none
]


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
        """fsync everything under `tmp`, rename it to `name`, move `latest` to it, prune old ones."""
        for path in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
            _fsync(path)
        _fsync(tmp)
        final = self.root / name
        if final.exists():  # e.g. `final` of a run resumed to go further: set the old one aside first
            old = self.root / f"{TMP}old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync(self.root)
        pointer = self.root / f"{TMP}{LATEST}"
        pointer.write_text(name + "\n")
        _fsync(pointer)
        pointer.replace(self.root / LATEST)
        _fsync(self.root)
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
        """Remove what a crash left half-written (never a complete checkpoint)."""
        for tmp in self.root.glob(f"{TMP}*"):
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()


def write_driver_state(path: Path, state: dict[str, Any]) -> None:
    torch.save(state, path / "driver.pt")


def read_driver_state(path: Path) -> dict[str, Any]:
    # Not weights_only: it holds the loop's `Sample`s and Python's RNG state, written by this run.
    return torch.load(path / "driver.pt", weights_only=False)


def find_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint `run.resume` names: "auto" = the newest complete one of this run (None when
    there is none yet: the run starts fresh), a path = that checkpoint, "" = None."""
    resume = cfg.run.resume
    if not resume:
        return None
    if resume == "auto":
        return Checkpoints(run_dir).latest()
    path = Path(resume)
    if not (path / "driver.pt").is_file() or not (path / "trainer").is_dir():
        raise TandemError(
            f"run.resume={resume!r} is not a complete checkpoint: a directory written by "
            "run.save_every holds driver.pt and trainer/. Use run.resume=auto for the newest "
            f"checkpoint of this run ({run_dir / 'checkpoints'})."
        )
    return path


def check_compatible(saved: Config, cfg: Config, path: Path) -> None:
    """Refuse a resume whose config changed a key the saved state depends on (FIXED)."""
    old, new = _flat(saved), _flat(cfg)
    changed = [k for k in FIXED if old.get(k) != new.get(k)]
    if changed:
        diffs = "; ".join(f"{k}: {old.get(k)!r} in the checkpoint, {new.get(k)!r} now" for k in changed)
        raise TandemError(
            f"Cannot resume from {path}: {diffs}. The saved buffer, data cursor and optimizer state "
            "belong to the checkpoint's values of these keys. Set them back (the checkpoint's "
            f"config is {path / 'config.yaml'}), or start a new run (another run.name, or "
            "run.resume unset). Changing other keys, such as run.steps or logging, is allowed."
        )


def _flat(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, keys in asdict(cfg).items() for key, value in keys.items()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
