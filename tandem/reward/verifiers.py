"""Rule-based verifiers: `fn(solution_str, ground_truth, extra_info) -> float` in [0, 1].

Each is registered in `VERIFIERS` under the `data_source` name that the "auto" reward dispatches on.
A verifier may also return (score, parts), parts being metrics to log, and may declare the
keyword arguments `data_source` (the row's) and `code_limits` (the sandbox's `CodeLimits`), which
every call passes and the registry drops for a verifier that does not declare them.
"""

import ast
import logging
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from tandem.data.reasoning_gym import DATA_SOURCE as REASONING_GYM
from tandem.data.reasoning_gym import score as score_reasoning_gym
from tandem.registry import OptionRegistry
from tandem.reward.code import CodeLimits, extract_program, parse_tests, run_tests

Verifier = Callable[..., float | tuple[float, dict[str, float]]]
VERIFIERS: OptionRegistry[Verifier] = OptionRegistry("verifier", context=["data_source", "code_limits"])

_INT = re.compile(r"-?\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A run of the characters a countdown expression may use; '=' and newlines end a run, so
# "(3+4)*4 = 28" yields the runs "(3+4)*4 " and " 28".
_EXPR_RUN = re.compile(r"[0-9+\-*/() \t]+")
_MAX_EXPR_CHARS = 300  # longer is never a real answer and could make `ast.parse` recurse deeply
_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)


@VERIFIERS.register("addition")
def addition(solution_str: str, ground_truth: Any, extra_info: dict) -> tuple[float, dict[str, float]]:
    """1.0 when the last integer in the response equals the sum `ground_truth` (str or int): the
    lenient score, which a real model's "23 + 58 = 81." earns too; its part `strict` is 1.0 only for
    the bare answer ("81"), the format the built-in warm start writes (val/strict/mean)."""
    found = _INT.findall(solution_str)
    truth = str(ground_truth).strip()
    lenient = float(bool(found) and int(found[-1]) == int(truth))
    return lenient, {"strict": float(solution_str.strip() == truth)}


@VERIFIERS.register("multiply")
def multiply(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the last integer after the last tool result (`</result>`; the whole response when
    there is none) equals the product `ground_truth`: the answer must be the model's own words, a
    tool result alone does not count."""
    answer = solution_str.rpartition("</result>")[2]
    found = _INT.findall(answer)
    return float(bool(found) and int(found[-1]) == int(str(ground_truth).strip()))


@VERIFIERS.register("reverse")
def reverse(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the stripped response is exactly the reversed string `ground_truth`."""
    return float(solution_str.strip() == ground_truth)


@VERIFIERS.register("exact_match")
def exact_match(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the stripped response equals `str(ground_truth)` stripped."""
    return float(solution_str.strip() == str(ground_truth).strip())


@VERIFIERS.register("countdown")
def countdown(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the answer expression uses each of `ground_truth["numbers"]` exactly once and
    evaluates to `ground_truth["target"]` (within 1e-6).

    The answer is the last `<answer>...</answer>` if there is one, else the whole response; within
    it, the expression is the last run of `0-9 + - * / ( )` and spaces holding two or more numbers
    (or, failing that, the last holding one), so a trailing "= 28" or prose around it is ignored.
    """
    expr = _countdown_expression(solution_str)
    if expr is None:
        return 0.0
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        literals = sorted(_int_literals(tree))
        if literals != sorted(int(n) for n in ground_truth["numbers"]):
            return 0.0
        value = _evaluate(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    return float(abs(value - Fraction(ground_truth["target"])) <= 1e-6)


def _countdown_expression(solution_str: str) -> str | None:
    tagged = _ANSWER_TAG.findall(solution_str)
    text = (tagged[-1] if tagged else solution_str).replace("×", "*").replace("÷", "/")
    runs = [r for r in _EXPR_RUN.findall(text) if len(r) <= _MAX_EXPR_CHARS]
    several = [r for r in runs if len(_INT.findall(r)) >= 2]
    single = [r for r in runs if _INT.search(r)]
    return (several or single or [None])[-1]


def _int_literals(tree: ast.AST) -> list[int]:
    """The integer literals of a countdown expression; ValueError on any other kind of node."""
    literals = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ValueError(f"not an integer literal: {node.value!r}")
            literals.append(node.value)
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, *_OPS)):
            raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")
    return literals


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of an expression already checked by `_int_literals` (no code is executed)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            return left / right  # Fraction raises ZeroDivisionError on 0
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


@VERIFIERS.register("code")
def code(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict,
    *,
    data_source: str = "code",
    code_limits: CodeLimits | None = None,
) -> tuple[float, dict[str, float]]:
    """passed / len(tests): the response's program (its last ```python or bare ``` block, else the
    whole response) run against each test of `ground_truth` in the sandbox (`tandem.reward.code`).

    Parts: `code/passed` (the same fraction) and `code/timeouts` (tests out of time). A row without
    usable tests raises TandemError naming its data source and the formats expected. `code_limits`
    None = `CodeLimits()`: 5 s and 512 MB per test, no overall budget.
    """
    tests = parse_tests(ground_truth, data_source)
    return run_tests(extract_program(solution_str), tests, code_limits or CodeLimits())


@VERIFIERS.register(REASONING_GYM)
def reasoning_gym(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """The reasoning-gym dataset's own `score_answer(answer=solution_str, entry)` in [0, 1], the
    entry rebuilt from the row (`extra_info["reasoning_gym"]`: dataset, config, question, metadata;
    answer = ground_truth), as the rows of data.task=reasoning_gym:<dataset> carry it."""
    return score_reasoning_gym(solution_str, ground_truth, extra_info)


@VERIFIERS.register("math")
def math_equal(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when math-verify finds the response's answer equivalent to `ground_truth`
    ("0.5" ~ "1/2" ~ "\\frac{1}{2}").

    A bare ground truth is parsed as `\\boxed{...}` because math-verify reads bare "2x" as 2.
    Its signal-based timeouts are off: they fail outside the main thread, and RewardPool already
    kills a call that runs past its timeout.
    """
    from math_verify import parse, verify  # imports sympy: slow, so only when used

    _quiet_math_verify()
    gold_text = str(ground_truth).strip()
    gold = []
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold = parse("\\boxed{" + gold_text + "}", parsing_timeout=None)
    gold = gold or parse(gold_text, parsing_timeout=None)
    pred = parse(solution_str, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


def _quiet_math_verify() -> None:
    """Drop math-verify's one-off "Timeout is disabled" warning: the pool enforces the timeout."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _drop_timeout_warning not in logger.filters:
            logger.addFilter(_drop_timeout_warning)


def _drop_timeout_warning(record: logging.LogRecord) -> bool:
    return "Timeout is disabled" not in str(record.msg)
