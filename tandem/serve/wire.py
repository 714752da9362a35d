"""The Tinker wire format: forward_backward bodies in (protobuf, provenance spans included), and the
answers out, each built as the `tinker` package's own response type, so that an answer the SDK
would not parse cannot be written.

The SDK (0.38) posts forward_backward as a `tinker_public_pb2.ForwardBackwardRequest` and accepts
SampleResponse / ForwardBackwardOutput results only as protobuf: those are built as the SDK's types
and encoded here, the inverse of the SDK's `tinker/proto/request_conv.py` and `response_conv.py`.
Every other answer is JSON: the SDK's pydantic type as `model_dump(mode="json")` gives it, which is
what the HTTP layer returns. The schema comes with the SDK (`tinker.proto`, `tinker.types`), which
is why `tandem serve` needs `tinker` installed (the `serve` extra).
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.request_error_category import RequestErrorCategory
from tinker.types.try_again_response import TryAgainResponse

from tandem.errors import TandemError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}
_DTYPES = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}


@dataclass(frozen=True)
class Span:
    """One provenance run (`types.SampledProvenanceSpan` / `PromptProvenanceSpan`): the next `length`
    positions of the datum field it tiles are positions [offset, offset + length) of sequence
    `sequence_id`'s sampled tokens (`sampled`) or of its sample request's prompt."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass
class Datum:
    """One Tinker datum as the trainer takes it: the input tokens, the target token at each
    position (the input shifted by one), and the loss's per-position inputs (weights, logprobs,
    advantages, ...), each as long as `targets`. With provenance (`Datum.with_provenance`), the runs
    tiling the input tokens and the targets; None without."""

    tokens: list[int]
    targets: list[int]
    inputs: dict[str, list[float]] = field(default_factory=dict)
    input_spans: list[Span] | None = None
    target_spans: list[Span] | None = None


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int | None
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool
    error: str = ""  # what is wrong with the data: refused once the request has its place in order


