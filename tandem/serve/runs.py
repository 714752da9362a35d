"""The training runs the service made, as the REST side lists them (Tinker's `TrainingRun`).

A run is a training model: recorded once, when its creation succeeds, in run.json beside its
checkpoints (`<run.out_dir>/<run.name>/<model id, %-quoted>/run.json`): its base model, LoRA rank,
the session that made it, when, and the user_metadata its client gave (`create_lora_training_client
(user_metadata=...)`: the cookbook keeps its renderer's name there). So a run outlives its model, its
session and the service, as its checkpoints do. A directory a service saved into before runs were
recorded is read from its newest checkpoint's serve.json instead.
"""

import dataclasses
import json
import os
import time
from pathlib import Path

from tandem.serve.checkpoints import META, model_dir, strings

RUN = "run.json"


@dataclasses.dataclass
class Run:
    model_id: str
    session_id: str
    base_model: str
    rank: int  # 0: every weight trains
    attn: bool  # the LoRA adapters' targets
    mlp: bool
    created: float  # seconds since the epoch
    user_metadata: dict[str, str]
    unembed: bool = False  # an adapter on the LM head too (a record from before it: none)


class Runs:
    def __init__(self, root: Path):
        self.root = root

    def record(
        self, model_id: str, session_id: str, base_model: str, shape: dict, user_metadata: dict | None
    ) -> None:
        """Keep a new run's record (shape: rank, attn, mlp, unembed), written whole: a crash leaves it
        or none."""
        lora = (shape["rank"], shape["attn"], shape["mlp"])
        run = Run(
            model_id, session_id, base_model, *lora, time.time(), strings(user_metadata), shape["unembed"]
        )
        folder = model_dir(self.root, model_id)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{RUN}.new"
        tmp.write_text(json.dumps(dataclasses.asdict(run)))
        os.replace(tmp, folder / RUN)

    def get(self, model_id: str) -> Run | None:
        """The run `model_id`, or None when the service never made it (or kept nothing of it)."""
        folder = model_dir(self.root, model_id)
        try:
            return Run(**json.loads((folder / RUN).read_text()))
        except (OSError, ValueError, TypeError):
            return self._from_checkpoints(model_id, folder)

    def _from_checkpoints(self, model_id: str, folder: Path) -> Run | None:
        metas = sorted((folder / "weights").glob(f"*/{META}"), key=lambda p: p.stat().st_mtime)
        for meta in reversed(metas):
            try:
                s = json.loads(meta.read_text())
                lora = (s["rank"], s["attn"], s["mlp"])
                when, unembed = meta.stat().st_mtime, s.get("unembed", False)
                return Run(model_id, model_id.split(":")[0], s["base_model"], *lora, when, {}, unembed)
            except (OSError, ValueError, KeyError):
                continue
        return None
