"""Verifiers, user reward functions (verl and TRL conventions) and the RewardPool's failure handling."""

import logging
import os
import threading
import time

import pytest

from tandem.errors import TandemError
from tandem.reward import VERIFIERS, RewardPool, load_reward_fn
from tandem.reward.user_fn import canonical_spec, load_within
from tandem.sample import Prompt, Sample

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_fns_example.py")


def verify(name: str, response: str, ground_truth: object, extra_info: dict | None = None) -> float:
    return VERIFIERS.get(name)(response, ground_truth, extra_info or {})


def sample(response: str, ground_truth: object = "7", data_source: str = "addition", **prompt_kw) -> Sample:
    prompt = Prompt(text="3+4=", ground_truth=ground_truth, data_source=data_source, **prompt_kw)
    return Sample(prompt=prompt, prompt_ids=[1, 2, 3], response_text=response)


# --- verifiers -------------------------------------------------------------------------------


def test_addition_takes_the_last_integer_and_its_strict_part_the_bare_answer():
    assert verify("addition", "3 + 4 = 7", "7") == (1.0, {"strict": 0.0})
    assert verify("addition", "I think 8, no: 7", 7) == (1.0, {"strict": 0.0})
    assert verify("addition", "7 is wrong, it is 8", "7") == (0.0, {"strict": 0.0})
    assert verify("addition", " -12\n", "-12") == (1.0, {"strict": 1.0})
    assert verify("addition", "no number at all", "7") == (0.0, {"strict": 0.0})


COUNTDOWN = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize(
    "response",
    [
        "2 * 3 * 4",
        "2*(3*4) = 24",
        "The answer is 4 * (2 * 3).",
        "<think>try 2*3+4</think><answer>(2*3)*4</answer>",
        "Let me see: 2 + 3 = 5, no.\n(3 * 2) * 4 = 24",
    ],
)
def test_countdown_right(response):
    assert verify("countdown", response, COUNTDOWN) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "2 * 3 + 4",  # wrong value
        "3 * 4 * 2 * 1",  # a number not given
        "4 * 3 * 2 * 2",  # reuses a number
        "24",  # leaves numbers out
        "2 * 3 * 4 / (4 - 4)",  # division by zero
        "2 ** 3 * 3",  # power is not allowed
        "2.0 * 3 * 4",  # neither are floats
        "",
    ],
)
def test_countdown_wrong(response):
    assert verify("countdown", response, COUNTDOWN) == 0.0


def test_countdown_division_and_negation():
    assert verify("countdown", "7 / (1 - 5 / 7) * 1", {"target": 24.5, "numbers": [7, 1, 5, 7, 1]}) == 1.0
    assert verify("countdown", "-(2 - 3 * 4) + 14", {"target": 24, "numbers": [2, 3, 4, 14]}) == 1.0


def test_countdown_never_executes_code(tmp_path):
    marker = tmp_path / "pwned"
    for attack in [f"__import__('os').system('touch {marker}')", f"<answer>open('{marker}','w')</answer>"]:
        assert verify("countdown", attack, COUNTDOWN) == 0.0
    assert verify("countdown", "(" * 5000 + "2*3*4" + ")" * 5000, COUNTDOWN) == 0.0
    assert not marker.exists()


def test_reverse_and_exact_match():
    assert verify("reverse", "  olleh\n", "olleh") == 1.0
    assert verify("reverse", "hello", "olleh") == 0.0
    assert verify("exact_match", " 42 ", 42) == 1.0
    assert verify("exact_match", "42.0", 42) == 0.0


@pytest.mark.parametrize("gold", ["0.5", "1/2", "\\frac{1}{2}", "$\\frac{1}{2}$"])
@pytest.mark.parametrize("response", ["The answer is 0.5", "so \\boxed{\\frac{1}{2}}", "$\\frac{2}{4}$"])
def test_math_equivalent_forms(gold, response):
    assert verify("math", response, gold) == 1.0


def test_math_wrong_and_symbolic():
    assert verify("math", "The answer is 0.6", "1/2") == 0.0
    assert verify("math", "\\boxed{2x}", "2x") == 1.0
    assert verify("math", "\\boxed{2}", "2x") == 0.0  # math-verify alone would read gold "2x" as 2
    assert verify("math", "no answer", "1/2") == 0.0


def test_math_runs_outside_the_main_thread():
    # math-verify's default signal.alarm timeouts raise in a non-main thread; ours are off.
    result = []
    thread = threading.Thread(target=lambda: result.append(verify("math", "\\boxed{3}", "3")))
    thread.start()
    thread.join()
    assert result == [1.0]


