"""`tandem serve`: a training service that speaks the Tinker API, so a loop written against the
official `tinker` SDK runs on tandem's train worker and rollout engine (docs/serve.md).

app.py the HTTP routes (FastAPI) and `serve`; service.py sessions, the model, samplers, futures and
their queues; checkpoints.py save_state's checkpoints on disk (names, whole-or-absent writes, checks
before a load); workers.py the train and rollout actors with the API's calls; losses.py the SDK's
losses; wire.py the protobuf bodies. Needs the `serve` extra (tinker, fastapi, uvicorn).
"""
