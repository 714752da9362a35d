"""The Tinker losses of `tandem serve` (tandem/serve/losses.py) against their formulas written out
here independently, element by element in plain Python (value and gradient); their config checks and
input checks refusing by name; provenance checked against what was recorded at sampling; and the
wire (tandem/serve/wire.py): spans parsed from the SDK's own request encoding, and the answers built
as the SDK's types, the same bytes and JSON as the hand-built ones they replace.

The SDK-driven tier (each new loss through the real `tinker` SDK) is in tests/test_serve_tinker.py."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import response_conv  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from tandem.algo import POLICY_LOSSES  # noqa: E402
from tandem.errors import TandemError  # noqa: E402
from tandem.serve import wire  # noqa: E402
from tandem.serve.losses import (  # noqa: E402
    LOSSES,
    SAMPLED,
    Recorded,
    check_provenance,
    check_request,
)
from tandem.serve.wire import Datum, Span  # noqa: E402

# Two datums of 4 targets, the second one padded after 3 (logp 0 there, as the trainer's score
# gives, every input 0, as pad_rows gives). Ratios on both sides of every bound, advantages of both
# signs, a prompt position (A = 0, outside the ratio's mask) in front of each.
LOGP = [[-0.7, -1.2, -0.3, -2.0], [-0.9, -0.1, -1.5, 0.0]]
Q = [[-0.5, -1.9, -0.31, -0.6], [-1.0, -0.1, -0.2, 0.0]]
ADV = [[0.0, 1.5, -2.0, 0.7], [0.0, -1.0, 2.5, 0.0]]
IN_RATIO = [[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]
WEIGHTS = [[0.0, 1.0, 0.5, 2.0], [1.0, 1.0, 1.0, 0.0]]
ROWS = [4, 3]  # each datum's length


def run(name: str, config: dict, **inputs) -> tuple[list[float], list[float]]:
    """The loss `name` on LOGP -> its value and d loss / d logp at each position (datum by datum),
    0 past each end."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    loss = LOSSES.get(name)(logp, tensors, config)
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in ROWS], dtype=torch.float64)
    (loss * mask).sum().backward()
    return (loss * mask).flatten().tolist(), logp.grad.flatten().tolist()


def each(fn) -> tuple[list[float], list[float]]:
    """fn(b, t) -> (value, gradient) at every real position, in run's order; 0 past each end."""
    at = [fn(b, t) if t < ROWS[b] else (0.0, 0.0) for b in range(2) for t in range(4)]
    return [v for v, _ in at], [g for _, g in at]


def clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def ppo_reference(b: int, t: int, ratio: float, low: float, high: float) -> tuple[float, float]:
    """-min(ratio·A, clip(ratio)·A) and its derivative in logp when d ratio / d logp = ratio: the
    unclipped branch passes the gradient, the clipped one (a constant) does not."""
    a = ADV[b][t]
    unclipped, clipped = ratio * a, clip(ratio, low, high) * a
    if unclipped <= clipped:
        return -unclipped, -a * ratio
    return -clipped, 0.0


REFERENCES = {
    ("cross_entropy", "weights"): lambda b, t: (-WEIGHTS[b][t] * LOGP[b][t], -WEIGHTS[b][t]),
    ("cross_entropy", ""): lambda b, t: (-LOGP[b][t], -1.0),
    ("importance_sampling", ""): lambda b, t: (
        -math.exp(LOGP[b][t] - Q[b][t]) * ADV[b][t],
        -math.exp(LOGP[b][t] - Q[b][t]) * ADV[b][t],
    ),
    ("ppo", ""): lambda b, t: ppo_reference(b, t, math.exp(LOGP[b][t] - Q[b][t]), 0.8, 1.2),
    ("ppo", "tight"): lambda b, t: ppo_reference(b, t, math.exp(LOGP[b][t] - Q[b][t]), 0.95, 1.01),
    ("cispo", ""): lambda b, t: (
        -clip(math.exp(LOGP[b][t] - Q[b][t]), 0.0, 4.0) * ADV[b][t] * LOGP[b][t],
        -clip(math.exp(LOGP[b][t] - Q[b][t]), 0.0, 4.0) * ADV[b][t],
    ),
    ("cispo", "tight"): lambda b, t: (
        -clip(math.exp(LOGP[b][t] - Q[b][t]), 0.95, 1.01) * ADV[b][t] * LOGP[b][t],
        -clip(math.exp(LOGP[b][t] - Q[b][t]), 0.95, 1.01) * ADV[b][t],
    ),
    ("dro", ""): lambda b, t: (
        -(LOGP[b][t] * ADV[b][t] - 0.5 * 0.3 * (LOGP[b][t] - Q[b][t]) ** 2),
        -(ADV[b][t] - 0.3 * (LOGP[b][t] - Q[b][t])),
    ),
}
CONFIGS = {"": {}, "weights": {}, "tight": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.01}}