def test_unknown_verifier_lists_valid_names():
    with pytest.raises(TandemError, match="countdown.*exact_match.*math"):
        VERIFIERS.get("nope")


# --- user functions --------------------------------------------------------------------------


def test_verifier_and_auto_specs():
    assert load_reward_fn("addition")(sample("7").prompt, "7") == (1.0, {"strict": 1.0})
    auto = load_reward_fn("auto")
    assert auto(sample("x", "olleh", data_source="reverse").prompt, "olleh") == (1.0, {})
    with pytest.raises(TandemError, match="'gsm8k'.*addition, code, countdown"):
        auto(sample("x", data_source="gsm8k").prompt, "7")


def test_verl_convention():
    fn = load_reward_fn("reward_fns_example:verl_score")
    assert fn(sample("").prompt, "7") == (1.0, {})
    prompt = sample("", extra_info={"bonus": 1}).prompt
    assert load_reward_fn("reward_fns_example:verl_dict_score")(prompt, "7") == (1.5, {"acc": 1.0})
    with pytest.raises(TandemError, match="'score'"):
        load_reward_fn("reward_fns_example:verl_no_score")(prompt, "7")


def test_trl_convention_plain_and_chat():
    fn = load_reward_fn("reward_fns_example:trl_score")
    assert fn(sample("", columns={"weight": 0.25}).prompt, "7") == (1.25, {})
    chat = Prompt(messages=[{"role": "user", "content": "say hi"}], ground_truth="hi")
    assert load_reward_fn("reward_fns_example:trl_chat_score")(chat, "hi") == (1.0, {})
    with pytest.raises(TandemError, match="2 scores for 1"):
        load_reward_fn("reward_fns_example:trl_two_scores")(chat, "hi")


def test_file_path_spec():
    fn = load_reward_fn(f"{HELPERS}:verl_score")
    assert fn(sample("").prompt, "7") == (1.0, {})
    relative = os.path.relpath(HELPERS)
    assert canonical_spec(f"{relative}:verl_score") == f"{HELPERS}:verl_score"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "Unknown reward function 'nope'.*auto.*addition, code, countdown"),
        ("no_such_module_xyz:f", "Cannot import module 'no_such_module_xyz'"),
        ("reward_fns_example:missing", "no attribute 'missing'.*verl_score"),
        ("reward_fns_example:NOT_CALLABLE", "not callable"),
        ("reward_fns_example:wrong_signature", r"\(a, b\).*solution_str.*completions"),
        ("/no/such/file.py:f", "does not exist"),
    ],
)
def test_bad_specs_name_the_spec_and_the_valid_forms(spec, message):
    with pytest.raises(TandemError, match=message):
        load_reward_fn(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "addition",
        "auto",
        "reward_fns_example:verl_score",
        "reward_fns_example:trl_score",
        f"{HELPERS}:verl_score",
    ],
)
def test_every_reward_fn_keeps_the_protocol(spec):
    score, parts = load_reward_fn(spec)(sample("").prompt, "7")
    assert type(score) is float and score == 1.0
    assert isinstance(parts, dict) and all(type(v) is float for v in parts.values())


# --- the pool --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with RewardPool("reward_fns_example:verl_score", num_workers=2, timeout_s=1.0) as p:
        yield p


def test_pool_scores_in_place(pool):
    samples = [sample("7"), sample("8"), sample(" 7 ")]
    assert pool.score(samples) == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/output_bytes": 0.0}
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]


def test_pool_contains_raising_dying_and_nan_functions(pool, caplog):
    samples = [sample("RAISE"), sample("7"), sample("DIE"), sample("NAN"), sample("7")]
    for s in samples:
        s.reward = 9.0
    with caplog.at_level(logging.WARNING, logger="tandem.reward"):
        metrics = pool.score(samples)
    assert metrics == {"reward/errors": 3.0, "reward/timeouts": 0.0, "reward/output_bytes": 0.0}
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert "ValueError: boom" in caplog.text and "'addition'" in caplog.text and "'RAISE'" in caplog.text
    assert "died (exit code 3)" in caplog.text and "non-finite" in caplog.text
    assert pool.score([sample("7")])["reward/errors"] == 0.0  # the dead worker was replaced


