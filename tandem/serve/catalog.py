"""The training runs and checkpoints as the SDK lists them (`types.TrainingRun`, `types.Checkpoint`),
read from what the service keeps: the run records (`tandem.serve.runs`), the checkpoints on disk
(`tandem.serve.checkpoints`: save_state's and save_weights_external's) and the samplers saved by
name (`tandem.serve.snapshots.Named`); and one checkpoint found by its path's parts. A checkpoint
past its expiry is deleted as these look at it.
"""

import datetime
from pathlib import Path

from tinker import types

from tandem.errors import TandemError
from tandem.serve.checkpoints import KINDS, check_model_id, check_name, split
from tandem.serve.futures import NotFound
from tandem.serve.runs import Run
from tandem.serve.service import Service
from tandem.serve.snapshots import Named


def all_runs(service: Service) -> list[Run]:
    ids = dict.fromkeys([*service.checkpoints.model_ids(), *service.models])
    return [r for i in ids if (r := service.runs.get(i)) is not None]


def run_of(service: Service, run_id: str) -> Run:
    run = service.runs.get(check_model_id(run_id))
    if run is None:
        raise NotFound(f"No training run {run_id!r} here.")
    return run


def training_run(service: Service, run: Run) -> types.TrainingRun:
    found = checkpoints_of(service, run.model_id)
    live = service.models.get(run.model_id)
    last = max([run.created, *(c.time.timestamp() for c in found), live.last_request if live else 0.0])
    newest = {c.checkpoint_type: c for c in sorted(found, key=lambda c: c.time)}
    return types.TrainingRun(
        training_run_id=run.model_id,
        base_model=run.base_model,
        model_owner=run.session_id,
        is_lora=run.rank > 0,
        lora_rank=run.rank or None,
        last_request_time=utc(last),
        last_checkpoint=newest.get("training"),
        last_sampler_checkpoint=newest.get("sampler"),
        user_metadata=run.user_metadata or None,
    )


def checkpoints_of(service: Service, run_id: str) -> list[types.Checkpoint]:
    """The run's checkpoints of every kind, oldest first (expired ones deleted on the way)."""
    found = []
    for kind in ("weights", "external_weights"):
        for name in service.checkpoints.names(run_id, kind):
            path, where = service.checkpoints.place(run_id, kind, name)
            meta = service.checkpoints.meta(where)
            size = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
            when = meta.get("saved_at") or where.stat().st_mtime
            found.append(checkpoint(path, when, size, meta))
    snapshots = service.sampling.snapshots
    for path, named in list(snapshots.named.items()):
        if named.model_id == run_id and path in snapshots:
            found.append(checkpoint(path, named.time, None, vars(named)))
    return sorted(found, key=lambda c: c.time)


def checkpoint(path: str, when: float, size: int | None, meta: dict) -> types.Checkpoint:
    _, kind, name = split(path)
    return types.Checkpoint(
        checkpoint_id=f"{kind}/{name}",
        checkpoint_type=KINDS[kind],
        time=utc(when),
        tinker_path=path,
        size_bytes=size,
        public=bool(meta.get("public")),
        user_metadata=meta.get("user_metadata") or None,
        expires_at=utc(meta["expires_at"]) if meta.get("expires_at") else None,
    )


def find(service: Service, run_id: str, kind: str, name: str) -> tuple[str, Path | Named]:
    """A checkpoint by its parts -> its path and its directory (a sampler checkpoint: its record);
    NotFound when there is none (deleted, expired), TandemError for parts that name none."""
    check_kind(kind)
    path, where = service.checkpoints.place(run_id, kind, check_name(name))
    if kind == "sampler_weights":
        snapshots = service.sampling.snapshots
        if path in snapshots.named and path in snapshots:
            return path, snapshots.named[path]
    elif service.checkpoints.exists(where):
        return path, where
    raise NotFound(f"No checkpoint at {path!r} (never saved, deleted, or past its ttl_seconds).")


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise TandemError(f"Checkpoint kind {kind[:40]!r} is not one of {', '.join(KINDS)}.")
    return kind


def utc(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
