"""What a training request must satisfy before it is queued: each a TandemError naming the field,
which the client gets as a 400 (`tinker.BadRequestError`)."""

import math

from tandem.errors import TandemError
from tandem.serve.wire import Datum


def check_tokens(data: list[Datum], vocab: int, context: int) -> None:
    """Each datum: tokens in the vocabulary `vocab` (its size), within the model's `context`,
    targets the input shifted by one."""
    for i, d in enumerate(data):
        if not d.tokens or len(d.tokens) != len(d.targets):
            raise TandemError(
                f"Datum {i}: {len(d.tokens)} input tokens and {len(d.targets)} target_tokens; "
                "give one target per input position (at least one)."
            )
        if len(d.tokens) + 1 > context:
            raise TandemError(
                f"Datum {i}: {len(d.tokens) + 1} tokens, past the model's context of {context}."
            )
        if not all(0 <= t < vocab for t in d.tokens + d.targets):
            raise TandemError(f"Datum {i}: a token id outside the vocabulary [0, {vocab}).")
        if d.tokens[1:] != d.targets[:-1]:
            raise TandemError(
                f"Datum {i}: target_tokens must be model_input shifted by one (target[t] = input[t+1]), "
                "as the SDK's helpers build them: the service scores the sequence input + [last target]."
            )


def check_adam(adam: dict) -> None:
    """AdamParams' values as AdamW takes them (any absent: its default), or a TandemError naming
    the first field out of range. A negative learning rate would climb the loss."""
    rules = [
        ("learning_rate", lambda v: v >= 0, ">= 0"),
        ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("eps", lambda v: v > 0, "> 0"),
        ("weight_decay", lambda v: v >= 0, ">= 0"),
        ("grad_clip_norm", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ]
    for field, ok, rule in rules:
        value = adam.get(field)
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise TandemError(f"AdamParams.{field}={value} must be {rule}.")
