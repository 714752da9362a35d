"""Synthetic verifiable tasks: short prompts a character-level model can learn, with exact answers.

Each task writes rows in verl's columns and knows its correct response (`solution`) and a
systematically wrong but well-formed one (`flawed_solution`, to warm-start a weak policy that RL
then has to improve). Responses are exactly the text the model should write before eos.

| task      | prompt           | solution  | ground_truth                            |
|-----------|------------------|-----------|-----------------------------------------|
| addition  | "23+58="         | "81"      | "81"                                    |
| countdown | "3 7 12 -> 33"   | "3*7+12"  | {"target": 33, "numbers": [3, 7, 12]}   |
| reverse   | "reverse: abcde" | "edcba"   | "edcba"                                 |
| multiply  | "37*48="         | "<calc>37*48</calc><result>1776</result>1776" | "1776"      |
| addition_judge | "23+58=71?" | "81 71 no" | "no"                                   |

"reasoning_gym:<dataset>" is any dataset of reasoning-gym (`ReasoningGym`, tandem.data.reasoning_gym):
its question is the prompt, its answer the solution and ground truth; it has no flawed solution.
`build_task(name, config)` builds the task `data.task` names with `data.task_config` as arguments.

Train and test are disjoint by construction: a problem is in "test" when the md5 of its canonical
text is 0 mod 10 (about 10% of problems), else in "train", and `make_rows` draws only problems of
the split asked for. Canonical text makes a+b and b+a (and countdown's number orders) one problem;
a reasoning-gym question's canonical text is the question itself.
Rows are drawn with replacement, so a large n may repeat a problem.
"""

import hashlib
import inspect
import math
import os
import random
from collections.abc import Callable
from typing import Any

from tandem.data import reasoning_gym as rgym
from tandem.data.dataset import save_rows
from tandem.errors import TandemError
from tandem.registry import Registry
from tandem.sample import Prompt

SPLITS = ("train", "test")
TEST_BUCKETS = 10  # one problem in TEST_BUCKETS goes to "test"


