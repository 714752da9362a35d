"""`tandem serve`: the Tinker API over HTTP (FastAPI on uvicorn), for the official `tinker` SDK.

The routes are the SDK's (tinker/resources/*.py): JSON bodies parsed into the `tinker` package's
own request types, so the server reads exactly what the SDK writes and a field the SDK renames
fails loudly here instead of drifting; forward_backward bodies and sample / forward results are
protobuf (`tandem.serve.wire`). A request that can be refused at once is: 400 for a bad one
(`tinker.BadRequestError` in the client), 404 for a model, sampler or checkpoint that does not
exist (`tinker.NotFoundError`), 401 for a wrong key (`tinker.AuthenticationError`), 500 with the
error for any other exception of a route (a bug; the SDK tries it again for up to 5 minutes). Work
that fails later, and a training request whose check fails unexpectedly, fail their future: the
SDK raises `tinker.RequestFailedError` with the message.

The SDK insists on an API key starting with "tml-" and sends it as X-API-Key. On a loopback
address the service takes any; elsewhere it must be started with one (--api-key or
TANDEM_SERVE_API_KEY) and checks it on every request.
"""

import contextlib
import hmac
import ipaddress
import os
import socket

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from tinker import types

from tandem.config import Config
from tandem.errors import TandemError
from tandem.sample import SamplingParams
from tandem.serve import wire
from tandem.serve.futures import Failure, NotFound
from tandem.serve.hub import tokenizer_id
from tandem.serve.replies import Replies
from tandem.serve.rest import admits, rest_routes
from tandem.serve.service import Service, open_service
from tandem.serve.wire import parse_forward_backward

PROTOBUF = "application/x-protobuf"
RETRIEVE_WAIT_S = 30.0  # a retrieve_future waits this long for its result (the SDK gives up at 45 s)
KEY_ENV = "TANDEM_SERVE_API_KEY"
IDEMPOTENCY_HEADER = "x-idempotency-key"  # the SDK's, the same on each retry of a request


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_key(host: str, api_key: str) -> None:
    """Listening beyond this machine needs a key, in the form the SDK sends."""
    if not api_key and not loopback(host):
        raise TandemError(
            f"tandem serve --host {host} listens beyond this machine: give it a key (--api-key tml-... "
            f"or {KEY_ENV}), which every request must then carry (the SDK's api_key / TINKER_API_KEY)."
        )
    if api_key and not api_key.startswith("tml-"):
        raise TandemError("The API key must start with 'tml-': the tinker SDK refuses any other.")


async def body(request: Request, model: type):
    """The JSON body as the `tinker` request type `model`; a malformed one is a TandemError (400)."""
    try:
        return model.model_validate(await request.json())
    except (ValidationError, ValueError) as e:
        raise TandemError(f"Malformed {model.__name__}: {e}") from None


def sampling_params(cfg: Config, p: types.SamplingParams, prompt_len: int, context: int) -> SamplingParams:
    """The SDK's sampling parameters as the engine's. stop: a string or strings end a response on
    their text, token ids on those tokens; [] disables every stop, EOS included."""
    max_tokens = p.max_tokens if p.max_tokens is not None else cfg.rollout.max_new_tokens
    if max_tokens < 1 or prompt_len + max_tokens > context:
        raise TandemError(
            f"max_tokens={max_tokens} with a prompt of {prompt_len} tokens: it must be >= 1 and fit the "
            f"model's context of {context} tokens."
        )
    if p.temperature < 0 or not 0 < p.top_p <= 1:
        raise TandemError(f"temperature={p.temperature} must be >= 0 and top_p={p.top_p} in (0, 1].")
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    words = [s for s in stop if isinstance(s, str)]
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(p.top_k, 0),
        max_new_tokens=max_tokens,
        stop=words,
        stop_token_ids=[s for s in stop if not isinstance(s, str)],
        ignore_eos=p.stop is not None and not stop,
    )


