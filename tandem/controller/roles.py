"""Build the roles of a run from its config: data, rollout worker, train worker, reward pool.

Every check of user input (files, names, prompt lengths) happens here, before any training, so a
mistake fails in seconds with a clear message.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import Config
from tandem.data import encode_prompts, load_prompts, load_tokenizer, prompts_from_rows
from tandem.data.loader import PromptLoader
from tandem.data.tasks import TASKS
from tandem.errors import TandemError
from tandem.model import load_model, resolve_model_path
from tandem.reward import RewardPool
from tandem.rollout import BuiltinEngine, RolloutWorker, SamplingParams
from tandem.sample import Prompt
from tandem.train import TrainWorker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Roles:
    rollout: RolloutWorker
    trainer: TrainWorker
    reward: RewardPool
    train_data: PromptLoader
    val_prompts: list[Prompt]
    val_ids: list[list[int]]
    params: SamplingParams
    val_params: SamplingParams

    def close(self) -> None:
        self.reward.close()


def load_split(cfg: Config, files: list[str], split: str, size: int, seed: int) -> tuple[list[Prompt], str]:
    """Prompts from files, or rows of the synthetic task when no file is given."""
    if files:
        return [p for f in files for p in load_prompts(f, cfg.data.prompt_key)], ", ".join(files)
    rows = TASKS.get(cfg.data.task)().make_rows(size, seed=seed, split=split)
    return prompts_from_rows(rows), f"synthetic task {cfg.data.task!r} ({split})"


def sampling_params(cfg: Config, temperature: float) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=list(r.stop_token_ids),
    )


@dataclass
class PromptLimit:
    """The longest prompt allowed, and why: data.max_prompt_length or the model's context."""

    tokens: int
    reason: str = ""

    def encode(self, tokenizer, prompts: list[Prompt], source: str) -> list[list[int]]:
        return encode_prompts(tokenizer, prompts, self.tokens, source=source, limit_reason=self.reason)


def build_rollout(cfg: Config) -> tuple[RolloutWorker, PromptLimit]:
    """The rollout worker for cfg.model, and the longest prompt its context leaves room for."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_path)
    if tokenizer.eos_token_id is None:
        raise TandemError(
            f"The tokenizer of {cfg.model.path} has no EOS token, so responses could never end."
        )
    model = load_model(model_path, dtype=DTYPES[cfg.model.dtype])
    context = model.cfg.max_position_embeddings
    room = context - cfg.rollout.max_new_tokens
    if room < 1:
        raise TandemError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt "
            f"in the model's context of {context} tokens."
        )
    limit = PromptLimit(cfg.data.max_prompt_length)
    if room < cfg.data.max_prompt_length:
        limit = PromptLimit(
            room,
            f"the model's context of {context} tokens less rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} (lower rollout.max_new_tokens or use a longer-context model)",
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = BuiltinEngine(
        model, [tokenizer.eos_token_id], pad, max_batch_size=cfg.rollout.max_batch_size, seed=cfg.run.seed
    )
    return RolloutWorker(engine, tokenizer), limit


def build_roles(cfg: Config) -> Roles:
    rollout, limit = build_rollout(cfg)
    tokenizer = rollout.tokenizer
    d = cfg.data
    train_prompts, train_src = load_split(cfg, d.train_files, "train", d.train_size, cfg.run.seed)
    train_ids = limit.encode(tokenizer, train_prompts, train_src)
    val_prompts, val_ids = [], []
    if d.val_files or not d.train_files:  # own training data and no val files: no validation
        val_prompts, val_src = load_split(cfg, d.val_files, "test", d.val_size, cfg.run.seed + 1)
        val_ids = limit.encode(tokenizer, val_prompts, val_src)
    reward = RewardPool(cfg.reward.fn, cfg.reward.num_workers, cfg.reward.timeout_s)
    policy = load_model(resolve_model_path(cfg.model.path), dtype=DTYPES[cfg.model.dtype])
    mini = cfg.train.mini_batch_size or cfg.rollout.batch_size * cfg.rollout.n
    updates_per_step = cfg.train.epochs * -(-cfg.rollout.batch_size * cfg.rollout.n // mini)
    trainer = TrainWorker(
        policy,
        cfg.algo,
        cfg.train,
        rollout.engine.pad_token_id,
        temperature=cfg.rollout.temperature,
        total_updates=cfg.run.steps * updates_per_step,
        seed=cfg.run.seed,
        norm_len=cfg.rollout.max_new_tokens,
    )
    return Roles(
        rollout=rollout,
        trainer=trainer,
        reward=reward,
        train_data=PromptLoader(
            train_prompts, train_ids, cfg.rollout.batch_size, cfg.data.shuffle, cfg.run.seed
        ),
        val_prompts=val_prompts,
        val_ids=val_ids,
        params=sampling_params(cfg, cfg.rollout.temperature),
        val_params=sampling_params(cfg, cfg.rollout.val_temperature),
    )


def save_checkpoint(roles: Roles, path: Path) -> None:
    """A Hugging Face checkpoint directory: model and tokenizer, loadable by transformers."""
    from tandem.model import save_model

    save_model(roles.trainer.model, path)
    roles.rollout.tokenizer.save_pretrained(str(path))