class Task:
    """A generator of verifiable problems. Subclasses set `name` and implement `draw` and `solution`."""

    name: str = ""

    def draw(self, rng: random.Random) -> tuple[str, Any, str]:
        """One random problem: (prompt text, ground truth, canonical text used for the split)."""
        raise NotImplementedError

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        """The correct response text (what the model should write before eos)."""
        raise NotImplementedError

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        """A well-formed response that is systematically wrong."""
        raise NotImplementedError

    def make_rows(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """n rows of `split`, deterministic in (task arguments, n, seed, split), in verl's columns."""
        self._check_request(n, split)
        rng = random.Random(seed)
        rows: list[dict[str, Any]] = []
        for _ in range(1000 * n + 10_000):  # bounded: a split with no problems must not hang
            text, ground_truth, canonical = self.draw(rng)
            if split_of(canonical) != split:
                continue
            rows.append(
                {
                    "data_source": self.name,
                    "prompt": [{"role": "user", "content": text}],
                    "reward_model": {"style": "rule", "ground_truth": ground_truth},
                    "extra_info": {"split": split, "index": len(rows)},
                }
            )
            if len(rows) == n:
                return rows
        raise TandemError(f"Task {self.name!r} found too few {split} problems; give it larger problems.")

    def _check_request(self, n: int, split: str) -> None:
        if split not in SPLITS:
            raise TandemError(
                f"Unknown split {split!r} for task {self.name!r}. Valid splits: {', '.join(SPLITS)}."
            )
        if n < 1:
            raise TandemError(f"Task {self.name!r}: the number of rows must be at least 1, got {n}.")


def split_of(canonical: str) -> str:
    """ "test" for about one canonical problem text in TEST_BUCKETS, else "train"; stable across runs."""
    bucket = int(hashlib.md5(canonical.encode("utf-8")).hexdigest(), 16) % TEST_BUCKETS
    return "test" if bucket == 0 else "train"


TASKS: Registry[Callable[..., Task]] = Registry("task")


@TASKS.register("addition")
class Addition(Task):
    """ "a+b=" -> "a+b". Each operand has 1..max_digits digits (digit count uniform, then the value
    uniform; 1-digit operands include 0). With max_digits=2 about 53% of problems have a carry
    (max_digits=1: 45%, 3: 59%), so the carry-dropping flawed solution is wrong about half the time."""

    name = "addition"

    def __init__(self, max_digits: int = 2):
        if max_digits < 1:
            raise TandemError(f"Task 'addition': max_digits must be at least 1, got {max_digits}.")
        self.max_digits = max_digits

    def draw(self, rng: random.Random) -> tuple[str, Any, str]:
        a, b = self._operand(rng), self._operand(rng)
        return f"{a}+{b}=", str(a + b), f"{min(a, b)}+{max(a, b)}="

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        a, b = _operands(row)
        return str(a + b)

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        """The digit-wise sum with every carry dropped: 58+67 -> "15". Wrong exactly when a carry occurs."""
        a, b = _operands(row)
        digits, place = 0, 1
        while a or b:
            digits += (a % 10 + b % 10) % 10 * place
            a, b, place = a // 10, b // 10, place * 10
        return str(digits)


def _operands(row: dict[str, Any] | Prompt) -> tuple[int, int]:
    a, b = _content(row).removesuffix("=").split("+")
    return int(a), int(b)


@TASKS.register("addition_judge")
class AdditionJudge(Task):
    """ "23+58=81?" -> "81 81 yes", "23+58=71?" -> "81 71 no": is the claimed sum right? The data of
    the judge `recipes/sft-judge.yaml` trains (reward.fn=judge). It writes the sum it makes, then the
    claim again beside it, then its verdict: a model of a few million parameters compares two numbers
    it has just written side by side far more reliably than a sum it must hold in its head with a
    claim far back in the prompt (measured, docs/rewards.md "The addition judge"). Half the claims
    are right; of the wrong ones where the problem has a carry, half are the sum with its carries
    dropped (the warm-start policy's own mistake, the hardest to tell apart), and the rest a
    policy's other mistakes (`wrong_sum`).
    Problems split as `addition`'s do, so its test problems stay unseen."""

    name = "addition_judge"

    def __init__(self, max_digits: int = 2):
        self.addition = Addition(max_digits)

    def draw(self, rng: random.Random) -> tuple[str, Any, str]:
        text, truth, canonical = self.addition.draw(rng)
        if rng.random() < 0.5:
            claim = truth
        else:
            dropped = self.addition.flawed_solution({"prompt": text}, rng)
            claim = dropped if dropped != truth and rng.random() < 0.5 else wrong_sum(int(truth), rng)
        return f"{text}{claim}?", "yes" if claim == truth else "no", canonical

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        problem, claim = _content(row).removesuffix("?").split("=", 1)
        total = sum(int(x) for x in problem.split("+"))
        return f"{total} {claim} {'yes' if claim == str(total) else 'no'}"

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        """The right working with the verdict turned round."""
        *work, verdict = self.solution(row).split(" ")
        return " ".join([*work, "no" if verdict == "yes" else "yes"])


def wrong_sum(total: int, rng: random.Random) -> str:
    """A claim other than `total`: a carry dropped or misplaced, one digit off, a digit lost or
    doubled, any number, or no number at all."""
    digits = str(total)
    while True:
        pick = rng.random()
        if pick < 0.3:  # one digit changed: what a dropped carry does to a sum
            i = rng.randrange(len(digits))
            claim = digits[:i] + str(rng.randrange(10)) + digits[i + 1 :]
        elif pick < 0.5:
            claim = str(max(0, total + rng.choice([-11, -10, -9, -2, -1, 1, 2, 9, 10, 11])))
        elif pick < 0.65:  # a digit lost or doubled
            i = rng.randrange(len(digits))
            kept = digits[i] * 2 if rng.random() < 0.5 else ""
            claim = digits[:i] + kept + digits[i + 1 :]
        elif pick < 0.95:
            claim = str(rng.randrange(200))
        else:
            claim = rng.choice(["", "+", "=", "?", "a"])
        if not (claim.isdigit() and int(claim) == total):  # "081" is right to a verifier
            return claim


@TASKS.register("countdown")
class Countdown(Task):
    """ "3 7 12 -> 33": write an expression with + - * that uses every number exactly once and
    equals the target, e.g. "3*7+12" (no spaces). The target is the value of a random expression over
    all the numbers, kept only when it is a positive integer, so every problem is solvable."""

    name = "countdown"

    def __init__(self, count: int = 3, max_number: int = 20):
        if count < 2 or max_number < 1:
            raise TandemError(
                f"Task 'countdown': need count >= 2 and max_number >= 1, got {count} and {max_number}."
            )
        self.count, self.max_number = count, max_number

    def draw(self, rng: random.Random) -> tuple[str, Any, str]:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
            pool = [_Expr(n, str(n), _ATOM) for n in numbers]
            while len(pool) > 1:
                left = pool.pop(rng.randrange(len(pool)))
                right = pool.pop(rng.randrange(len(pool)))
                pool.append(_combine(left, rng.choice("+-*"), right))
            if pool[0].value >= 1:
                break
        target = pool[0].value
        text = f"{' '.join(map(str, numbers))} -> {target}"
        canonical = f"{' '.join(map(str, sorted(numbers)))} -> {target}"
        return text, {"target": target, "numbers": numbers}, canonical

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        """The first expression found by exhaustive search (deterministic), e.g. "3*7+12"."""
        truth = _ground_truth(row)
        found = _solve([_Expr(n, str(n), _ATOM) for n in truth["numbers"]], truth["target"])
        if found is None:
            raise TandemError(f"Countdown problem {_content(row)!r} has no solution with + - *.")
        return found

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        """The numbers joined with "+" in the given order: well-formed, usually the wrong value."""
        return "+".join(map(str, _ground_truth(row)["numbers"]))


_ATOM, _PRODUCT, _SUM = 3, 2, 1  # operator precedence of an expression's outermost operation


class _Expr:
    """An integer expression: its value, its text with minimal parentheses, and its precedence."""

    def __init__(self, value: int, text: str, precedence: int):
        self.value, self.text, self.precedence = value, text, precedence


def _combine(left: _Expr, op: str, right: _Expr) -> _Expr:
    if op == "+":  # a + (b - c) == a + b - c: "+" never needs parentheses
        return _Expr(left.value + right.value, f"{left.text}+{right.text}", _SUM)
    if op == "-":
        r = f"({right.text})" if right.precedence == _SUM else right.text
        return _Expr(left.value - right.value, f"{left.text}-{r}", _SUM)
    lt, rt = (f"({e.text})" if e.precedence == _SUM else e.text for e in (left, right))
    return _Expr(left.value * right.value, f"{lt}*{rt}", _PRODUCT)


def _solve(items: list[_Expr], target: int) -> str | None:
    """Text of an expression combining all `items` with + - * that equals target, or None."""
    if len(items) == 1:
        return items[0].text if items[0].value == target else None
    for i, left in enumerate(items):
        for j, right in enumerate(items):
            if i == j:
                continue
            rest = [e for k, e in enumerate(items) if k not in (i, j)]
            for op in "+-*":
                if op != "-" and j < i:  # + and * commute: one order is enough
                    continue
                found = _solve([_combine(left, op, right), *rest], target)
                if found is not None:
                    return found
    return None


@TASKS.register("reverse")
class Reverse(Task):
    """ "reverse: abcde" -> "edcba", lowercase strings of min_length..max_length letters."""

    name = "reverse"
    prefix = "reverse: "

    def __init__(self, min_length: int = 3, max_length: int = 6):
        if not 1 <= min_length <= max_length:
            raise TandemError(
                f"Task 'reverse': need 1 <= min_length <= max_length, got {min_length}, {max_length}."
            )
        self.min_length, self.max_length = min_length, max_length

    def draw(self, rng: random.Random) -> tuple[str, Any, str]:
        length = rng.randint(self.min_length, self.max_length)
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
        return self.prefix + word, word[::-1], word

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        return _content(row).removeprefix(self.prefix)[::-1]

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        """The word unchanged, or with only its first and last letters swapped (right for length 3)."""
        word = _content(row).removeprefix(self.prefix)
        if len(word) < 2 or rng.random() < 0.5:
            return word
        return word[-1] + word[1:-1] + word[0]


@TASKS.register("multiply")
class Multiply(Task):
    """ "37*48=" -> 1776, two operands in [low, high] (10..99), to solve with the calculator tool
    (rollout.agent=tools, docs/agents.md). A model of a few million parameters cannot multiply two
    2-digit numbers in its head, but it can copy them into a call and copy the result back:
    `<calc>37*48</calc><result>1776</result>1776`. The `<result>` span is the tool's output, which
    the agent appends and `tandem sft` masks; the answer is the integer written after it."""

    name = "multiply"

    def __init__(self, low: int = 10, high: int = 99):
        if not 0 <= low <= high:
            raise TandemError(f"Task 'multiply': need 0 <= low <= high, got {low}, {high}.")
        self.low, self.high = low, high

    def draw(self, rng: random.Random) -> tuple[str, Any, str]:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return f"{a}*{b}=", str(a * b), f"{min(a, b)}*{max(a, b)}="

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        a, b = _factors(row)
        return f"<calc>{a}*{b}</calc><result>{a * b}</result>{a * b}"

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        """A guess, without the tool: the product of the operands rounded to tens (37*48 -> "2000");
        right only when both end in 0."""
        a, b = _factors(row)
        return str((a + 5) // 10 * 10 * ((b + 5) // 10 * 10))


class ReasoningGym(Task):
    """ "reasoning_gym:<dataset>": entries of a reasoning-gym dataset built with `config`
    (data.task_config), scored by the dataset's own `score_answer` (tandem.data.reasoning_gym).

    The split is the other tasks' (md5 of the question text), not a seed per split: most datasets
    draw entry i from Random(seed + i), so seed s + 1 gives the entries of seed s shifted by one, and
    reasoning-gym has no train/test split of its own. A split's seed picks the entries read; those
    whose question belongs to the other split are skipped."""

    def __init__(self, dataset: str, config: dict[str, Any]):
        rgym.check(dataset, config)  # now, at config load, not after the run has started
        self.dataset, self.config = dataset, dict(config)
        self.name = rgym.PREFIX + dataset

    def make_rows(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        self._check_request(n, split)
        share = 1 / TEST_BUCKETS if split == "test" else 1 - 1 / TEST_BUCKETS
        # Twice the entries the split's share needs: enough unless the dataset has few problems.
        kwargs = {**self.config, "seed": seed, "size": 2 * math.ceil(n / share) + 100}
        rows: list[dict[str, Any]] = []
        for entry in rgym.entries(self.dataset, kwargs):
            if split_of(entry["question"]) == split:
                rows.append(rgym.to_row(self.dataset, kwargs, entry, split, len(rows)))
                if len(rows) == n:
                    return rows
        raise TandemError(
            f"Task {self.name!r} found {len(rows)} {split} problems of the {n} asked for in its first "
            f"{kwargs['size']} entries: the dataset has few distinct questions, or it ran out. Ask for "
            "fewer rows (data.train_size, data.val_size) or widen its config (data.task_config)."
        )

    def solution(self, row: dict[str, Any] | Prompt) -> str:
        """The entry's answer, reasoning-gym's reference solution."""
        answer = _ground_truth(row)
        if answer is None:
            raise TandemError(f"Task {self.name!r}: the entry {_content(row)!r} has no reference answer.")
        return str(answer)

    def flawed_solution(self, row: dict[str, Any] | Prompt, rng: random.Random) -> str:
        raise TandemError(
            f"Task {self.name!r} has no flawed solution: reasoning-gym gives only the right answer. Set "
            "sft.flawed_fraction=0 and make a weak warm start with fewer sft.steps instead."
        )


def build_task(name: str, config: dict[str, Any] | None = None) -> Task:
    """The task `name` (data.task) built with `config` (data.task_config) as its arguments: a task of
    TASKS, or "reasoning_gym:<dataset>". TandemError naming a key the task does not take."""
    config = dict(config or {})
    if name.startswith(rgym.PREFIX):
        return ReasoningGym(name.removeprefix(rgym.PREFIX), config)
    factory = TASKS.get(name)
    params = inspect.signature(factory).parameters
    unknown = [k for k in config if k not in params]
    if unknown:
        raise TandemError(
            f"Config 'data.task_config' has the key {unknown[0]!r}, which task {name!r} does not take. "
            f"Its keys: {', '.join(params) or 'none'}."
        )
    return factory(**config)


def _factors(row: dict[str, Any] | Prompt) -> tuple[int, int]:
    a, b = _content(row).removesuffix("=").split("*")
    return int(a), int(b)


def _content(row: dict[str, Any] | Prompt) -> str:
    """The problem text: the last message's content (chat) or the plain text."""
    if isinstance(row, Prompt):
        return row.messages[-1]["content"] if row.messages else (row.text or "")
    prompt = row["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def _ground_truth(row: dict[str, Any] | Prompt) -> Any:
    if isinstance(row, Prompt):
        return row.ground_truth
    return row["reward_model"]["ground_truth"]


def make_dataset(task: str, out: str, n: int = 1000, seed: int = 0, split: str = "train") -> str:
    """Write n rows of `task` (default arguments) to `out` (.jsonl / .json / .parquet); return `out`."""
    rows = build_task(task).make_rows(n, seed, split)
    save_rows(rows, out)
    return os.fspath(out)
