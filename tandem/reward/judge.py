"""A judge: a generative reward model that reads each response and answers how good it is
(reward.fn=judge, docs/rewards.md "Judge"). The judge worker (`tandem.runtime.actors.JudgeActor`)
holds its model on a built-in engine; `JudgeWorker` is what it does with it.

For each sample, `reward.judge.template` renders the judge's user turn from the task's prompt, the
policy's response and the row's reference answer; all samples of one reward call are judged in one
engine call, greedy; `reward.judge.parser` reads each output as a score. An output no parser can
read, and a sample the judge has not finished within `reward.judge.timeout_s`, cost that sample
only: reward 0, counted in `reward/errors` and `reward/timeouts` as the reward pool counts its
failures. Beside the judge, the run's verifier (reward.judge.verifier) scores each sample it can,
so the judge's agreement with it is logged (the reward parts `judge` and `judge/agreement`).
"""

import logging
import math
import re
import string
import time
from collections.abc import Callable
from typing import Any

from tandem.registry import Registry
from tandem.reward.user_fn import RewardFn
from tandem.sample import Prompt, Sample, SamplingParams, Status

log = logging.getLogger("tandem.reward")

TEMPLATE_FIELDS = ("prompt", "response", "reference")
_MAX_LOGGED = 4  # failures logged one by one per call; the rest are counted

# A parser: the judge's output text -> a score, or None when the output says nothing it can read.
JUDGE_PARSERS: Registry[Callable[[str], float | None]] = Registry("judge parser")


@JUDGE_PARSERS.register("yes_no")
def yes_no(text: str) -> float | None:
    """The output's last word: "yes" -> 1.0, "no" -> 0.0 (any case, punctuation ignored), so a
    judge may show its working first ("81 yes")."""
    words = re.findall(r"[A-Za-z]+", text)
    last = words[-1].lower() if words else ""
    return {"yes": 1.0, "no": 0.0}.get(last)


@JUDGE_PARSERS.register("score")
def first_score(text: str) -> float | None:
    """The first number in the output, when it lies in [0, 1] ("Score: 0.8" -> 0.8)."""
    found = re.search(r"-?\d+(?:\.\d+)?", text)
    value = float(found.group()) if found else math.nan
    return value if 0.0 <= value <= 1.0 else None


def template_error(template: str) -> str:
    """Why `template` cannot render a judge's turn ("" when it can): a field other than
    TEMPLATE_FIELDS, a positional or formatted field, or unbalanced braces."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"is not a format string ({e}); write literal braces as {{{{ and }}}}."
    wrong = [f for f in fields if f not in TEMPLATE_FIELDS]
    if wrong:
        return (
            f"has the field {{{wrong[0]}}}; a template renders only {{prompt}}, {{response}} and "
            "{reference} (e.g. '{prompt}{response}?')."
        )
    if "response" not in fields:
        return "never shows the judge the {response}, so it could not judge it."
    return ""


def prompt_text(prompt: Prompt) -> str:
    """The task's question: a chat prompt's last user turn, or a plain prompt's text."""
    if prompt.messages:
        users = [m["content"] for m in prompt.messages if m["role"] == "user"]
        return users[-1] if users else prompt.messages[-1]["content"]
    return prompt.text or ""


def render(template: str, prompt: Prompt, response: str) -> str:
    """The judge's user turn for one response."""
    reference = "" if prompt.ground_truth is None else str(prompt.ground_truth)
    return template.format(prompt=prompt_text(prompt), response=response, reference=reference)


