"""The Tinker wire format where it is protobuf: forward_backward bodies in, sample and
forward(_backward) results out. Everything else travels as JSON in the `tinker` package's own
pydantic types (`tandem.serve.app`).

The SDK (0.38) posts forward_backward as a `tinker_public_pb2.ForwardBackwardRequest` and accepts
SampleResponse / ForwardBackwardOutput results only as protobuf; the schema comes with the SDK
(`tinker.proto`), which is why `tandem serve` needs `tinker` installed (the `serve` extra). These
functions are the inverse of the SDK's `tinker/proto/request_conv.py` and `response_conv.py`.
"""

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from tandem.errors import TandemError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}


@dataclass
class Datum:
    """One Tinker datum as the trainer takes it: the input tokens, the target token at each
    position (the input shifted by one), and the loss's per-position inputs (weights, logprobs,
    advantages, ...), each as long as `targets`."""

    tokens: list[int]
    targets: list[int]
    inputs: dict[str, list[float]] = field(default_factory=dict)


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
    return Datum(tokens, targets.astype(np.int64).tolist(), {k: v.tolist() for k, v in inputs.items()})


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    """Per-datum 1-D arrays -> one BatchedTensor (concatenated bytes, int64 byte offsets)."""
    flat = [np.ascontiguousarray(a, dtype=_NUMPY[dtype]) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    np.cumsum([a.nbytes for a in flat], out=offsets[1:])
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(), dtype=dtype)


def forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """Per-datum float outputs ({"logprobs": [...], ...}) and the metrics -> ForwardBackwardOutput bytes."""
    proto = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for name, value in metrics.items():
        proto.metrics[name] = float(value)
    record = proto.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else []:
        record.fields[name].CopyFrom(_batched([np.asarray(o[name]) for o in outputs], pb.DTYPE_FLOAT32))
    return proto.SerializeToString()


@dataclass
class Sequence:
    """One sampled continuation."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """Sampled sequences, and the prompt's logprobs when asked (None for the first token, which has
    no context; NaN on the wire) -> SampleResponse bytes."""
    proto = pb.SampleResponse()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for s in sequences:
        proto.sequences.append(
            pb.SampledSequence(
                stop_reason=reasons[s.stop_reason],
                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        values = [np.nan if lp is None else lp for lp in prompt_logprobs]
        proto.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return proto.SerializeToString()