def queue_sample(service: Service, r: types.SampleRequest) -> dict:
    """A sample request checked and queued -> its future, with its sequences' ids."""
    if r.topk_prompt_logprobs or r.topk_sample_logprobs or r.target_prompt_logprobs or r.prompt_alt_tokens_k:
        raise TandemError("Top-k logprobs, target prompt logprobs and alternative tokens are not served.")
    sampler_id = r.sampling_session_id or service.create_sampler(r.model_path, r.base_model)
    try:
        prompt = r.prompt.to_ints()
    except ValueError as e:
        raise TandemError(f"The prompt must be tokens (encoded_text chunks): {e}") from None
    vocab, context = service.limits()
    if not prompt or not all(0 <= t < vocab for t in prompt):
        raise TandemError(f"The prompt must be at least one token, each in the vocabulary [0, {vocab}).")
    if r.num_samples < 1:
        raise TandemError(f"num_samples={r.num_samples} must be >= 1.")
    params = sampling_params(service.cfg, r.sampling_params, len(prompt), context)
    rid, ids = service.new_sample(
        sampler_id,
        prompt=prompt,
        n=r.num_samples,
        max_tokens=params.max_new_tokens,
        seed=r.sampling_params.seed,
        params=params,
        prompt_logprobs=bool(r.prompt_logprobs),
        record=bool(r.record_stability_info),
    )
    return wire.future(rid, ids)


def build_app(service: Service, api_key: str = "") -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()  # the sampling loop, on uvicorn's event loop
        yield
        await service.close()

    app = FastAPI(title="tandem serve: the Tinker API", lifespan=lifespan)

    replies = Replies()

    @app.middleware("http")
    async def once(request: Request, call_next):  # inside `authenticate`: a replay checks the key too
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if not replies.applies(request.method, request.url.path, key):
            return await call_next(request)
        return await replies.once(key, lambda: call_next(request))

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        given = request.headers.get("x-api-key", "")
        keyed = hmac.compare_digest(given.encode(), api_key.encode()) or admits(request, api_key)
        if api_key and not keyed:
            return JSONResponse({"detail": "Wrong or missing API key (X-API-Key)."}, status_code=401)
        return await call_next(request)

    @app.exception_handler(TandemError)
    async def refused(request: Request, e: TandemError):
        status = 404 if isinstance(e, NotFound) else 400
        return JSONResponse({"detail": " ".join(str(e).split())}, status_code=status)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception):  # a bug: say what, rather than a bare 500
        detail = f"{request.url.path} failed in the service: {type(e).__name__}: {e}"
        return JSONResponse({"detail": detail}, status_code=500, headers={"x-should-retry": "false"})

    api = APIRouter(prefix="/api/v1")  # the SDK's routes, all under one prefix
    for routes in (session_routes, training_routes, state_routes, sampling_routes, rest_routes):
        routes(api, service)
    app.include_router(api)

    @app.get("/tandem/timings")
    async def timings():
        """Seconds spent in each worker call so far (not the Tinker API: bench/serve.py reads it)."""
        return service.timings

    return app