def _tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    """A proto Tensor -> a dense numpy array (sparse CSR densified with 0)."""
    if msg.dtype not in _NUMPY:
        raise TandemError(f"loss_fn_inputs[{name!r}] has dtype {msg.dtype}; float32 or int64 are accepted.")
    dtype, shape = _NUMPY[msg.dtype], list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise TandemError(f"loss_fn_inputs[{name!r}] is a malformed sparse tensor.")
        out = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            out[row, col[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
        return out
    array = np.frombuffer(msg.dense, dtype=dtype)
    return array.reshape(shape) if shape else array


def parse_forward_backward(body: bytes) -> FwdBwdRequest:
    """A protobuf forward_backward body -> the request; a body that is no such message is a
    TandemError, a malformed datum the request's `error`."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError, or garbage that is not a message at all
        raise TandemError(
            f"The forward_backward body is not a ForwardBackwardRequest protobuf: {e}"
        ) from None
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    request = FwdBwdRequest(msg.model_id, msg.seq_id or None, msg.loss_fn, config, [], msg.forward_only)
    try:
        request.data = [_datum(i, d) for i, d in enumerate(msg.data)]
    except TandemError as e:
        request.error = str(e)
    except ValueError as e:  # numpy's, for a tensor whose bytes do not fill its shape
        request.error = f"A malformed loss_fn_inputs tensor: {e}"
    return request


def _datum(i: int, d: pb.Datum) -> Datum:
    tokens: list[int] = []
    for chunk in d.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise TandemError(
                f"Datum {i}: only encoded_text chunks are served (tokens), not images or audio."
            )
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    inputs = {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}
    targets = inputs.pop("target_tokens", None)
    if targets is None:
        raise TandemError(f"Datum {i} has no loss_fn_inputs['target_tokens'].")
    if targets.ndim != 1:
        raise TandemError(
            f"Datum {i}: target_tokens must be 1-D (one target per position), got {targets.shape}."
        )
    bad = [k for k, v in inputs.items() if v.shape != targets.shape]
    if bad:
        raise TandemError(
            f"Datum {i}: loss_fn_inputs {bad} must have target_tokens' shape {list(targets.shape)}."
        )
    datum = Datum(tokens, targets.astype(np.int64).tolist(), {k: v.tolist() for k, v in inputs.items()})
    if d.model_input_spans or d.loss_fn_input_spans:
        datum.input_spans = _spans(i, "model_input", d.model_input_spans, len(datum.tokens))
        datum.target_spans = _spans(i, "loss_fn_inputs", d.loss_fn_input_spans, len(datum.targets))
    return datum


def _spans(i: int, name: str, spans: Iterable[pb.ProvenanceSpan], length: int) -> list[Span]:
    """A datum field's provenance runs, checked to tile it as `Datum.with_provenance` does."""
    out = []
    for span in spans:
        arm = span.WhichOneof("span")
        if arm is None:
            raise TandemError(f"Datum {i}: a {name} provenance span names neither prompt nor sampled tokens.")
        run = getattr(span, arm)
        if not run.sequence_id or run.offset < 0 or run.length < 0:
            raise TandemError(
                f"Datum {i}: a {name} provenance span needs a sequence_id, offset >= 0, length >= 0."
            )
        out.append(Span(run.sequence_id, run.offset, run.length, arm == "sampled_tokens"))
    if sum(s.length for s in out) != length:
        raise TandemError(
            f"Datum {i}: its {name} provenance spans cover {sum(s.length for s in out)} positions, not "
            f"its {length}; give both span lists, each tiling its field (Datum.with_provenance)."
        )
    return out


def _batched(arrays: list[np.ndarray], dtype: int, trailing: list[int]) -> pb.BatchedTensor:
    """Per-datum arrays -> one BatchedTensor (concatenated bytes, int64 byte offsets)."""
    flat = [np.ascontiguousarray(a, dtype=_NUMPY[dtype]).ravel() for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    np.cumsum([a.nbytes for a in flat], out=offsets[1:])
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat),
        offsets=offsets.tobytes(),
        dtype=dtype,
        trailing_shape=trailing,
    )


def forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """Per-datum float outputs ({"logprobs": [...], ...}) and the metrics -> the SDK's
    ForwardBackwardOutput, as protobuf bytes."""
    records = [
        {
            name: types.TensorData(data=np.asarray(v, np.float32), dtype="float32", shape=[len(v)])
            for name, v in o.items()
        }
        for o in outputs
    ]
    typed = types.ForwardBackwardOutput("ArrayRecord", records, {k: float(v) for k, v in metrics.items()})
    return encode_forward_backward_output(typed)


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """The SDK's ForwardBackwardOutput -> protobuf bytes: one ArrayRecord of every datum, a field per
    output name (`response_conv.deserialize_forward_backward_output` reads it back)."""
    proto = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type)
    for name, value in out.metrics.items():
        proto.metrics[name] = value
    record = proto.loss_fn_outputs.add()
    record.num_datums = len(out.loss_fn_outputs)
    for name in out.loss_fn_outputs[0] if out.loss_fn_outputs else []:
        tensors = [o[name] for o in out.loss_fn_outputs]
        trailing = list(tensors[0].shape or [])[1:]
        arrays = [t.to_numpy() for t in tensors]
        record.fields[name].CopyFrom(_batched(arrays, _DTYPES[tensors[0].dtype], trailing))
    return proto.SerializeToString()


@dataclass
class Sequence:
    """One sampled continuation."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def sample_response(
    sequences: list[Sequence],
    prompt_logprobs: list[float | None] | None,
    sequence_ids: list[str] | None = None,
) -> bytes:
    """Sampled sequences (their ids as the request's future gave them; the wire does not carry
    them), and the prompt's logprobs when asked (None for the first token, which has no context; NaN
    on the wire) -> the SDK's SampleResponse, as protobuf bytes."""
    ids = sequence_ids or [""] * len(sequences)
    typed = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason=s.stop_reason,  # type: ignore[arg-type]
                sequence_id=sequence_id,
                tokens_np=np.asarray(s.tokens, dtype=np.int32),
                logprobs_np=np.asarray(s.logprobs, dtype=np.float32),
            )
            for s, sequence_id in zip(sequences, ids, strict=True)
        ],
        prompt_logprobs_np=None
        if prompt_logprobs is None
        else np.asarray([np.nan if lp is None else lp for lp in prompt_logprobs], dtype=np.float32),
    )
    return encode_sample_response(typed)


