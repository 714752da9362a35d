"""Supervised warm start: teach a fresh (or given) model a task's response format from its generator.

`sft.flawed_fraction` replaces that share of the demonstrations with the task's flawed solution
(for addition: every carry dropped). The result is a policy that knows the format and is right
only some of the time — a weak base model for RL to improve, made here rather than downloaded.
"""

import random
import time
from pathlib import Path

import torch

from tandem.agent import build_agent
from tandem.config import Config
from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import build_task
from tandem.data.template import encode_prompts
from tandem.data.tokenizer import build_char_tokenizer, load_tokenizer
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model, save_model
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.model.decoder import CausalLM, init_weights
from tandem.paths import check_writable
from tandem.sample import Sample
from tandem.train.batch import packed, pad_rows, padded, score
from tandem.train.optim import lr_factor


def fresh_model(cfg: Config, tokenizer) -> CausalLM:
    """A new model of the sft section's shape, read as a config.json is (the family's switches:
    qwen2's q/k/v bias, qwen3_moe's q/k norm and experts)."""
    s = cfg.sft
    hf = dict(
        model_type=s.model_type,
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.hidden_size // s.num_attention_heads,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if s.model_type == "qwen3_moe":
        hf.update(
            num_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            moe_intermediate_size=s.moe_intermediate_size,
            norm_topk_prob=True,
        )
    model = CausalLM(ModelConfig.from_hf(hf, source="the sft section"))
    init_weights(model, cfg.run.seed)
    return model


def demonstrations(cfg: Config, tokenizer, n: int) -> list[Sample]:
    """Prompt + response samples from the task generator; response ends with EOS."""
    task = build_task(cfg.data.task, cfg.data.task_config)
    rows = task.make_rows(n, seed=cfg.run.seed, split="train")
    prompts = prompts_from_rows(rows)
    ids = encode_prompts(tokenizer, prompts, cfg.data.max_prompt_length, source=f"task {task.name}")
    rng = random.Random(cfg.run.seed)
    # The run's agent splits a transcript into tokens as its rollouts do: a tool's output is
    # context (loss mask 0) here as in RL (single_turn: every token is trained on).
    r = cfg.rollout
    agent = build_agent(r.agent, tokenizer, r.tools, r.max_turns)
    samples = []
    for row, prompt, prompt_ids in zip(rows, prompts, ids, strict=True):
        flawed = rng.random() < cfg.sft.flawed_fraction
        text = task.flawed_solution(row, rng) if flawed else task.solution(row)
        response, mask = agent.demonstration(text)
        samples.append(
            Sample(
                prompt=prompt,
                prompt_ids=agent.prompt_ids(prompt, prompt_ids),
                response_ids=response + [tokenizer.eos_token_id],
                loss_mask=mask + [1],
            )
        )
    return samples


def rows(batch: list[Sample], pad_token_id: int | None):
    """Padded rows, one per demonstration: a task's demonstrations are of similar lengths, and on a
    CPU a packed row's attention over the whole batch costs more than the padding (32 addition
    demonstrations: 0.29 s a step padded, 0.47 s packed; 128: 1.2 s vs 3.7 s). Packed without a pad token."""
    return packed(batch) if pad_token_id is None else padded(batch, pad_token_id)


def run_sft(cfg: Config) -> Path:
    """Train with cross-entropy on response tokens; save model + tokenizer to cfg.sft.out."""
    s = cfg.sft
    if s.batch_size > cfg.data.train_size:
        raise TandemError(
            f"Config 'sft.batch_size' must be at most data.train_size={cfg.data.train_size} (the "
            f"demonstrations it samples from), got {s.batch_size}."
        )
    check_writable(Path(s.out), "sft.out")  # now, not after the training it is to keep
    torch.manual_seed(cfg.run.seed)
    if s.init_from:
        path = resolve_model_path(s.init_from)
        model, tokenizer = load_model(path), load_tokenizer(path)  # the model's error names the path
    else:
        tokenizer = build_char_tokenizer()
        model = fresh_model(cfg, tokenizer)
    data = demonstrations(cfg, tokenizer, cfg.data.train_size)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    rng = random.Random(cfg.run.seed)
    model.train()
    start = time.perf_counter()
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = s.lr * lr_factor(step, s.warmup_steps, s.steps, "cosine", 0.05)
        batch = rng.sample(data, s.batch_size)
        width = max(len(x.response_ids) for x in batch)
        logp, _ = score(model, rows(batch, tokenizer.pad_token_id), width)  # (b, R)
        mask = pad_rows([x.loss_mask for x in batch], width)  # (b, R): 0 on tool outputs
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == s.steps - 1:
            print(
                f"sft step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - start:6.1f}s", flush=True
            )
    out = Path(s.out)
    save_model(model, out)
    tokenizer.save_pretrained(str(out))
    return out