def session_routes(api: APIRouter, service: Service) -> None:
    """Health, the client's config, sessions and what the service serves."""

    @api.get("/healthz")
    async def healthz():
        return wire.healthy()

    @api.post("/client/config")
    async def client_config():
        # pyqwest is an optional transport the SDK would import; plain httpx serves a local service.
        return types.ClientConfigResponse(use_pyqwest_transport=False).model_dump()

    @api.post("/client/dynamic_config")
    async def dynamic_config():
        return types.ClientDynamicConfigResponse().model_dump()

    @api.post("/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # the SDK's own diagnostics: nowhere to send them

    @api.post("/create_session")
    async def create_session(request: Request):
        await body(request, types.CreateSessionRequest)
        return wire.session_created(service.create_session())

    @api.post("/session_heartbeat")
    async def heartbeat(request: Request):
        service.heartbeat((await body(request, types.SessionHeartbeatRequest)).session_id)
        return wire.heartbeat()

    @api.post("/sessions/{session_id}/finish")
    async def finish(session_id: str):
        service.finish(session_id)
        return {}

    @api.get("/get_server_capabilities")
    async def capabilities():
        return wire.capabilities(service.base_model, service.limits()[1])


def training_routes(api: APIRouter, service: Service) -> None:
    """A training model and its requests: each returns a future."""

    @api.post("/create_model")
    async def create_model(request: Request):
        r = await body(request, types.CreateModelRequest)
        lora = r.lora_config or types.LoraConfig(rank=0)
        seed = lora.seed if lora.seed is not None else service.cfg.run.seed
        rid = service.create_model(
            r.session_id,
            r.model_seq_id,
            r.base_model,
            lora.rank,
            seed,
            lora.train_attn,
            lora.train_mlp,
            lora.train_unembed,
            r.user_metadata,
        )
        return wire.future(rid)

    @api.post("/get_info")
    async def get_info(request: Request):
        model = service.model_of((await body(request, types.GetInfoRequest)).model_id)
        tokenizer = tokenizer_id(request, model.tokenizer_dir, service.base_model)  # a path only here
        return wire.model_info(model.model_id, model.base_model, tokenizer, model.shape["rank"])

    @api.post("/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-encoding"):
            raise TandemError(
                "Compressed forward_backward bodies are not served (the client config says so)."
            )
        return wire.future(service.forward_backward(parse_forward_backward(await request.body())))

    @api.post("/optim_step")
    async def optim_step(request: Request):
        r = await body(request, types.OptimStepRequest)
        adam = isinstance(r.optim_params, types.AdamParams)
        params = {"type": "adam", **r.optim_params.model_dump()} if adam else r.optim_params.model_dump()
        return wire.future(service.optim_step(r.model_id, r.seq_id, params))


def state_routes(api: APIRouter, service: Service) -> None:
    """A training model's state saved and loaded, and its weights saved for sampling."""

    @api.post("/save_weights")
    async def save_weights(request: Request):
        r = await body(request, types.SaveWeightsRequest)
        name = r.path or f"step-{r.seq_id}"
        saved = service.save_state(r.model_id, r.seq_id, name, r.overwrite, r.ttl_seconds, r.user_metadata)
        return wire.future(saved)

    @api.post("/load_weights")
    async def load_weights(request: Request):
        r = await body(request, types.LoadWeightsRequest)
        if r.session_id is not None:  # create_training_client_from_state: the load makes the model
            seq = r.model_seq_id or 0
            made = service.create_from_state(r.session_id, seq, r.path, r.optimizer, r.user_metadata)
            return wire.future(made)
        return wire.future(service.load_state(r.model_id or "", r.seq_id, r.path, r.optimizer))

    @api.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        r = await body(request, types.SaveWeightsForSamplerRequest)
        saved = service.save_for_sampler(r.model_id, r.seq_id, r.path, r.ttl_seconds, r.user_metadata)
        return wire.future(saved)


def sampling_routes(api: APIRouter, service: Service) -> None:
    """Samplers, sample requests, and the futures the SDK polls."""

    @api.post("/create_sampling_session")
    async def create_sampling_session(request: Request):
        r = await body(request, types.CreateSamplingSessionRequest)
        sampler_id = service.create_sampler(r.model_path, r.base_model, r.session_id)
        return wire.sampling_session_created(sampler_id)

    @api.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        s = service.sampler(sampler_id)
        return wire.sampler_info(sampler_id, s.base_model, s.model_path)

    @api.post("/asample")
    async def asample(request: Request):
        return queue_sample(service, await body(request, types.SampleRequest))

    @api.post("/retrieve_future")
    async def retrieve_future(request: Request):
        r = await body(request, types.FutureRetrieveRequest)
        result = await service.result(r.request_id, RETRIEVE_WAIT_S)
        if result is None:  # still running: the SDK asks again
            return wire.try_again(r.request_id)
        if isinstance(result, Failure):
            return wire.failed(result.message, result.category)
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return result

    @api.post("/cancel_future")
    async def cancel_future():
        return {}  # a sample runs to its end; its result is dropped with the others in time


def bind(host: str, port: int) -> socket.socket:
    """host:port taken for the service (as uvicorn takes it), or a TandemError when it cannot be:
    checked before the workers are built, and held so nothing takes it meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TandemError(
            f"tandem serve cannot listen on {host}:{port}: {e.strerror or e}. Stop what uses the port "
            "(another tandem serve?) or give another --port."
        ) from None
    return sock


def serve(cfg: Config, host: str, port: int, api_key: str = "", full_weights: bool = False) -> None:
    """Take host:port, build the workers, then answer there until stopped (Ctrl-C)."""
    api_key = api_key or os.environ.get(KEY_ENV, "")
    check_key(host, api_key)
    sock = bind(host, port)
    service = open_service(cfg, full_weights)
    key_note = "the key given" if api_key else "any key starting with tml- (loopback only)"
    print(
        f"tandem serve: {service.base_model} on http://{host}:{port} (Tinker API); "
        f"clients: tinker.ServiceClient(base_url='http://{host}:{port}', api_key=...) with {key_note}",
        flush=True,
    )
    config = uvicorn.Config(build_app(service, api_key), host=host, port=port, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
