"""User reward functions for tests/test_reward.py, in verl's and TRL's conventions."""

import os
import time


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention, returning a float; misbehaves on purpose when the response says so."""
    if "RAISE" in solution_str:
        raise ValueError("boom from a user reward function")
    if "HANG" in solution_str:
        time.sleep(60)
    if "DIE" in solution_str:
        os._exit(3)
    if "NAN" in solution_str:
        return float("nan")
    if "HUGE" in solution_str:
        return 1e300
    if "PRINT" in solution_str:  # Python's stdout and the process's stderr, as C code would write
        print("p" * 100_000)
        os.write(2, b"e" * 50_000)
    return float(solution_str.strip() == str(ground_truth))


def verl_dict_score(data_source, solution_str, ground_truth, extra_info):
    """verl's convention, returning a dict with "score" and parts (a non-number part is dropped)."""
    correct = float(solution_str.strip() == str(ground_truth))
    return {"score": correct + 0.5 * extra_info.get("bonus", 0), "acc": correct, "pred": solution_str}


def verl_nan_part(data_source, solution_str, ground_truth, extra_info):
    return {"score": 1.0, "format": float("nan")}


def verl_no_score(data_source, solution_str, ground_truth, extra_info):
    return {"acc": 1.0}


def trl_score(prompts, completions, ground_truth, **kwargs):
    """TRL's convention: one float per completion; plain-text prompts and completions."""
    assert isinstance(prompts[0], str) and isinstance(completions[0], str)
    weight = kwargs.get("weight", [0.0])[0]
    return [float(c.strip() == str(g)) + weight for c, g in zip(completions, ground_truth, strict=True)]


def trl_chat_score(prompts, completions, **kwargs):
    """TRL's convention with conversational prompts: completions are lists of messages."""
    assert prompts[0][-1]["role"] == "user"
    return [float(c[0]["role"] == "assistant" and c[0]["content"] == "hi") for c in completions]


def trl_two_scores(prompts, completions, **kwargs):
    return [1.0, 0.0]


def wrong_signature(a, b):
    return 1.0


NOT_CALLABLE = 3
