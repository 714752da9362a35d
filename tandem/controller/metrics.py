"""Metrics out of a run: JSONL every step, TensorBoard and W&B when asked, a live progress bar.

`metrics.jsonl` has a line per train step (with "version"), per validation (with "val/accuracy")
and the summary at the end; `batches.jsonl` names the prompt groups each step trained. A run resumed
from step V keeps the train lines up to V and everything before V, and drops the rest: the resumed
run writes them again (validation at V included), so no step appears twice.
"""

import json
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tandem.errors import TandemError


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        tensorboard: bool,
        progress: bool,
        resume_step: int | None = None,
        wandb: dict[str, Any] | None = None,
    ):
        """wandb: `wandb.init`'s arguments (project, entity, name, mode, config), or None for no W&B."""
        files = [run_dir / "metrics.jsonl", run_dir / "batches.jsonl"]
        if resume_step is None:
            for f in files:
                f.write_text("")
        else:
            for f in files:
                _keep_until(f, resume_step)
        self.file, self.batches = (f.open("a") for f in files)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if wandb is not None:
            self.wandb = _start_wandb(run_dir, wandb, resume_step is not None)
        self.bar = tqdm(
            total=total_steps,
            initial=resume_step or 0,
            desc="train",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        shown = {"reward": metrics.get("critic/score/mean"), "val_acc": metrics.get("val/accuracy")}
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None}, refresh=False)
        if "critic/score/mean" in metrics:  # a train step (validation lines do not advance the bar)
            self.bar.update(1)

    def log_batch(self, step: int, group_ids: list[int]) -> None:
        self.batches.write(json.dumps({"step": step, "groups": group_ids}) + "\n")
        self.batches.flush()

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        self.batches.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            # finish() returns once W&B's service has the last records, not once they are on disk;
            # teardown waits for the service to close its files (CI once read an offline run's
            # file right after close and found only its header).
            require_wandb().teardown()


def require_wandb() -> Any:
    """The wandb module, or a TandemError saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise TandemError(
            "run.wandb=true needs the wandb package: pip install wandb (or pip install -e '.[wandb]')."
        ) from None
    return wandb


def _start_wandb(run_dir: Path, options: dict[str, Any], resumed: bool) -> Any:
    """A W&B run writing under run_dir/wandb; a resumed tandem run continues the same W&B run (its
    id is kept in run_dir/wandb_id). TandemError when the package is missing."""
    wandb = require_wandb()
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    return wandb.init(dir=str(run_dir), id=run_id, resume="allow", **options)


def _keep_until(path: Path, step: int) -> None:
    """Keep the lines before `step`, and the train steps' lines (and batches) of `step` itself."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run, cut mid-write
            continue
        if row["step"] < step or (row["step"] == step and ("version" in row or "groups" in row)):
            kept.append(line + "\n")
    path.write_text("".join(kept))
