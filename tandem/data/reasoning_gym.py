"""reasoning-gym datasets as synthetic tasks: `data.task=reasoning_gym:<dataset>` (docs/data.md).

A reasoning-gym dataset generates problems procedurally from a seed and scores answers itself
(`score_answer(answer, entry) -> float in [0, 1]`): a generator of rows plus a scorer, which is what
a synthetic task is. So it takes the `data.task` slot, with `data.task_config` as the dataset's
config, rather than a second key that would be another way to name a data source.

Each row carries what the scorer needs: the answer as its ground truth, and the dataset's name, the
arguments it was built with and the entry's question and metadata in `extra_info["reasoning_gym"]`.
The `reasoning_gym` verifier (tandem.reward.verifiers), which `reward.fn=auto` picks by the rows'
data_source, rebuilds the entry in a reward worker and calls that dataset's own `score_answer`.

reasoning_gym is imported only when a task or a row names it: tandem imports and runs without it.
"""

import dataclasses
import difflib
import functools
import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from tandem.errors import TandemError

PREFIX = "reasoning_gym:"  # data.task=reasoning_gym:<dataset>
DATA_SOURCE = "reasoning_gym"  # the rows' data_source: the verifier `reward.fn=auto` picks for them
# Config keys tandem sets itself: the split's seed (run.seed, run.seed + 1 for the held-out split)
# and how many entries it reads to fill the split.
RESERVED = ("seed", "size")
LIST_NAMES = "python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'"


def require() -> ModuleType:
    """The reasoning_gym module, or a TandemError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise TandemError(
            f"data.task={PREFIX}<dataset> needs the reasoning-gym package, which cannot be imported "
            f"({e}). Install it: pip install reasoning-gym"
        ) from None
    return reasoning_gym


def check(dataset: str, config: dict[str, Any]) -> None:
    """TandemError unless reasoning-gym has `dataset` and accepts `config` (data.task_config) for it."""
    for key in RESERVED:
        if key in config:
            raise TandemError(
                f"Config 'data.task_config' sets {key!r}, which tandem sets itself for a reasoning-gym "
                "dataset: the seed is run.seed for the training split and run.seed + 1 for the held-out "
                "split, the size is how many entries it reads to fill a split. Set run.seed, "
                "data.train_size or data.val_size instead."
            )
    create(dataset, {**config, "seed": 0, "size": 1})


def create(dataset: str, kwargs: dict[str, Any]) -> Any:
    """`reasoning_gym.create_dataset(dataset, **kwargs)`, with TandemErrors naming the dataset, the
    key or the value reasoning-gym refused."""
    rg = require()
    datasets = rg.factory.DATASETS
    if dataset not in datasets:
        close = difflib.get_close_matches(dataset, list(datasets), n=3)
        hint = f" Did you mean {', '.join(PREFIX + c for c in close)}?" if close else ""
        raise TandemError(
            f"Config 'data.task' is {PREFIX + dataset!r}, but reasoning-gym has no dataset {dataset!r}."
            f"{hint} It has {len(datasets)}; list them with: {LIST_NAMES}"
        )
    keys = [f.name for f in dataclasses.fields(datasets[dataset][1])]
    unknown = [k for k in kwargs if k not in keys]
    if unknown:
        own = ", ".join(k for k in keys if k not in RESERVED)
        raise TandemError(
            f"Config 'data.task_config' has the key {unknown[0]!r}, which reasoning-gym's dataset "
            f"{dataset!r} does not take. Its keys: {own}."
        )
    try:
        return rg.create_dataset(dataset, **kwargs)
    except (TypeError, ValueError, AssertionError, KeyError, IndexError) as e:
        shown = {k: v for k, v in kwargs.items() if k not in RESERVED}
        raise TandemError(
            f"reasoning-gym's dataset {dataset!r} refused data.task_config={shown} (with seed "
            f"{kwargs.get('seed')}, size {kwargs.get('size')}): {type(e).__name__}: {e}"
        ) from None


def entries(dataset: str, kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The dataset's entries 0..size-1 ({question, answer, metadata}), fewer when it runs out (some
    datasets end early with an IndexError)."""
    ds = create(dataset, kwargs)
    for index in range(kwargs["size"]):
        try:
            entry = ds[index]
        except IndexError:
            return
        yield entry


def to_row(dataset: str, kwargs: dict[str, Any], entry: dict[str, Any], split: str, index: int) -> dict:
    """One entry as a row in verl's columns, with what `score` needs to rebuild the entry."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": entry["question"]}],
        "reward_model": {"style": "rule", "ground_truth": entry["answer"]},
        "extra_info": {
            "split": split,
            "index": index,
            DATA_SOURCE: {
                "dataset": dataset,
                "config": kwargs,
                "question": entry["question"],
                "metadata": entry.get("metadata", {}),
            },
        },
    }


def score(solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """The row's dataset's own `score_answer(answer=solution_str, entry)`, a float in [0, 1], the
    entry rebuilt from the row: question and metadata from `extra_info["reasoning_gym"]`, answer =
    ground_truth. The dataset is built once per (name, arguments) in each process."""
    info = extra_info.get(DATA_SOURCE) if isinstance(extra_info, dict) else None
    needed = ("dataset", "config", "question", "metadata")
    if not isinstance(info, dict) or any(k not in info for k in needed):
        raise TandemError(
            f"The reasoning_gym verifier needs extra_info[{DATA_SOURCE!r}] with the keys "
            f"{', '.join(needed)}, as the rows of data.task={PREFIX}<dataset> have; this row's "
            f"extra_info has {sorted(extra_info) if isinstance(extra_info, dict) else extra_info!r}."
        )
    ds = _dataset(info["dataset"], json.dumps(info["config"], sort_keys=True))
    entry = {"question": info["question"], "answer": ground_truth, "metadata": info["metadata"]}
    return float(ds.score_answer(answer=solution_str, entry=entry))


@functools.cache
def _dataset(dataset: str, kwargs_json: str) -> Any:
    """Built once per process: the scorer of every row of one split shares it."""
    return create(dataset, json.loads(kwargs_json))
