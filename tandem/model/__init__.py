"""One decoder (Llama / Qwen2 / Qwen3) for engine and trainer, with Hugging Face checkpoint I/O."""

from tandem.model.checkpoint import load_model, resolve_model_path, save_model
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, fuse_projections, init_weights
from tandem.model.kv_cache import KVCache
from tandem.model.logprobs import Targets, score_tokens, token_logprobs
from tandem.model.segments import Segments

__all__ = [
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "Segments",
    "Targets",
    "fuse_projections",
    "init_weights",
    "load_model",
    "resolve_model_path",
    "save_model",
    "score_tokens",
    "token_logprobs",
]