def inputs_of(name: str, variant: str) -> dict:
    if name == "cross_entropy":
        return {"weights": WEIGHTS} if variant == "weights" else {}
    return {"logprobs": Q, "advantages": ADV}


@pytest.mark.parametrize("name, variant", sorted(REFERENCES))
def test_each_loss_is_its_formula_in_value_and_gradient(name, variant):
    config = {"beta": 0.3} if name == "dro" else CONFIGS[variant]
    value, grad = run(name, config, **inputs_of(name, variant))
    want_value, want_grad = each(REFERENCES[(name, variant)])
    assert value == pytest.approx(want_value, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    # the data tell a sign flip from the loss: a wrong sign would fail the comparison above
    assert [-v for v in value] != pytest.approx(want_value)


def gspo_reference(low: float, high: float):
    """GSPO-token from its definition: log s = mean of (logp - q) over M, every token's ratio takes
    s's value and its own logp's gradient (d s_t / d logp_t = s), clipped as ppo's."""

    def at(b: int, t: int) -> tuple[float, float]:
        kept = [t2 for t2 in range(ROWS[b]) if IN_RATIO[b][t2] != 0]
        s = math.exp(sum(LOGP[b][t2] - Q[b][t2] for t2 in kept) / len(kept))
        return ppo_reference(b, t, s, low, high)

    return at


def test_gspo_is_the_sequence_ratio_clipped_with_each_tokens_gradient():
    inputs = {"logprobs": Q, "advantages": ADV, "sequence_ratio_mask": IN_RATIO}
    for config, (low, high) in [
        ({}, (1 - 3e-4, 1 + 4e-4)),  # the defaults: the GSPO paper's range, as tandem.algo's gspo
        ({"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, (0.5, 2.0)),  # nothing clipped
    ]:
        value, grad = run("gspo", config, **inputs)
        want_value, want_grad = each(gspo_reference(low, high))
        assert value == pytest.approx(want_value, abs=1e-12)
        assert grad == pytest.approx(want_grad, abs=1e-12)
    # the ratio is the sequence's: with every token in M it is not the per-token ratio ppo takes
    all_in = {**inputs, "sequence_ratio_mask": [[1.0] * 4, [1.0, 1.0, 1.0, 0.0]]}
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    assert run("gspo", wide, **all_in)[0] != pytest.approx(run("ppo", wide, **all_in)[0])


def test_gspo_equals_tandems_gspo_where_the_advantages_vanish_outside_the_ratios_tokens():
    """Tinker counts every position, tandem.algo's gspo only its mask's: the same when A = 0 off M."""
    adv = [[a * m for a, m in zip(ra, rm, strict=True)] for ra, rm in zip(ADV, IN_RATIO, strict=True)]
    logp = torch.tensor(LOGP, dtype=torch.float64)
    tinker_loss = LOSSES.get("gspo")(
        logp,
        {
            k: torch.tensor(v, dtype=torch.float64)
            for k, v in [("logprobs", Q), ("advantages", adv), ("sequence_ratio_mask", IN_RATIO)]
        },
        {},
    )
    tandem_loss, _ = POLICY_LOSSES.get("gspo")(
        logp,
        torch.tensor(Q, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(IN_RATIO, dtype=torch.float64),
    )
    assert tinker_loss.flatten().tolist() == pytest.approx(tandem_loss.flatten().tolist(), abs=1e-12)


def stable_reference(kl_coeff: float, sampled: list[list[float]]):
    """At a sampled target: -min(r, 1)·A·logp + k·(r - 1 - log r), gradient -min(r, 1)·A + k·(r - 1);
    0 elsewhere."""

    def at(b: int, t: int) -> tuple[float, float]:
        if not sampled[b][t]:
            return 0.0, 0.0
        r = math.exp(LOGP[b][t] - Q[b][t])
        a, w = ADV[b][t], min(r, 1.0)
        return -w * a * LOGP[b][t] + kl_coeff * (r - 1 - math.log(r)), -w * a + kl_coeff * (r - 1)

    return at


@pytest.mark.parametrize("kl_coeff", [0.0, 0.25])
def test_stable_reinforce_is_truncated_reinforce_plus_the_samplers_kl_at_sampled_targets(kl_coeff):
    sampled = [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    inputs = {"logprobs": Q, "advantages": ADV, SAMPLED: sampled}
    value, grad = run("stable_reinforce", {"kl_coeff": kl_coeff}, **inputs)
    want_value, want_grad = each(stable_reference(kl_coeff, sampled))
    assert value == pytest.approx(want_value, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)


@pytest.mark.parametrize("kl_coeff", [0.0, 0.25, 3.0])
def test_stable_reinforce_is_exactly_reinforce_when_sampler_and_trainer_agree_bit_for_bit(kl_coeff):
    """run.deterministic=true: q == logp bit for bit, so r = 1, the weight 1 and the KL term 0 with
    a zero gradient: the loss is -A·logp and its gradient -A, exactly, importance_sampling's at r = 1."""
    logp = torch.tensor(LOGP, dtype=torch.float32, requires_grad=True)
    adv = torch.tensor(ADV)
    inputs = {"logprobs": logp.detach().clone(), "advantages": adv, SAMPLED: torch.ones(2, 4)}
    loss = LOSSES.get("stable_reinforce")(logp, inputs, {"kl_coeff": kl_coeff})
    loss.sum().backward()
    assert torch.equal(loss, -adv * logp.detach())
    assert torch.equal(logp.grad, -adv)
    logp_is = logp.detach().clone().requires_grad_()
    LOSSES.get("importance_sampling")(logp_is, inputs, {}).sum().backward()
    assert torch.equal(logp.grad, logp_is.grad)


@pytest.mark.parametrize(
    "loss, config, match",
    [
        (
            "ppo",
            {"clip_low_threshold": 0.0},
            r"loss_fn_config\['clip_low_threshold'\]=0.0 of loss 'ppo'.*\(0, 1\]",
        ),
        ("ppo", {"clip_low_threshold": 1.2}, r"'clip_low_threshold'\]=1.2"),
        ("ppo", {"clip_high_threshold": 0.9}, r"'clip_high_threshold'\]=0.9 .* >= 1"),
        ("ppo", {"clip_high_threshold": float("nan")}, r"'clip_high_threshold'\]=nan"),
        ("ppo", {"clip_high_threshold": "wide"}, r"'clip_high_threshold'\]='wide' .* must be a number"),
        ("ppo", {"beta": 0.1}, r"'ppo' takes no loss_fn_config \['beta'\]; its keys: clip_low_threshold"),
        ("cispo", {"clip_low_threshold": -0.1}, r"'clip_low_threshold'\]=-0.1 of loss 'cispo' .* \[0, 1\]"),
        ("gspo", {"clip_high_threshold": 0.5}, r"'clip_high_threshold'\]=0.5 of loss 'gspo'"),
        ("dro", {}, r"Loss 'dro' needs loss_fn_config\['beta'\], a number >= 0"),
        ("dro", {"beta": -1.0}, r"'beta'\]=-1.0 of loss 'dro'"),
        ("stable_reinforce", {"kl_coeff": -0.5}, r"'kl_coeff'\]=-0.5 of loss 'stable_reinforce'"),
        (
            "cross_entropy",
            {"clip_low_threshold": 0.9},
            r"'cross_entropy' takes no loss_fn_config.*keys: none",
        ),
    ],
)
def test_a_bad_loss_fn_config_is_refused_naming_the_key(loss, config, match):
    names = {"target_tokens", *LOSSES.traits(loss).needs} - {"target_tokens"}
    with pytest.raises(TandemError, match=match):
        check_request(loss, config, [names])


def test_the_defaults_are_tinkers_and_good_configs_pass():
    assert LOSSES.traits("ppo").config({}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert LOSSES.traits("cispo").config({}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert LOSSES.traits("gspo").config({}) == pytest.approx(
        {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    )
    assert LOSSES.traits("stable_reinforce").config({}) == {"kl_coeff": 0.0}
    assert LOSSES.traits("dro").config({"beta": 0.05}) == {"beta": 0.05}


@pytest.mark.parametrize(
    "loss, names, match",
    [
        (
            "importance_sampling",
            [{"logprobs"}],
            r"Datum 0: loss 'importance_sampling' needs .*\['advantages'\]",
        ),
        ("gspo", [{"logprobs", "advantages"}], r"'gspo' needs loss_fn_inputs \['sequence_ratio_mask'\]"),
        ("stable_reinforce", [{"advantages"}], r"needs loss_fn_inputs \['logprobs'\]"),
        ("cross_entropy", [{"weights", "advantages"}], r"unknown loss_fn_inputs \['advantages'\]"),
        ("ppo", [{"logprobs", "advantages", SAMPLED}], r"unknown loss_fn_inputs \['sampled_mask'\]"),
        (
            "cross_entropy",
            [{"weights"}, set()],
            r"Datum 1 carries loss_fn_inputs \[\], datum 0 \['weights'\]",
        ),
        ("custom", [set()], r"Unknown Tinker loss 'custom'. Valid names: cispo, cross_entropy, dro, gspo"),
    ],
)
def test_missing_unknown_and_uneven_inputs_are_refused_by_name(loss, names, match):
    with pytest.raises(TandemError, match=match):
        check_request(loss, {"beta": 1.0} if loss == "dro" else {}, names)


def test_check_request_reads_what_each_entry_declares():
    for name in LOSSES.names():
        loss = LOSSES.traits(name)
        config = {"beta": 0.1} if name == "dro" else {}
        check_request(name, config, [set(loss.needs) | set(loss.reads), set(loss.needs) | set(loss.reads)])
    assert [n for n in LOSSES.names() if LOSSES.traits(n).provenance] == ["stable_reinforce"]
    assert set(LOSSES.names()) == set(types.LossFnType.__args__) - {"custom"}


# -- provenance -----------------------------------------------------------------------------------

RECORDED = {
    "req-1:0": Recorded(prompt=[5, 6, 7], tokens=[8, 9, 2], logprobs=[-0.25, -1.5, -0.125]),
    "req-1:1": Recorded(prompt=[5, 6, 7], tokens=[8, 3], logprobs=[-0.5, -2.0]),
}


def datum(input_spans, target_spans, logprobs=None) -> Datum:
    """The prompt [5, 6, 7] and req-1:0's sampled [8, 9, 2]: input 5 6 7 8 9, targets 6 7 8 9 2."""
    targets = [6, 7, 8, 9, 2]
    inputs = {"logprobs": logprobs or [0.0] * 5, "advantages": [0.0, 0.0, 1.0, 1.0, 1.0]}
    return Datum([5, 6, 7, 8, 9], targets, inputs, input_spans, target_spans)


def prompt(seq: str, offset: int, length: int) -> Span:
    return Span(seq, offset, length, sampled=False)


def sampled(seq: str, offset: int, length: int) -> Span:
    return Span(seq, offset, length, sampled=True)


GOOD_INPUT = [prompt("req-1:0", 0, 3), sampled("req-1:0", 0, 2)]
GOOD_TARGET = [prompt("req-1:0", 1, 2), sampled("req-1:0", 0, 3)]


def test_recorded_sequences_give_stable_reinforce_the_samplers_logprobs_and_its_sampled_targets():
    (d,) = check_provenance([datum(GOOD_INPUT, GOOD_TARGET, [9.0] * 5)], RECORDED, "stable_reinforce")
    assert d.inputs["logprobs"] == [9.0, 9.0, -0.25, -1.5, -0.125]  # the records win where sampled
    assert d.inputs[SAMPLED] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert d.inputs["advantages"] == [0.0, 0.0, 1.0, 1.0, 1.0]
    # another loss's spans are checked, its inputs left as sent; no spans: nothing to check
    (other,) = check_provenance([datum(GOOD_INPUT, GOOD_TARGET)], RECORDED, "ppo")
    assert other.inputs == datum(GOOD_INPUT, GOOD_TARGET).inputs
    plain = datum(None, None)
    assert check_provenance([plain], {}, "importance_sampling") == [plain]


@pytest.mark.parametrize(
    "input_spans, target_spans, loss, match",
    [
        (None, None, "stable_reinforce", r"Datum 0: loss 'stable_reinforce' trains on recorded samples"),
        (
            GOOD_INPUT,
            [prompt("req-1:0", 1, 2), sampled("req-9:0", 0, 3)],
            "stable_reinforce",
            r"loss_fn_inputs provenance span names sequence 'req-9:0', which this session never recorded",
        ),
        (
            [prompt("nobody", 0, 3), sampled("req-1:0", 0, 2)],
            GOOD_TARGET,
            "ppo",
            r"model_input provenance span names sequence 'nobody'",
        ),
        (
            GOOD_INPUT,
            [prompt("req-1:0", 1, 2), sampled("req-1:1", 0, 3)],
            "stable_reinforce",
            r"positions \[0, 3\) of the sampled tokens of 'req-1:1', which has 2",
        ),
        (
            GOOD_INPUT,
            [prompt("req-1:0", 0, 2), sampled("req-1:0", 0, 3)],
            "stable_reinforce",
            r"loss_fn_inputs positions \[0, 2\) are not the prompt \[0, 2\) recorded for 'req-1:0'",
        ),
        (
            [prompt("req-1:0", 0, 3), sampled("req-1:1", 0, 2)],
            GOOD_TARGET,
            "stable_reinforce",
            r"model_input positions \[3, 5\) are not the sampled tokens \[0, 2\) recorded for 'req-1:1'",
        ),
    ],
)
def test_a_span_that_names_what_was_not_recorded_is_refused(input_spans, target_spans, loss, match):
    with pytest.raises(TandemError, match=match):
        check_provenance([datum(input_spans, target_spans)], RECORDED, loss)


def fwd_bwd_body(data: list[types.Datum], loss: str = "stable_reinforce") -> bytes:
    """A forward_backward body as the SDK encodes it."""
    request = types.ForwardBackwardRequest(types.ForwardBackwardInput(data, loss), "m", 7)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_the_sdks_provenance_spans_arrive_as_spans():
    sdk = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 2], "logprobs": [0.0] * 5, "advantages": [1.0] * 5},
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="req-1:0", length=3),
            types.SampledProvenanceSpan(sequence_id="req-1:0", length=2),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="req-1:0", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="req-1:0", length=3),
        ],
    )
    request = wire.parse_forward_backward(fwd_bwd_body([sdk]))
    assert not request.error
    (d,) = request.data
    assert d.input_spans == GOOD_INPUT and d.target_spans == GOOD_TARGET
    check_provenance(request.data, RECORDED, "stable_reinforce")
    plain = wire.parse_forward_backward(fwd_bwd_body([types.Datum(sdk.model_input, sdk.loss_fn_inputs)]))
    assert plain.data[0].input_spans is None and plain.data[0].target_spans is None


def test_spans_that_do_not_tile_their_field_are_the_requests_error():
    msg = pb.ForwardBackwardRequest.FromString(
        fwd_bwd_body(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={"target_tokens": [6, 7], "logprobs": [0.0] * 2, "advantages": [1.0] * 2},
                )
            ]
        )
    )
    msg.data[0].model_input_spans.add().prompt_tokens.CopyFrom(
        pb.PromptProvenanceSpan(sequence_id="a", length=2)
    )
    request = wire.parse_forward_backward(msg.SerializeToString())
    assert "Datum 0: its loss_fn_inputs provenance spans cover 0 positions, not its 2" in request.error
    msg.data[0].loss_fn_input_spans.add().sampled_tokens.CopyFrom(
        pb.SampledProvenanceSpan(sequence_id="a", length=3)
    )
    request = wire.parse_forward_backward(msg.SerializeToString())
    assert "loss_fn_inputs provenance spans cover 3 positions, not its 2" in request.error


