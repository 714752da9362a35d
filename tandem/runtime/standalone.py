"""Evaluation and generation without training, in one process: `tandem eval` and `tandem generate`.

Held-out evaluation is greedy (by default) responses to validation prompts, scored by the reward.
Both serve model.path as it is: a full checkpoint, a LoRA run's step directory (the adapter beside
the weights folded in) or a PEFT adapter directory on the base it names (`checkpoint_dir`); a
recipe's train.lora, which trains a new adapter, plays no part."""

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.config import Config
from tandem.config.sampling import sampling_params
from tandem.controller.stats import val_stats
from tandem.model.export import checkpoint_dir
from tandem.reward import RewardPool
from tandem.rollout.group import make_groups
from tandem.rollout.worker import RolloutWorker
from tandem.runtime.roles import build_rollout, load_split
from tandem.runtime.startup import here, resolve_inputs
from tandem.sample import Prompt, Sample, SamplingParams, episodes


def evaluate(
    rollout: RolloutWorker,
    reward: RewardPool,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    params: SamplingParams,
) -> tuple[dict[str, float], list[Sample]]:
    """-> ({"val/accuracy", "val/score/mean", ...}: `val_stats`, the scored
    samples), one response per prompt."""
    samples = episodes(rollout.generate(make_groups(prompts, prompt_ids, n=1), params))
    return val_stats(samples, reward.score(samples), float(rollout.version)), samples


@contextmanager
def serving(cfg: Config) -> Iterator[Config]:
    """`cfg` as eval and generate run it: model.path a directory tandem loads, no adapter to train."""
    with checkpoint_dir(cfg.model.path, "model.path") as path:
        train = dataclasses.replace(cfg.train, lora=dataclasses.replace(cfg.train.lora, rank=0))
        yield dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)), train=train)


def evaluate_checkpoint(cfg: Config, show: int = 0) -> dict[str, float]:
    with serving(resolve_inputs(cfg, check_tokenizer=False)) as cfg:
        return _evaluate(here(cfg), show)


def _evaluate(cfg: Config, show: int) -> dict[str, float]:
    rollout, limit = build_rollout(cfg)
    prompts, source = load_split(cfg, cfg.data.val_files, "test", cfg.data.val_size, cfg.run.seed + 1)
    ids = limit.encode(rollout.tokenizer, prompts, source)
    with RewardPool.from_config(cfg.reward) as reward:
        params = sampling_params(cfg, cfg.rollout.val_temperature)
        metrics, samples = evaluate(rollout, reward, prompts, ids, params)
    for s in samples[:show]:
        print(f"{s.prompt.messages or s.prompt.text!r} -> {s.response_text!r} (reward {s.reward})")
    return {**metrics, "val/size": float(len(samples))}


def generate_text(cfg: Config, text: str, chat: bool = True) -> list[str]:
    with serving(resolve_inputs(cfg, check_tokenizer=False)) as cfg:
        rollout, limit = build_rollout(here(cfg))
        prompt = Prompt(messages=[{"role": "user", "content": text}]) if chat else Prompt(text=text)
        ids = limit.encode(rollout.tokenizer, [prompt], "the command line")
        samples = rollout.generate(
            make_groups([prompt], ids, cfg.rollout.n), sampling_params(cfg, cfg.rollout.temperature)
        )
    return [s.response_text for s in episodes(samples)]
