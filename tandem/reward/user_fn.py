"""The `RewardFn` protocol and `load_reward_fn`, which turns a spec string into one.

A spec is "auto" (dispatch on `Prompt.data_source`), a verifier name, "pkg.module:function" or
"path/to/file.py:function". A user function may follow verl's convention
`(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}` or TRL's
`(prompts, completions, **columns) -> list[float]`; which one is told by its parameter names.
"""

import hashlib
import importlib.util
import inspect
import numbers
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from tandem.errors import TandemError
from tandem.loading import LoadError, load
from tandem.reward.code import CodeLimits
from tandem.reward.verifiers import VERIFIERS, Verifier
from tandem.sample import Prompt


class RewardFn(Protocol):
    """Scores one response to one prompt: returns (score, parts); parts may be empty."""

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]: ...


def _spec_forms() -> str:
    return (
        f"A reward spec is 'auto', a verifier name ({', '.join(VERIFIERS.names())}), "
        "'pkg.module:function' or 'path/to/file.py:function'."
    )


def _verify(
    verifier: Verifier, prompt: Prompt, response: str, code_limits: CodeLimits | None
) -> tuple[float, dict[str, float]]:
    """Call a verifier on a prompt's columns; a bare float result has no parts."""
    result = verifier(
        response,
        prompt.ground_truth,
        prompt.extra_info,
        data_source=prompt.data_source,
        code_limits=code_limits,
    )
    if isinstance(result, tuple):
        score, parts = result
        return float(score), dict(parts)
    return float(result), {}


class VerifierReward:
    """A registered verifier, called with the prompt's ground truth and extra info."""

    def __init__(self, name: str, code_limits: CodeLimits | None = None):
        self.name, self.code_limits = name, code_limits
        self.verifier = VERIFIERS.get(name)

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]:
        return _verify(self.verifier, prompt, response, self.code_limits)


class AutoReward:
    """The verifier named by each prompt's `data_source` (like verl's default_compute_score)."""

    def __init__(self, code_limits: CodeLimits | None = None):
        self.code_limits = code_limits

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]:
        return _verify(self.verifier_for(prompt.data_source), prompt, response, self.code_limits)

    def verifier_for(self, data_source: str) -> Verifier:
        if data_source not in VERIFIERS:
            raise TandemError(
                f"Reward 'auto' has no verifier for data source {data_source!r}. It dispatches on "
                f"the data_source column, which must be one of: {', '.join(VERIFIERS.names())}; "
                "otherwise set the reward function to a verifier name or 'pkg.module:function'."
            )
        return VERIFIERS.get(data_source)


class _UserReward:
    """A user function, called with the keyword arguments of its convention that it accepts."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._names = None if takes_all else set(params)

    def _call(self, **kwargs: Any) -> Any:
        if self._names is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._names}
        return self.fn(**kwargs)


VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


class VerlReward(_UserReward):
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`."""

    def __init__(self, fn: Callable, spec: str):
        super().__init__(fn, spec)
        # A required parameter the convention never passes would fail on every sample, in the actors.
        for p in inspect.signature(fn).parameters.values():
            passed = p.name in VERL_ARGS and p.kind is not p.POSITIONAL_ONLY
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not passed:
                raise TandemError(
                    f"Reward function {spec!r} requires the parameter {p.name!r}, which verl's convention "
                    f"never passes: it passes {', '.join(VERL_ARGS)} by keyword. Give {p.name!r} a "
                    "default or drop it."
                )

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]:
        result = self._call(
            data_source=prompt.data_source,
            solution_str=response,
            ground_truth=prompt.ground_truth,
            extra_info=prompt.extra_info,
        )
        if not isinstance(result, dict):
            return float(result), {}
        if "score" not in result:
            raise TandemError(
                f"Reward function {self.spec!r} returned a dict without a 'score' key "
                f"(keys: {', '.join(map(str, result))}); verl's convention needs 'score'."
            )
        parts = {k: float(v) for k, v in result.items() if k != "score" and _is_number(v)}
        return float(result["score"]), parts


class TrlReward(_UserReward):
    """TRL's `fn(prompts, completions, **kwargs) -> list[float]`, called on a batch of one.

    Conversational prompts get `[{"role": "assistant", "content": ...}]` completions, and every
    dataset column (plus `ground_truth`) is a keyword argument, as TRL's GRPOTrainer does. A None
    score (TRL's "does not apply") counts as 0.0.
    """

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]:
        chat = prompt.messages is not None
        completion: Any = [{"role": "assistant", "content": response}] if chat else response
        kwargs = {"ground_truth": [prompt.ground_truth], **{k: [v] for k, v in prompt.columns.items()}}
        kwargs["prompts"] = [prompt.messages if chat else prompt.text]
        kwargs["completions"] = [completion]
        scores = self._call(**kwargs)
        if len(scores) != 1:
            raise TandemError(
                f"Reward function {self.spec!r} returned {len(scores)} scores for 1 completion; "
                "TRL's convention is one float per completion."
            )
        return (0.0 if scores[0] is None else float(scores[0])), {}


