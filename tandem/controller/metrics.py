"""Metrics out of a run: JSONL every step, TensorBoard when asked, a live progress bar."""

import json
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, tensorboard: bool, progress: bool):
        self.file = (run_dir / "metrics.jsonl").open("w")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = tqdm(
            total=total_steps, desc="train", unit="step", disable=not progress, dynamic_ncols=True
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        shown = {"reward": metrics.get("critic/score/mean"), "val_acc": metrics.get("val/accuracy")}
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None}, refresh=False)
        if "critic/score/mean" in metrics:  # a train step (validation lines do not advance the bar)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()


@contextmanager
def timed(timings: dict[str, float], name: str):
    """Adds the block's wall time to timings[f"timing_s/{name}"]."""
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
