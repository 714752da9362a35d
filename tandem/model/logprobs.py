"""Per-token logprobs of given tokens, computed the same way by the engine and the trainer."""

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """logits (..., V), tokens (...) -> log softmax(logits / temperature)[token] (...)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
