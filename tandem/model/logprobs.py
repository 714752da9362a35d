"""Per-token logprobs of given tokens, computed the same way by the engine and the trainer."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tandem.model import batch_invariant as bi

# Logits elements scored at once (128 MB in fp32): with a 152k vocabulary, chunks of ~220 tokens,
# so the (tokens x vocab) fp32 logits of a long batch never exist whole.
CHUNK_ELEMENTS = 1 << 25
DOT_ROWS = 16  # `row_dots`' rows a call: a (16, 49152) fp32 product is 3 MB, from the heap


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
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    batch_invariant: bool = False,
    delta: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """hidden (N, E), lm_head weight (V, E), tokens (N,) -> logp (N,), entropy (N,), both fp32.

    logits = hidden @ weight.T in the compute dtype, then log_softmax(logits / T) in fp32, in chunks
    of CHUNK_ELEMENTS // V tokens. With gradients on, each chunk is checkpointed: backward
    recomputes its logits, so no more than one chunk's fp32 logits are alive at any time.
    batch_invariant: the logits matmul as `tandem.model.batch_invariant.linear` (the decoder's mode).
    delta: hidden -> what a LoRA adapter on the head adds to the logits (`CausalLM._head_delta`).
    """
    size = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if hidden.shape[0] <= size:
        return _score_chunk(hidden, weight, tokens, temperature, batch_invariant, delta)
    parts = []
    for h, t in zip(hidden.split(size), tokens.split(size), strict=True):
        if torch.is_grad_enabled():
            parts.append(
                checkpoint(
                    _score_chunk, h, weight, t, temperature, batch_invariant, delta, use_reentrant=False
                )
            )
        else:
            parts.append(_score_chunk(h, weight, t, temperature, batch_invariant, delta))
    logp, entropy = zip(*parts, strict=True)
    return torch.cat(logp), torch.cat(entropy)


def _score_chunk(
    h: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float,
    batch_invariant: bool = False,
    delta: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(logp, entropy) of one chunk: its logits in the compute dtype, then `TokenScores`."""
    logits = bi.linear(h, weight) if batch_invariant else F.linear(h, weight)
    if delta is not None:
        logits = logits + delta(h)
    return TokenScores.apply(logits, tokens, temperature, batch_invariant)


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """a, b (n, V) -> (n,): each row's sum of a · b, in calls of DOT_ROWS rows (the last padded with
    zeros), so that a row's sum is reduced the same way whatever n is: batch-invariant. The product
    lives in one small buffer, not in a third (n, V) tensor mapped and zero-filled afresh."""
    n, width = a.shape
    out = a.new_empty(n)
    product = a.new_empty(DOT_ROWS, width)
    for start in range(0, n, DOT_ROWS):
        rows = min(DOT_ROWS, n - start)
        if rows < DOT_ROWS:
            product.zero_()
        torch.mul(a[start : start + rows], b[start : start + rows], out=product[:rows])
        out[start : start + rows] = product.sum(-1)[:rows]
    return out


class TokenScores(torch.autograd.Function):
    """logits (n, V), tokens (n,) -> logp (n,) = log_softmax(logits.float() / T)[token] and the
    tempered distribution's entropy H = -sum p log p (n,), both fp32, with a backward of its own.

    logp is `token_logprobs`'s value bit for bit (the same three kernels: the engine's logprobs in
    the batch-invariant mode), and so is the gradient of a loss of logp alone (the same kernels
    again). Autograd's graph of these steps allocated (and faulted in) about ten (n, V) fp32
    tensors a chunk, with a pass over each: a cast, a division, the gather's zeros and scatter,
    log_softmax's backward, the entropy's product and its backward. Here forward writes two (exp
    of log p over the tempered logits' buffer) and backward two (log_softmax's gradient, its bf16
    copy); an entropy in the loss adds d H / d z_j = -p_j (log p_j + H), z = logits / T.
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
            entropy = -row_dots(p, logp_all)
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
        g_logp = torch.zeros_like(entropy) if g_logp is None else g_logp
        # The gathered logp's gradient through log_softmax's own backward kernel: the bits autograd's
        # graph gave, so a run trains as before. p's buffer holds the one-hot unless H needs p.
        one_hot = p.zero_() if g_entropy is None else torch.zeros_like(p)
        one_hot.scatter_(-1, tokens[:, None], g_logp[:, None])
        grad = torch._log_softmax_backward_data(one_hot, logp_all, -1, torch.float32)
        if g_entropy is not None:  # d H / d z_j = -p_j (log p_j + H)
            grad.sub_(logp_all.add_(entropy[:, None]).mul_(p).mul_(g_entropy[:, None]))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None