def encode_sample_response(response: types.SampleResponse) -> bytes:
    """The SDK's SampleResponse (tokens, logprobs and stop reasons; the prompt's logprobs) ->
    protobuf bytes (`response_conv.deserialize_sample_response` reads it back)."""
    proto = pb.SampleResponse()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for s in response.sequences:
        proto.sequences.append(
            pb.SampledSequence(
                stop_reason=reasons[s.stop_reason],
                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(s.logprobs or [], dtype=np.float32).tobytes(),
            )
        )
    if response.prompt_logprobs_np is not None:
        proto.prompt_logprobs = np.asarray(response.prompt_logprobs_np, dtype=np.float32).tobytes()
    return proto.SerializeToString()


# -- JSON answers: the SDK's pydantic types as the HTTP layer returns them ---------------------------


def _json(answer: BaseModel) -> dict:
    return answer.model_dump(mode="json")


def future(request_id: str, sample_sequence_ids: list[str] | None = None) -> dict:
    """Every queued request's answer; a sample's names its sequences (SampledSequence.sequence_id)."""
    return _json(types.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=sample_sequence_ids))


def try_again(request_id: str) -> dict:
    return _json(TryAgainResponse(request_id=request_id, queue_state="active"))


def failed(message: str, category: Literal["user", "server"]) -> dict:
    """A request's error as retrieve_future reports it."""
    return _json(types.RequestFailedResponse(error=message, category=RequestErrorCategory(category)))


def model_created(model_id: str) -> dict:
    return _json(types.CreateModelResponse(model_id=model_id))


def optim_stepped(metrics: dict[str, float]) -> dict:
    return _json(types.OptimStepResponse(metrics=metrics))


def weights_saved(path: str, kind: str = "weights") -> dict:
    """save_state's answer; save_weights_external's for its kind, external_weights."""
    if kind == "external_weights":
        return _json(types.SaveWeightsExternalResponseInternal(path=path, type="save_weights_external"))
    return _json(types.SaveWeightsResponse(path=path, type="save_weights"))


def weights_loaded(path: str, model_id: str) -> dict:
    return _json(types.LoadWeightsResponse(path=path, model_id=model_id, type="load_weights"))


def saved_for_sampler(path: str, sampling_session_id: str) -> dict:
    return _json(
        types.SaveWeightsForSamplerResponseInternal(
            path=path, sampling_session_id=sampling_session_id, type="save_weights_for_sampler"
        )
    )


def session_created(session_id: str) -> dict:
    return _json(types.CreateSessionResponse(session_id=session_id))


def heartbeat() -> dict:
    return _json(types.SessionHeartbeatResponse())


def sampling_session_created(sampling_session_id: str) -> dict:
    return _json(types.CreateSamplingSessionResponse(sampling_session_id=sampling_session_id))


def sampler_info(sampler_id: str, base_model: str, model_path: str | None) -> dict:
    return _json(
        types.GetSamplerResponse(sampler_id=sampler_id, base_model=base_model, model_path=model_path)
    )


def model_info(model_id: str, base_model: str, tokenizer_dir: str, rank: int) -> dict:
    """get_info of a training model: LoRA of `rank`, or every weight trains (rank 0); AdamW."""
    data = types.ModelData(arch="tandem", model_name=base_model, tokenizer_id=tokenizer_dir)
    info = types.GetInfoResponse(
        type="get_info",
        model_data=data,
        model_id=model_id,
        is_lora=rank > 0,
        lora_rank=rank or None,
        model_name=base_model,
    )
    return _json(info)


def capabilities(base_model: str, context: int) -> dict:
    """The one model served, trainable and sampleable, with its context length."""
    model = types.SupportedModel(
        model_name=base_model, max_context_length=context, trainable=True, sampleable=True
    )
    return _json(types.GetServerCapabilitiesResponse(supported_models=[model]))


def healthy() -> dict:
    return _json(types.HealthResponse(status="ok"))
