"""Decoder shapes the simulator knows by name (`sim.model`), from their Hugging Face config.json."""

from tandem.errors import TandemError
from tandem.model.config import ModelConfig

# name -> (hidden, intermediate, layers, heads, key/value heads, vocab, tied embeddings)
MODELS = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),  # also Qwen2.5-Math-7B
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False),
}


def model_config(name: str) -> ModelConfig:
    if name not in MODELS:
        raise TandemError(
            f"Config 'sim.model' is {name!r}, not a shape the simulator knows. Valid names: "
            f"{', '.join(MODELS)} (or leave it empty to read model.path's config.json)."
        )
    hidden, inter, layers, heads, kv, vocab, tied = MODELS[name]
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
