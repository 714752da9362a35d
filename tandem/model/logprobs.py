"""Per-token logprobs of given tokens, computed the same way by the engine and the trainer."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tandem.model import batch_invariant as bi

# Logits elements scored at once (128 MB in fp32): with a 152k vocabulary, chunks of ~220 tokens,
# so the (tokens x vocab) fp32 logits of a long batch never exist whole.
CHUNK_ELEMENTS = 1 << 25


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """logits (..., V), tokens (...) -> log softmax(logits / temperature)[token] (...)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@dataclass
class Targets:
    """The tokens a forward scores: the logits at flat position index[i] (of the B·T positions)
    predict tokens[i]. Passed to `CausalLM.forward`, which then returns (logp, entropy) (N,) each."""

    index: Tensor  # (N,) long
    tokens: Tensor  # (N,) long
    temperature: float = 1.0


def score_tokens(
    hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float = 1.0, batch_invariant: bool = False
) -> tuple[Tensor, Tensor]:
    """hidden (N, E), lm_head weight (V, E), tokens (N,) -> logp (N,), entropy (N,), both fp32.

    logits = hidden @ weight.T in the compute dtype, then log_softmax(logits / T) in fp32, in chunks
    of CHUNK_ELEMENTS // V tokens. With gradients on, each chunk is checkpointed: backward
    recomputes its logits, so no more than one chunk's fp32 logits are alive at any time.
    batch_invariant: the logits matmul as `tandem.model.batch_invariant.linear` (the decoder's mode).
    """
    size = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if hidden.shape[0] <= size:
        return _score_chunk(hidden, weight, tokens, temperature, batch_invariant)
    parts = []
    for h, t in zip(hidden.split(size), tokens.split(size), strict=True):
        if torch.is_grad_enabled():
            parts.append(
                checkpoint(_score_chunk, h, weight, t, temperature, batch_invariant, use_reentrant=False)
            )
        else:
            parts.append(_score_chunk(h, weight, t, temperature, batch_invariant))
    logp, entropy = zip(*parts, strict=True)
    return torch.cat(logp), torch.cat(entropy)


def _score_chunk(
    h: Tensor, weight: Tensor, tokens: Tensor, temperature: float, batch_invariant: bool = False
) -> tuple[Tensor, Tensor]:
    """H = -sum p log p of the tempered distribution, the same as algo.entropy_from_logits."""
    logits = bi.linear(h, weight) if batch_invariant else F.linear(h, weight)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (n, V)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1).clone()  # not a view: FSDP2 hooks outputs
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
