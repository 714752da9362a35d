"""A request the SDK sends again runs once: the service answers a retry with the first copy's future.

The `tinker` SDK retries a request when its response is lost (a dropped connection, a proxy's 502):
most under the same X-Idempotency-Key, some (save_weights_for_sampler) as a new request with the
same seq_id. Before, the retry of a training request the service had
received failed with "seq_id ... already used" and ended the client's loop. Here a wrapper around
the app drops the first response of a route on purpose (the service did the work; the client sees
a 502) and the real SDK retries.
"""

import os

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
from test_serve_tinker import KEY, MODEL, WAIT_S, carries, on_uvicorn  # noqa: E402
from tinker import types  # noqa: E402

from tandem.runtime.startup import load_config  # noqa: E402
from tandem.serve.app import build_app  # noqa: E402
from tandem.serve.replies import REPLAYED  # noqa: E402
from tandem.serve.service import open_service  # noqa: E402

pytestmark = pytest.mark.integration  # a service of its own: seconds to start, a minute of SDK calls


class DropFirst:
    """An ASGI wrapper: the app answers every request, but the first answer to a request whose path
    ends with one of `paths` is thrown away and the client gets a 502 instead (which the SDK
    retries). `seen`: path -> the requests that reached the app; `replayed`: answers sent again."""

    def __init__(self, app, paths: tuple[str, ...]):
        self.app, self.paths = app, paths
        self.armed = False  # a test arms it: each path's first answer after that is lost
        self.dropped: set[str] = set()
        self.seen: dict[str, int] = {}
        self.replayed: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.endswith(self.paths):
            return await self.app(scope, receive, send)
        self.seen[path] = self.seen.get(path, 0) + 1
        messages = []

        async def keep(message):
            messages.append(message)

        await self.app(scope, receive, keep)
        start = messages[0]
        if any(k.decode() == REPLAYED for k, _ in start.get("headers", [])):
            self.replayed[path] = self.replayed.get(path, 0) + 1
        if self.armed and path not in self.dropped:  # the work is done; its answer is lost on the way
            self.dropped.add(path)
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b"bad gateway"})
            return
        for message in messages:
            await send(message)


@pytest.fixture(scope="module")
def dropping(tmp_path_factory):
    """A service whose first forward_backward, optim_step and save_weights_for_sampler answers are
    lost -> (its URL, the service, the wrapper)."""
    cfg = load_config(None, [f"run.out_dir={tmp_path_factory.mktemp('serve')}", "run.name=serve"])
    service = open_service(cfg)
    wrapper = DropFirst(build_app(service), ("/forward_backward", "/optim_step", "/save_weights_for_sampler"))
    with on_uvicorn(wrapper) as url:
        yield url, service, wrapper


def test_a_lost_answer_is_retried_by_the_sdk_and_the_request_runs_once(dropping, monkeypatch):
    url, service, wrapper = dropping
    calls = {"forward_backward": 0, "optim_step": 0, "snapshot": 0}
    trainer_cls = type(service.workers.train.workers[service.workers.train.names["train"][0]])
    for name in calls:
        real = getattr(trainer_cls, name)

        def counted(self, *args, real=real, name=name):
            calls[name] += 1
            return real(self, *args)

        monkeypatch.setattr(trainer_cls, name, counted)
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    wrapper.armed = True
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
        data = carries(training.get_tokenizer())
        first = training.forward_backward(data, "cross_entropy").result(timeout=WAIT_S)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=WAIT_S)
        sampler = training.save_weights_and_get_sampling_client().result(timeout=WAIT_S)
        again = training.forward(data, "cross_entropy").result(timeout=WAIT_S)  # after one step, not two
        reply = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2))
        assert len(reply.result(timeout=WAIT_S).sequences) == 1
    finally:
        client.close("success").result()
    # Each reached the service twice. The SDK resends forward_backward and optim_step under the same
    # key (the second got the first's answer); save_weights_for_sampler under a new key and the same
    # seq_id (the first's request id).
    for path in ("forward_backward", "optim_step", "save_weights_for_sampler"):
        assert wrapper.seen[f"/api/v1/{path}"] >= 2, (path, wrapper.seen)
    assert wrapper.replayed == {"/api/v1/forward_backward": 1, "/api/v1/optim_step": 1}, wrapper.replayed
    # Each ran once: forward_backward twice counts the later forward; one step, one push.
    assert calls == {"forward_backward": 2, "optim_step": 1, "snapshot": 2}, calls
    assert again.metrics["loss:sum"] < first.metrics["loss:sum"]


def test_a_seq_id_sent_twice_gets_the_first_copys_request_id(dropping):
    """Without the SDK's key (another client library, a proxy that drops headers): the seq_id alone."""
    url, _, _ = dropping
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
        body = types.OptimStepRequest(
            model_id=training.model_id, seq_id=1000, adam_params=types.AdamParams(learning_rate=0.0)
        ).model_dump(mode="json")
        ids = [
            httpx.post(
                f"{url}/api/v1/optim_step", json=body, headers={"X-API-Key": KEY, "X-Idempotency-Key": key}
            ).json()["request_id"]
            for key in ("one", "two")
        ]
    finally:
        client.close("success").result()
    assert ids[0] == ids[1]
