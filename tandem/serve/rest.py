"""`tandem serve`'s REST side: what the SDK's `RestClient` asks of training runs and checkpoints.

- Training runs (`list_training_runs`, `get_training_run[_by_tinker_path]`): every model the service
  made (`tandem.serve.runs`), with the user_metadata its client gave at creation; `model_owner` is
  the session that made it; `corrupted` is always false (a failed request leaves a model as it was).
- Checkpoints (`list_checkpoints`, `list_user_checkpoints`, `get_weights_info_by_tinker_path`):
  `save_state`'s (training), `save_weights_external`'s (external) and the samplers saved by name
  (sampler), each with its time, size, user_metadata, expiry and published flag.
- `delete_checkpoint[_from_tinker_path]`; `set_checkpoint_ttl_from_tinker_path`; `publish` /
  `unpublish` (a flag: the service has one owner, so public changes nothing else).
- Downloads: `get_checkpoint_archive_url` (the SDK before 0.38, the cookbook's `weights.download`)
  and `save_weights_external` + `get_external_weights_urls` (0.38): signed URLs under /download
  that need no API key (`tandem.serve.downloads`, what they hold: `tandem.serve.archives`).
- The tokenizer for a client on another machine (`tandem.serve.hub`), and sessions.

The records behind the answers, as the SDK's types: `tandem.serve.catalog`.

A checkpoint or sampler past its ttl_seconds is deleted when next looked at: by these calls, a load,
a sample. `copy_weights` is refused: the service has no projects.
"""

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from tinker import types

from tandem.errors import TandemError
from tandem.serve import wire
from tandem.serve.archives import age_recipients
from tandem.serve.catalog import all_runs, check_kind, checkpoints_of, find, run_of, training_run
from tandem.serve.checkpoints import expiry, split
from tandem.serve.downloads import DOWNLOAD, download_routes
from tandem.serve.futures import NotFound
from tandem.serve.hub import hub_routes
from tandem.serve.service import Service
from tandem.serve.snapshots import Named


class TinkerPath(BaseModel):  # the bodies the SDK sends as plain dicts
    tinker_path: str


class Ttl(BaseModel):
    ttl_seconds: int | None = None


def admits(request: Request, api_key: str) -> bool:
    """Whether a request without the right X-API-Key may pass a service that has a key: a download
    URL (its route checks the signature), or one whose `Authorization: Bearer` is the key
    (huggingface_hub sends HF_TOKEN so, for the tokenizer)."""
    bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
    return request.url.path.startswith(DOWNLOAD) or bearer == api_key


def rest_routes(api: APIRouter, service: Service) -> None:
    run_routes(api, service)
    checkpoint_routes(api, service)
    export_routes(api, service)
    download_routes(api, service)
    hub_routes(api, service)