def load_reward_fn(spec: str, code_limits: CodeLimits | None = None) -> RewardFn:
    """Resolve a spec ("auto" | verifier name | "pkg.module:function" | "path/to/file.py:function").

    A user function's convention (verl or TRL) is told by its parameter names. `code_limits` goes
    to the verifiers that run code (None = their defaults). Raises TandemError naming the spec and
    the valid forms when it cannot be resolved.
    """
    if spec == "auto":
        return AutoReward(code_limits)
    if spec in VERIFIERS:
        return VerifierReward(spec, code_limits)
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise TandemError(f"Unknown reward function {spec!r}. {_spec_forms()}")
    fn = _load(target, attr, spec)
    params = _parameters(fn, spec)
    if "solution_str" in params:
        return VerlReward(fn, spec)
    if "completions" in params:
        return TrlReward(fn, spec)
    raise TandemError(
        f"Reward function {spec!r} has parameters ({', '.join(params)}), which match no known "
        "convention: verl's (data_source, solution_str, ground_truth, extra_info) or TRL's "
        "(prompts, completions, **kwargs)."
    )


def load_within(spec: str, timeout_s: float, code_limits: CodeLimits | None = None) -> RewardFn:
    """`load_reward_fn`, or a TandemError if importing the spec's module takes over `timeout_s`.

    The import runs in a daemon thread, so a module that sleeps or waits at import time cannot
    hold up the caller; the thread is left behind (Python cannot stop it) and ends with the process.
    """
    result: list = []

    def load() -> None:
        try:
            result.append(load_reward_fn(spec, code_limits))
        except BaseException as e:  # noqa: B036  # handed to the caller, whatever it is
            result.append(e)

    thread = threading.Thread(target=load, name="tandem-reward-import", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise TandemError(
            f"Importing reward function {spec!r} did not finish within reward.import_timeout_s="
            f"{timeout_s:g} s: its module waits or loops at import time. Move slow set-up into the "
            "function (it runs in the reward workers, each call within reward.timeout_s), or raise "
            "reward.import_timeout_s."
        )
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def canonical_spec(spec: str) -> str:
    """The spec with a file path made absolute, so worker processes resolve the same file."""
    target, sep, attr = spec.rpartition(":")
    if sep and _is_file_target(target):
        return f"{os.path.abspath(target)}:{attr}"
    return spec


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or "/" in target


def _load(target: str, attr: str, spec: str) -> Callable:
    """The callable `spec` names: its module imported (a file by its path), the attribute walked."""
    module = _import_file(target, spec).__name__ if _is_file_target(target) else target
    try:
        obj = load(f"{module}:{attr}")
    except LoadError as e:
        if e.reason == "shape":
            raise TandemError(f"Unknown reward function {spec!r}. {_spec_forms()}") from None
        if e.reason == "import":
            raise TandemError(
                f"Cannot import module {target!r} of reward function {spec!r}: {e.error}. {_spec_forms()}"
            ) from e.error
        found = sys.modules[module]
        public = [n for n in dir(found) if not n.startswith("_") and callable(getattr(found, n))]
        raise TandemError(
            f"Reward function {spec!r}: {module!r} has no attribute {attr!r}. Its public callables are: "
            f"{', '.join(public) or 'none'}."
        ) from None
    except Exception as e:  # the user's module failed as it ran: say where, in one paragraph
        raise TandemError(f"Importing module {target!r} of reward function {spec!r} {_raised(e)}") from None
    if not callable(obj):
        raise TandemError(f"Reward function {spec!r} names a {type(obj).__name__}, which is not callable.")
    return obj


def _import_file(path: str, spec: str) -> Any:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise TandemError(f"Reward function file {path!r} of spec {spec!r} does not exist. {_spec_forms()}")
    # A name unique to the path, registered before exec so dataclasses and pickling inside work.
    name = "tandem_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file failed as it ran: say where, in one paragraph
        del sys.modules[name]
        raise TandemError(f"Running reward function file {path!r} of spec {spec!r} {_raised(e)}") from None
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _raised(e: Exception) -> str:
    """'raised NameError: ... (at file.py:3).' for an exception from a user's module."""
    if isinstance(e, SyntaxError):
        return f"raised SyntaxError: {e.msg} (at {e.filename}:{e.lineno})."
    frames = traceback.extract_tb(e.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(e).__name__}: {e}{at}."


def _parameters(fn: Callable, spec: str) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise TandemError(f"Cannot read the signature of reward function {spec!r}: {e}.") from e


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)
