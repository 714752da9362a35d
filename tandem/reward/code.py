"""The code verifier's parts: the program in a response, the tests in a row, and running one on the other.

Tests come from the row's ground truth (verl's `reward_model.ground_truth`), in one of two formats,
or either as a JSON string (as verl's code datasets store it):
- a list of assert statements, e.g. ["assert add(1, 2) == 3", ...] (HumanEval, MBPP): each is
  run as `program + "\\n" + assert` and passes when that exits with code 0;
- {"inputs": [...], "outputs": [...]} stdin/stdout pairs (APPS, TACO, verl's prime code): the
  program runs with each input as stdin and passes when it exits with code 0 and its stdout equals
  the output line by line, each line and the whole stripped of surrounding whitespace.

Each test runs in its own `tandem.sandbox.run_python` with `CodeLimits`' per-test time and memory.
"""

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from tandem.errors import TandemError
from tandem.sandbox import run_python

# The last ```python / ```py / bare ``` fenced block; a block tagged with another language is not code.
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
_FORMATS = (
    'a list of assert statements (["assert f(1) == 2", ...]) or {"inputs": [...], "outputs": [...]} '
    "stdin/stdout pairs, or either as a JSON string"
)


@dataclass(frozen=True)
class CodeLimits:
    """Per-test limits of the sandbox, and the time all tests of one response may take together.

    `budget_s` None = no overall bound. `RewardPool` sets it below its own per-sample timeout, so a
    slow response loses only the tests it had no time for (counted as timed out), not its score.
    """

    timeout_s: float = 5.0
    memory_mb: int = 512
    budget_s: float | None = None


@dataclass(frozen=True)
class CodeTest:
    """An assert test has `check`, appended to the program; a stdin/stdout test has `stdin` and
    `expected`. Both need exit code 0; a stdin/stdout test also needs its output to match."""

    check: str = ""
    stdin: str = ""
    expected: str | None = None


def extract_program(response: str) -> str:
    """The last ```python (or ```py, or bare ```) fenced block of `response`, else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth: Any, data_source: str) -> list[CodeTest]:
    """The tests in a row's ground truth (see the module docstring); TandemError when there are none."""

    def fail(why: str) -> TandemError:
        return TandemError(
            f"The code verifier found no usable tests for a row of data source {data_source!r}: {why}. "
            f"It expects reward_model.ground_truth to be {_FORMATS}."
        )

    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            raise fail(f"the ground truth is a string that is not JSON: {ground_truth[:60]!r}") from None
    if isinstance(ground_truth, dict):
        if "fn_name" in ground_truth:
            raise fail("it names a function (fn_name): call-based tests are not supported")
        inputs, outputs = ground_truth.get("inputs"), ground_truth.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise fail(f"a dict with keys {sorted(ground_truth)} rather than equal-length inputs and outputs")
        tests = [CodeTest(stdin=_text(i), expected=_text(o)) for i, o in zip(inputs, outputs, strict=True)]
    elif isinstance(ground_truth, list) and all(isinstance(t, str) for t in ground_truth):
        tests = [CodeTest(check=t) for t in ground_truth]
    else:
        raise fail(f"the ground truth is a {type(ground_truth).__name__}")
    if not tests:
        raise fail("the list of tests is empty")
    return tests


def run_tests(program: str, tests: list[CodeTest], limits: CodeLimits) -> tuple[float, dict[str, float]]:
    """(passed / len(tests), {"code/passed": that fraction, "code/timeouts": tests out of time}).

    Tests run one after another, each in a fresh sandbox; a test that starts when less than its
    time is left of `limits.budget_s` gets only what is left, and once none is left the rest are
    not run and count as timed out.
    """
    deadline = math.inf if limits.budget_s is None else time.monotonic() + limits.budget_s
    passed = timeouts = 0
    for test in tests:
        left = min(limits.timeout_s, deadline - time.monotonic())
        if left <= 0:
            timeouts += 1
            continue
        result = run_python(
            program + "\n" + test.check, stdin=test.stdin, timeout_s=left, memory_mb=limits.memory_mb
        )
        timeouts += result.timed_out
        passed += result.ok and (test.expected is None or _lines(result.stdout) == _lines(test.expected))
    fraction = passed / len(tests)
    return fraction, {"code/passed": fraction, "code/timeouts": float(timeouts)}


def _text(value: Any) -> str:
    """A test's stdin or stdout: a string as is, a list of lines joined by newlines."""
    if isinstance(value, list):
        return "\n".join(map(str, value))
    return str(value)


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]