def run_routes(api: APIRouter, service: Service) -> None:
    @api.get("/training_runs")
    async def list_runs(limit: int = 20, offset: int = 0):
        runs = sorted(all_runs(service), key=lambda r: r.created, reverse=True)
        page = [training_run(service, r) for r in runs[offset : offset + limit]]
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
        return _json(types.TrainingRunsResponse(training_runs=page, cursor=cursor))

    @api.get("/training_runs/{run_id}")
    async def get_run(run_id: str):
        return _json(training_run(service, run_of(service, run_id)))

    @api.get("/sessions/{session_id}")
    async def get_session(session_id: str):
        runs = [r.model_id for r in all_runs(service) if r.session_id == session_id]
        samplers = [i for i, s in service.sampling.samplers.items() if s.session_id == session_id]
        if session_id not in service.sessions and not runs:
            raise NotFound(f"No session {session_id!r}.")
        return _json(types.GetSessionResponse(training_run_ids=runs, sampler_ids=samplers))

    @api.get("/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0):
        ids = list(dict.fromkeys([*service.sessions, *(r.session_id for r in all_runs(service))]))
        return _json(types.ListSessionsResponse(sessions=ids[offset : offset + limit]))


def checkpoint_routes(api: APIRouter, service: Service) -> None:
    """Listing a run's checkpoints, their weights' shape, deleting one, and its time to live."""
    one = "/training_runs/{run_id}/checkpoints/{kind}/{name}"

    @api.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str):
        run_of(service, run_id)
        return _json(types.CheckpointsListResponse(checkpoints=checkpoints_of(service, run_id)))

    @api.get("/checkpoints")
    async def list_user_checkpoints(limit: int = 100, offset: int = 0):
        found = [c for r in all_runs(service) for c in checkpoints_of(service, r.model_id)]
        found.sort(key=lambda c: c.time, reverse=True)
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(found))
        return _json(types.CheckpointsListResponse(checkpoints=found[offset : offset + limit], cursor=cursor))

    @api.post("/weights_info")
    async def weights_info(request: Request):
        run_id, kind, name = split((await parsed(request, TinkerPath)).tinker_path)
        find(service, run_id, kind, name)
        run = run_of(service, run_id)
        info = types.WeightsInfoResponse(
            base_model=run.base_model,
            is_lora=run.rank > 0,
            lora_rank=run.rank or None,
            train_unembed=run.unembed,
            train_attn=run.attn,
            train_mlp=run.mlp,
        )
        return _json(info)

    @api.delete(one)
    async def delete(run_id: str, kind: str, name: str):
        if kind == "sampler_weights":
            path, _ = find(service, run_id, kind, name)
            service.sampling.snapshots.drop(path)
            return Response(status_code=204)
        path, where = service.checkpoints.place(run_id, check_kind(kind), name)
        if where in service.checkpoints.writing:
            raise TandemError(
                f"{path!r} is being written by a save in flight; delete it once the save is done."
            )
        find(service, run_id, kind, name)
        service.checkpoints.delete(where)
        return Response(status_code=204)

    @api.put(one + "/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request):
        expires_at = expiry((await parsed(request, Ttl)).ttl_seconds)
        path, found = find(service, run_id, kind, name)
        if isinstance(found, Named):
            found.expires_at = expires_at
        else:
            service.checkpoints.amend(found, expires_at=expires_at)
        return Response(status_code=204)


def export_routes(api: APIRouter, service: Service) -> None:
    """Publishing, copying and exporting a checkpoint."""
    one = "/training_runs/{run_id}/checkpoints/{kind}/{name}"

    @api.post(one + "/publish")
    async def publish(run_id: str, kind: str, name: str):
        return publicize(service, run_id, kind, name, True)

    @api.delete(one + "/publish")
    async def unpublish(run_id: str, kind: str, name: str):
        return publicize(service, run_id, kind, name, False)

    @api.post("/copy_weights")
    async def copy_weights():
        raise TandemError(
            "copy_weights is not served: tandem serve has no projects, and every checkpoint is its "
            "owner's. Load it where you need it (create_training_client_from_state(path)) and save "
            "it again under another name."
        )

    @api.post("/save_weights_external")
    async def save_external(request: Request):
        r = await parsed(request, types.SaveWeightsExternalRequest)
        keys = list(r.age_encryption_recipients or [])

        def extra() -> dict:  # checked in the request's turn: a bad key still uses its seq_id
            age_recipients(keys)
            return {"age_recipients": keys} if keys else {}

        # overwrite: the SDK has no flag for it, and its CLI exports every download as "download"
        args = (r.model_id, r.seq_id, r.path, True, r.ttl_seconds, None, "external_weights", extra)
        return wire.future(service.save_state(*args))


def publicize(service: Service, run_id: str, kind: str, name: str, public: bool) -> Response:
    path, found = find(service, run_id, kind, name)
    was = found.public if isinstance(found, Named) else bool(service.checkpoints.meta(found).get("public"))
    if was == public:  # Tinker answers 409, which the SDK retries for 5 minutes before it raises
        raise TandemError(f"{path!r} is {'public' if public else 'private'} already.")
    if isinstance(found, Named):
        found.public = public
    else:
        service.checkpoints.amend(found, public=public)
    return Response(status_code=204)


async def parsed(request: Request, model: type):
    """The JSON body as the `tinker` request type `model` (as app.py's `body`); 400 when malformed."""
    try:
        return model.model_validate(await request.json())
    except (ValidationError, ValueError) as e:
        raise TandemError(f"Malformed {model.__name__}: {e}") from None


def _json(value) -> dict:
    return value.model_dump(mode="json")
