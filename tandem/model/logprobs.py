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
    """(logp, entropy) of one chunk: its logits in the compute dtype, then `TokenScores`."""
    logits = bi.linear(h, weight) if batch_invariant else F.linear(h, weight)
    return TokenScores.apply(logits, tokens, temperature, batch_invariant)


class TokenScores(torch.autograd.Function):
    """logits (n, V), tokens (n,) -> logp (n,) = log_softmax(logits.float() / T)[token] and the
    tempered distribution's entropy H = -sum p log p (n,), both fp32, with a backward of its own.

    logp is `token_logprobs`'s value bit for bit (the same three kernels: the engine's logprobs in
    the batch-invariant mode). Autograd's graph of these steps allocated (and faulted in) about ten
    (n, V) fp32 tensors a chunk, with a pass over each: a cast, a division, the gather's zeros and
    scatter, log_softmax's backward, the entropy's product and its backward. Here forward writes
    two, exp(log p) over the tempered logits' buffer, and backward one (the bf16 gradient):

        d logp / d z_j = [j = token] - p_j,  d H / d z_j = -p_j (log p_j + H),  z = logits / T.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, batch_invariant: bool):
        z = logits.to(torch.float32, copy=True)  # a buffer of its own, fp32 logits too
        if temperature != 1.0:
            z.div_(temperature)  # the same kernel and values as `logits.float() / temperature`
        logp_all = torch.log_softmax(z, dim=-1)
        logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1).clone()  # not a view: FSDP2 hooks outputs
        p = torch.exp(logp_all, out=z)
        if batch_invariant:  # each row reduced on its own, whatever the rows beside it
            entropy = -(p * logp_all).sum(-1)
        else:  # one dot product a row, without a third (n, V) tensor
            entropy = -torch.bmm(p[:, None, :], logp_all[:, :, None]).view(-1)
        ctx.save_for_backward(p, logp_all, tokens, entropy)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        p, logp_all, tokens, entropy = ctx.saved_tensors
        t = ctx.temperature
        g_logp = torch.zeros_like(entropy) if g_logp is None else g_logp
        if g_entropy is None:  # the usual case: the entropy a metric only
            grad = p.mul_((-g_logp / t)[:, None])  # p in place: once_differentiable, backward runs once
        else:
            weight = (logp_all + entropy[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None])
            grad = weight.mul_(p).mul_(-1 / t)
        grad.scatter_add_(-1, tokens[:, None], (g_logp / t)[:, None])
        return grad.to(ctx.dtype), None, None, None
