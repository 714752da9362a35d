"""Pick the next token from logits: temperature, top-k, top-p; return its logprob."""

import torch
from torch import Tensor


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """logits (B, V) -> logits with everything outside the top-k / top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """logits (B, V) -> tokens (B,), logprobs (B,).

    The logprob is log softmax(logits / T) at the chosen token — the same quantity the trainer
    recomputes (greedy uses T = 1) — so behaviour and recomputed logprobs are comparable.
    """
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logp.argmax(-1)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        scores = filter_top_k_top_p(logp, top_k, top_p) if top_k > 0 or top_p < 1.0 else logp
        # Gumbel-max: argmax_i(log p_i - log E_i) with E_i ~ Exp(1) draws i with probability p_i.
        noise = torch.empty_like(scores).exponential_(generator=generator).log_()
        tokens = (scores - noise).argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
