"""Decoder shapes the simulator knows by name (`sim.model`), from their Hugging Face config.json."""

import dataclasses

from tandem.errors import TandemError
from tandem.model.config import ModelConfig


def _shape(
    hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int, vocab: int, tied: bool
) -> ModelConfig:
    """A dense decoder: hidden, intermediate, layers, heads, key/value heads, head dim, vocab, tied
    embeddings."""
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )


def _moe(dense: ModelConfig, experts: int, per_token: int, inter: int) -> ModelConfig:
    """`dense` with every layer's MLP a mixture of `experts` experts `inter` wide, `per_token` used."""
    return dataclasses.replace(
        dense, num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=inter
    )


MODELS = {
    "qwen2.5-0.5b": _shape(896, 4864, 24, 14, 2, 64, 151936, True),
    "qwen2.5-1.5b": _shape(1536, 8960, 28, 12, 2, 128, 151936, True),
    "qwen2.5-7b": _shape(3584, 18944, 28, 28, 4, 128, 152064, False),  # also Qwen2.5-Math-7B
    "qwen2.5-32b": _shape(5120, 27648, 64, 40, 8, 128, 152064, False),
    "llama-3.1-8b": _shape(4096, 14336, 32, 32, 8, 128, 128256, False),
    # Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B's config.json (transformers 4.51): head_dim 128 is not
    # hidden / heads; the MoE's intermediate_size (6144) sizes no layer, all 48 being sparse
    "qwen3-8b": _shape(4096, 12288, 36, 32, 8, 128, 151936, False),
    "qwen3-30b-a3b": _moe(_shape(2048, 6144, 48, 32, 4, 128, 151936, False), 128, 8, 768),
    # Qwen/Qwen3-32B and Qwen/Qwen3-235B-A22B's config.json (94 layers, all sparse)
    "qwen3-32b": _shape(5120, 25600, 64, 64, 8, 128, 151936, False),
    "qwen3-235b-a22b": _moe(_shape(4096, 12288, 94, 64, 4, 128, 151936, False), 128, 8, 1536),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B's config.json (Qwen2.5-Math-1.5B, embeddings untied);
    # its 7B sibling has qwen2.5-7b's shape
    "r1-distill-qwen-1.5b": _shape(1536, 8960, 28, 12, 2, 128, 151936, False),
}


def model_config(name: str) -> ModelConfig:
    if name not in MODELS:
        raise TandemError(
            f"Config 'sim.model' is {name!r}, not a shape the simulator knows. Valid names: "
            f"{', '.join(MODELS)} (or leave it empty to read model.path's config.json)."
        )
    return dataclasses.replace(MODELS[name])