class JudgeWorker:
    """Judges samples on `engine` (a built-in engine on the judge's model, with `tokenizer`).

    `judge` is the run's `reward.judge` section; `verifier` scores samples beside the judge for
    the agreement figure (None: no agreement); `max_positions` is the judge model's context."""

    def __init__(
        self, engine: Any, tokenizer: Any, judge: Any, verifier: RewardFn | None, max_positions: int
    ):
        self.engine, self.tokenizer, self.judge, self.verifier = engine, tokenizer, judge, verifier
        self.parse = JUDGE_PARSERS.get(judge.parser)
        self.max_prompt = max_positions - judge.max_new_tokens
        self.params = SamplingParams(temperature=0.0, max_new_tokens=judge.max_new_tokens)
        self.deadline = math.inf
        engine.on_step = self._check_deadline  # between engine steps, on the generating thread

    def _check_deadline(self, steps: int) -> None:
        if time.monotonic() > self.deadline:
            self.engine.abort()  # the unfinished requests come back ABORTED: timeouts

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set each sample's reward to the judge's score (0.0 when it failed) and its parts: `judge`
        (the score) and, where the verifier answers, `verifier` and `judge/agreement` (1.0 when
        judge and verifier agree on right (>= 0.5) or wrong; a failed verdict never agrees).
        -> the call's counters: reward/errors, reward/timeouts."""
        given = [s for s in samples if s.agent_reward is not None]  # the agent's own reward
        for s in given:
            s.reward, s.reward_parts = s.agent_reward, {"agent": s.agent_reward}
        judged = [s for s in samples if s.agent_reward is None]
        verdicts = self.verdicts(judged)
        failures: list[tuple[str, str, Sample]] = []  # (counter, why, sample)
        for s, (score, counter, why) in zip(judged, verdicts, strict=True):
            s.reward, s.reward_parts = score, {"judge": score}
            if counter:
                failures.append((counter, why, s))
            self._compare(s, None if counter else score)
        _log_failures(failures)
        return {
            "reward/errors": float(sum(c == "reward/errors" for c, _, _ in failures)),
            "reward/timeouts": float(sum(c == "reward/timeouts" for c, _, _ in failures)),
        }

    def verdicts(self, samples: list[Sample]) -> list[tuple[float, str, str]]:
        """(score, "" or the counter a failure adds to, why) of each sample, judged in one engine call."""
        requests, out = [], [(0.0, "", "")] * len(samples)
        for i, s in enumerate(samples):
            turn = render(self.judge.template, s.prompt, s.response_text)
            ids = self._encode(turn)
            if len(ids) > self.max_prompt:
                out[i] = (0.0, "reward/errors", f"the judge's prompt has {len(ids)} tokens, over its context")
                continue
            requests.append((i, Sample(prompt=Prompt(text=turn), prompt_ids=ids, group_id=i)))
        self.deadline = time.monotonic() + self.judge.timeout_s
        try:
            if requests:
                self.engine.generate([r for _, r in requests], self.params)
        finally:
            self.deadline = math.inf
        for i, r in requests:
            out[i] = self._read(r)
        return out

    def _encode(self, turn: str) -> list[int]:
        messages = [{"role": "user", "content": turn}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _read(self, request: Sample) -> tuple[float, str, str]:
        if request.status == Status.ABORTED:
            return 0.0, "reward/timeouts", f"the judge had not answered after {self.judge.timeout_s:g} s"
        text = self.tokenizer.decode(request.response_ids, skip_special_tokens=True)
        score = self.parse(text)
        if score is None:
            why = f"parser {self.judge.parser!r} cannot read the judge's output {text!r}"
            return 0.0, "reward/errors", why
        return score, "", ""

    def _compare(self, sample: Sample, score: float | None) -> None:
        """The verifier's score beside the judge's, where it gives one (a quick, pure function: it
        runs here, not in the reward pool)."""
        if self.verifier is None:
            return
        try:
            truth, _ = self.verifier(sample.prompt, sample.response_text)
        except Exception:  # no verifier for this row (auto's TandemError) or it failed: no comparison
            return
        agrees = score is not None and (score >= 0.5) == (truth >= 0.5)
        sample.reward_parts.update({"verifier": float(truth), "judge/agreement": float(agrees)})


def _log_failures(failures: list[tuple[str, str, Sample]]) -> None:
    for _, why, sample in failures[:_MAX_LOGGED]:
        log.warning("Reward 0.0 for a sample: %s. Response begins: %r", why, sample.response_text[:80])
    if len(failures) > _MAX_LOGGED:
        log.warning("... and %d more samples got reward 0.0 from the judge.", len(failures) - _MAX_LOGGED)