# -- answers as the SDK's types ------------------------------------------------------------------


def old_forward_backward_output(outputs, metrics) -> bytes:
    """The hand-built encoding wire.py had before (the bytes the SDK was served)."""
    proto = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for name, value in metrics.items():
        proto.metrics[name] = float(value)
    record = proto.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else []:
        flat = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.zeros(len(flat) + 1, dtype=np.int64)
        np.cumsum([a.nbytes for a in flat], out=offsets[1:])
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
            )
        )
    return proto.SerializeToString()


def old_sample_response(sequences, prompt_logprobs) -> bytes:
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


@pytest.mark.parametrize(
    "outputs, metrics",
    [([{"logprobs": [-1.0, -2.5]}, {"logprobs": [-0.5]}], {"loss:sum": 3.25}), ([], {})],
)
def test_forward_backward_output_is_the_sdks_type_and_the_same_bytes(outputs, metrics):
    body = wire.forward_backward_output(outputs, metrics)
    assert body == old_forward_backward_output(outputs, metrics)
    parsed = response_conv.deserialize_forward_backward_output(body)
    assert parsed.metrics == metrics and parsed.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].tolist() for o in parsed.loss_fn_outputs] == [o["logprobs"] for o in outputs]


@pytest.mark.parametrize("prompt_logprobs", [None, [None, -1.5, -0.25]])
def test_sample_response_is_the_sdks_type_and_the_same_bytes(prompt_logprobs):
    sequences = [wire.Sequence([1, 2], [-0.5, -0.25], "stop"), wire.Sequence([3], [-2.0], "length")]
    body = wire.sample_response(sequences, prompt_logprobs, ["req-3:0", "req-3:1"])
    assert body == old_sample_response(sequences, prompt_logprobs)
    parsed = response_conv.deserialize_sample_response(body)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in parsed.sequences] == [
        ([1, 2], [-0.5, -0.25], "stop"),
        ([3], [-2.0], "length"),
    ]
    assert parsed.prompt_logprobs == prompt_logprobs


