"""Small builders shared by tests: a tiny random model and samples with made-up responses."""

import random

import torch

from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, init_weights
from tandem.sample import Prompt, Sample, Status

VOCAB = 50


def tiny_config(vocab_size: int = VOCAB, max_positions: int = 64, **ids) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_positions,
        **ids,
    )


def tiny_model(seed: int = 0, std: float = 0.1) -> CausalLM:
    model = CausalLM(tiny_config())
    init_weights(model, seed, std=std)
    return model


def random_samples(n_groups: int, group_size: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        prompt_ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 7))]
        for i in range(group_size):
            n = rng.randint(1, 9)
            samples.append(
                Sample(
                    prompt=Prompt(text="x"),
                    prompt_ids=prompt_ids,
                    group_id=g,
                    index=i,
                    response_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
                    logprobs=[-rng.random() for _ in range(n)],
                    versions=[0] * n,
                    loss_mask=[1] * n,
                    reward=float(rng.random() < 0.5),
                    status=Status.FINISHED,
                    finish_reason="stop",
                )
            )
    return samples


def clone_model(model: CausalLM) -> CausalLM:
    twin = CausalLM(model.cfg)
    twin.load_state_dict(model.state_dict())
    return twin


def grads(model: CausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def write_tiny_checkpoint(path, max_positions: int = 64, seed: int = 0):
    """A tiny random Qwen2-shaped checkpoint with tandem's byte-level tokenizer, as `tandem sft` writes."""
    from tandem.data import build_char_tokenizer
    from tandem.model.checkpoint import save_model

    tokenizer = build_char_tokenizer()
    cfg = tiny_config(
        len(tokenizer),
        max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = CausalLM(cfg)
    init_weights(model, seed)
    save_model(model, path)
    tokenizer.save_pretrained(str(path))
    return path