def test_pool_kills_a_hanging_call_and_keeps_working(pool):
    samples = [sample("HANG"), sample("7"), sample("8")]
    start = time.monotonic()
    metrics = pool.score(samples)
    assert time.monotonic() - start < 5.0
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 1.0, "reward/output_bytes": 0.0}
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0]
    again = [sample("7") for _ in range(4)]
    assert pool.score(again) == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/output_bytes": 0.0}
    assert [s.reward for s in again] == [1.0] * 4


def test_a_score_or_part_beyond_the_bound_is_an_error_not_a_reward(pool, caplog):
    """1e300 is finite, yet one such reward makes every loss of its batch NaN."""
    samples = [sample("HUGE"), sample("7")]
    with caplog.at_level(logging.WARNING, logger="tandem.reward"):
        assert pool.score(samples)["reward/errors"] == 1.0
    assert [s.reward for s in samples] == [0.0, 1.0]
    assert "beyond +-1e+06 (reward.max_abs): a score, 1e+300" in caplog.text
    with RewardPool("reward_fns_example:verl_nan_part", num_workers=1) as p:
        s = sample("7")
        assert p.score([s])["reward/errors"] == 1.0
    assert (s.reward, s.reward_parts) == (0.0, {})


@pytest.mark.parametrize("what", ["HANG", "DIE"])
def test_a_function_that_stalls_most_of_a_batch_ends_the_call_in_two_waves(what):
    """40 samples, 2 workers, 1 s each: waiting every timeout out would take 20 s, and every worker
    death a replacement; the call ends after the first two waves, naming the function."""
    with RewardPool("reward_fns_example:verl_score", num_workers=2, timeout_s=1.0) as p:
        start = time.monotonic()
        with pytest.raises(TandemError, match=r"'reward_fns_example:verl_score' stalled on 4 of the first 4"):
            p.score([sample(what) for _ in range(40)])
        assert time.monotonic() - start < 8.0


def test_a_few_stalls_cost_only_their_samples(pool):
    samples = [sample("7"), sample("DIE"), sample("7"), sample("DIE"), sample("7"), sample("7")]
    assert pool.score(samples)["reward/errors"] == 2.0
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def test_what_a_function_prints_is_captured_per_call_and_counted(tmp_path, capfd, caplog):
    log = tmp_path / "reward_output.log"
    with RewardPool("reward_fns_example:verl_score", num_workers=2, output_log=log) as p:
        capfd.readouterr()
        with caplog.at_level(logging.WARNING, logger="tandem.reward"):
            metrics = p.score([sample("PRINT 7") for _ in range(6)] + [sample("7")])
    assert metrics["reward/output_bytes"] == 6 * (100_001 + 50_000)
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 10_000  # not 900 kB
    assert "printed 900006 bytes in 6 of 7 calls" in caplog.text and str(log) in caplog.text
    kept = log.read_text()
    assert kept.count("--- data source 'addition': 150001 bytes (first 2000 shown)") == 6
    assert len(kept) < 6 * 2200


def test_a_module_that_hangs_at_import_is_an_error_within_its_limit(tmp_path):
    module = tmp_path / "sleepy_reward.py"
    module.write_text(
        "import time\ntime.sleep(600)\ndef f(data_source, solution_str, ground_truth):\n    return 1.0\n"
    )
    start = time.monotonic()
    with pytest.raises(TandemError, match=r"did not finish within reward.import_timeout_s=1 s"):
        load_within(f"{module}:f", 1.0)
    assert time.monotonic() - start < 3.0


def test_pool_sets_reward_parts():
    with RewardPool("reward_fns_example:verl_dict_score", num_workers=1) as p:
        s = sample("7", extra_info={"bonus": 1})
        p.score([s])
    assert (s.reward, s.reward_parts) == (1.5, {"acc": 1.0})


def test_pool_auto_rejects_an_unknown_data_source_up_front():
    with RewardPool("auto", num_workers=1) as p:
        samples = [sample("7"), sample("olleh", "olleh", data_source="reverse")]
        assert p.score(samples)["reward/errors"] == 0.0
        assert [s.reward for s in samples] == [1.0, 1.0]
        with pytest.raises(TandemError, match="'mystery'"):
            p.score([sample("7"), sample("7", data_source="mystery")])


def test_pool_rejects_bad_arguments_at_startup():
    with pytest.raises(TandemError, match="Unknown reward function 'nope'"):
        RewardPool("nope")
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool("addition", num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool("addition", timeout_s=0)


def test_pool_score_after_close_is_an_error():
    p = RewardPool("addition", num_workers=1)
    p.close()
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.score([sample("7")])