JSON_ANSWERS = [  # the builder's answer, the dict the service and the app built by hand, the SDK type
    (
        wire.model_created("s:train:0"),
        {"model_id": "s:train:0", "type": "create_model"},
        types.CreateModelResponse,
    ),
    (
        wire.weights_saved("tinker://m/weights/a"),
        {"path": "tinker://m/weights/a", "type": "save_weights"},
        types.SaveWeightsResponse,
    ),
    (
        wire.weights_loaded("p", "m"),
        {"path": "p", "model_id": "m", "type": "load_weights"},
        types.LoadWeightsResponse,
    ),
    (
        wire.saved_for_sampler("p", "sampler-1"),
        {"path": "p", "sampling_session_id": "sampler-1", "type": "save_weights_for_sampler"},
        types.SaveWeightsForSamplerResponseInternal,
    ),
    (
        wire.optim_stepped({"grad_norm:mean": 1.5}),
        {"metrics": {"grad_norm:mean": 1.5}},
        types.OptimStepResponse,
    ),
    (wire.failed("bad", "user"), {"error": "bad", "category": "user"}, types.RequestFailedResponse),
    (wire.heartbeat(), {"type": "session_heartbeat"}, types.SessionHeartbeatResponse),
    (
        wire.sampling_session_created("sampler-2"),
        {"type": "create_sampling_session", "sampling_session_id": "sampler-2"},
        types.CreateSamplingSessionResponse,
    ),
    (
        wire.sampler_info("sampler-2", "base", None),
        {"sampler_id": "sampler-2", "base_model": "base", "model_path": None},
        types.GetSamplerResponse,
    ),
    (
        wire.capabilities("base", 512),
        {
            "supported_models": [
                {"model_name": "base", "max_context_length": 512, "trainable": True, "sampleable": True}
            ]
        },
        types.GetServerCapabilitiesResponse,
    ),
    (wire.healthy(), {"status": "ok"}, types.HealthResponse),
    (wire.try_again("req-1"), {"type": "try_again", "request_id": "req-1", "queue_state": "active"}, None),
    # the SDK's types add what the hand-built ones left to its defaults: said here, and harmless
    (
        wire.session_created("s"),
        {
            "type": "create_session",
            "session_id": "s",
            "info_message": None,
            "warning_message": None,
            "error_message": None,
        },
        types.CreateSessionResponse,
    ),
    (
        wire.future("req-2", ["req-2:0"]),
        {"request_id": "req-2", "sample_sequence_ids": ["req-2:0"], "model_id": None},
        types.UntypedAPIFuture,
    ),
    (
        wire.model_info("m", "base", "/tok", 8),
        {
            "type": "get_info",
            "model_data": {"arch": "tandem", "model_name": "base", "tokenizer_id": "/tok"},
            "model_id": "m",
            "is_lora": True,
            "lora_rank": 8,
            "model_name": "base",
            "optimizer_config": {"type": "adamw"},
        },
        types.GetInfoResponse,
    ),
]


@pytest.mark.parametrize("answer, by_hand, sdk_type", JSON_ANSWERS)
def test_json_answers_are_the_sdks_types_with_the_hand_built_json(answer, by_hand, sdk_type):
    assert answer == by_hand
    if sdk_type is not None:
        assert sdk_type.model_validate(by_hand).model_dump(mode="json") == answer
