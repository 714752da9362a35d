"""Tools an agent loop can call: a `TOOLS` registry of `Tool`s, each a tag and a function.

The model calls a tool by writing `<tag>input</tag>` (`<calc>37*48</calc>`); the agent runs
`tool(input)` and appends its output to the context (docs/agents.md). A tool returns its output
text, or raises `ToolError` for a call it refuses or that failed, whose message the model then sees.

| name         | tag      | input                      | output                                        |
|--------------|----------|----------------------------|-----------------------------------------------|
| `calculator` | `calc`   | an arithmetic expression   | its exact value: `1776`, `3.5`, `0.3333333333` |
| `python`     | `python` | a Python program           | its stdout (run by `tandem.sandbox.run_python`) |
"""

import ast
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from tandem.registry import Registry


class ToolError(Exception):
    """A call the tool refuses or that failed; the message is what the model is shown."""


@dataclass(frozen=True)
class Tool:
    """`tag`: the model writes `<tag>input</tag>`; `run(input) -> output`, or raises ToolError.
    `description` and `argument` (the input's name) make its OpenAI schema (`openai_tool`)."""

    tag: str
    run: Callable[[str], str]
    description: str = ""
    argument: str = "input"

    def __call__(self, text: str) -> str:
        return self.run(text)

    @property
    def opener(self) -> str:
        return f"<{self.tag}>"

    @property
    def closer(self) -> str:
        return f"</{self.tag}>"


TOOLS: Registry[Tool] = Registry("tool")

# -- calculator ----------------------------------------------------------------------------------
MAX_EXPRESSION_CHARS = 200  # longer is never a real call, and could make ast.parse recurse deeply
MAX_BITS = 1024  # a value (numerator or denominator) above ~10^308 is refused, before it is computed
DECIMALS = 10  # a value that is not an integer is shown rounded to this many decimals
_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


def calculate(expression: str) -> str:
    """The exact value of `+ - * / // % **` and parentheses over integer and decimal literals.

    No `eval`: the expression is parsed with `ast` and only those nodes are evaluated, on
    `Fraction`s, so 0.1+0.2 is 0.3. Refused (ToolError): names, calls, attributes, any other
    syntax, more than MAX_EXPRESSION_CHARS characters, a division by zero, a non-integer exponent,
    and any value whose numerator or denominator would exceed MAX_BITS bits (checked before a
    power is computed, so 9**9**9 costs nothing).
    """
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        raise ToolError(f"not an arithmetic expression: {text}") from None
    return _format(_value(tree.body))


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # A float literal is read from its own digits ("0.1" is 1/10, not the nearest double).
        value = Fraction(ast.unparse(node)) if type(node.value) is float else Fraction(node.value)
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
        return _checked(_binary(node.op, _value(node.left), _value(node.right)))
    raise ToolError(f"not allowed in a calculation: {ast.unparse(node)}")


def _binary(op: ast.operator, a: Fraction, b: Fraction) -> Fraction:
    if isinstance(op, ast.Add):
        return a + b
    if isinstance(op, ast.Sub):
        return a - b
    if isinstance(op, ast.Mult):
        return a * b
    if isinstance(op, ast.Pow):
        return _power(a, b)
    if b == 0:
        raise ToolError("division by zero")
    if isinstance(op, ast.Div):
        return a / b
    if isinstance(op, ast.FloorDiv):
        return Fraction(a // b)
    return a % b


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only integer exponents are allowed")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    # |base| >= 2 (or its inverse) has at least size - 1 bits per power: refuse before computing.
    if base not in (0, 1, -1) and (size - 1) * abs(exponent.numerator) > MAX_BITS:
        raise ToolError(f"the result would be too large (over {MAX_BITS} bits)")
    return base**exponent.numerator


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ToolError(f"the result would be too large (over {MAX_BITS} bits)")
    return value


def _format(value: Fraction) -> str:
    """An integer as itself; otherwise rounded to DECIMALS decimals, trailing zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMALS)  # an int: Fraction rounds half to even
    whole, part = divmod(abs(scaled), 10**DECIMALS)
    text = f"{whole}.{part:0{DECIMALS}d}".rstrip("0").rstrip(".")
    return f"-{text}" if scaled < 0 else text


TOOLS.register("calculator")(
    Tool("calc", calculate, "The exact value of an arithmetic expression, e.g. 37*48.", "expression")
)

# -- python --------------------------------------------------------------------------------------
PYTHON_TIMEOUT_S = 5.0
PYTHON_MEMORY_MB = 512
PYTHON_OUTPUT_BYTES = 4096  # the response's token cap trims further


def run_program(code: str) -> str:
    """Run `code` with `tandem.sandbox.run_python` (a fresh subprocess: time, memory and output
    limits, no network) -> its stdout; ToolError with the last line of stderr (the exception) when
    it fails, or with the time limit when it runs out of time."""
    from tandem.sandbox import run_python  # subprocess machinery: only where the tool is used

    result = run_python(
        code, timeout_s=PYTHON_TIMEOUT_S, memory_mb=PYTHON_MEMORY_MB, max_output_bytes=PYTHON_OUTPUT_BYTES
    )
    if result.timed_out:
        raise ToolError(f"timed out after {PYTHON_TIMEOUT_S:g} s")
    if not result.ok:
        lines = result.stderr.strip().splitlines()
        raise ToolError(lines[-1] if lines else f"exit status {result.returncode}")
    return result.stdout.rstrip("\n")


TOOLS.register("python")(
    Tool("python", run_program, "Runs a Python program and returns what it printed.", "code")
)


def openai_tool(name: str) -> dict:
    """The OpenAI `tools` entry of a registered tool: a function of one string argument."""
    tool = TOOLS.get(name)
    parameters = {
        "type": "object",
        "properties": {tool.argument: {"type": "string"}},
        "required": [tool.argument],
    }
    return {
        "type": "function",
        "function": {"name": name, "description": tool.description, "parameters": parameters},
    }
