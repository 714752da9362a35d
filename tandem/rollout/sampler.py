"""Pick the next token from logits and return its logprob: pure functions, one decode step each.

The order follows vLLM: repetition penalty on the raw logits, then temperature, then min-p, top-k,
top-p. A token is drawn by inverting the cumulative distribution with one uniform number per row
(`uniform_draws`, `inverse_cdf`): a seeded row draws it from a generator of its own.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.sample import SamplingParams

_MASK64 = (1 << 64) - 1


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """logits (B, V), seen (B, V) bool -> (B, V). HF/vLLM rule on every seen token's logit x:
    x / penalty when x > 0, x * penalty when x < 0 (so penalty > 1 makes it less likely either way)."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def filter_min_p(logits: Tensor, min_p: float) -> Tensor:
    """logits (B, V) -> logits with -inf where p_i < min_p * max_j p_j, p = softmax(logits).
    The top token always stays, so a row never loses its whole support."""
    probs = torch.softmax(logits, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)  # (B, V)
    return logits.masked_fill(drop, float("-inf"))


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


def sampling_scores(logp: Tensor, params: SamplingParams) -> Tensor:
    """logp (B, V), log-probs at the sampling temperature -> (B, V) log-probs, up to a constant per
    row, of the distribution the token is drawn from: -inf outside what min-p, top-k, top-p keep.
    Greedy (temperature 0) keeps everything: filters that keep the top token cannot change argmax."""
    if params.temperature == 0:
        return logp
    if params.min_p > 0:
        logp = filter_min_p(logp, params.min_p)
    if params.top_k > 0 or params.top_p < 1.0:
        logp = filter_top_k_top_p(logp, params.top_k, params.top_p)
    return logp


def seen_tokens(ids: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """-> (B, V) bool: the tokens of each row's ids (its prompt and response so far)."""
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(x) for x in ids]))
    cols = torch.tensor([t for x in ids for t in x], dtype=torch.long)
    seen = torch.zeros(len(ids), vocab, dtype=torch.bool, device=device)
    seen[rows.to(device), cols.to(device)] = True
    return seen


def tempered_logprobs(logits: Tensor, params: SamplingParams, seen: Tensor | None = None) -> Tensor:
    """logits (B, V), seen (B, V) bool or None -> (B, V) log softmax(penalized logits / T), with
    T = 1 when greedy; no penalty when `seen` is None or repetition_penalty is 1."""
    logits = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return torch.log_softmax(tempered(logits, params.temperature), dim=-1)


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / T, T = 1 when greedy (0). At T = 1 no division runs: x / 1 is x exactly, and a decode
    step saves a (B, V) pass."""
    return logits if temperature in (0, 1) else logits / temperature


def processed_logprobs(logits: Tensor, params: SamplingParams, seen: Tensor | None = None) -> Tensor:
    """logits (B, V), seen (B, V) bool or None -> (B, V) normalized log-probs of the distribution
    actually sampled from: penalty, then / T, then the filters, renormalized over the kept tokens
    (-inf elsewhere). `logprobs_mode="processed"` returns its entry at the sampled token."""
    return torch.log_softmax(sampling_scores(tempered_logprobs(logits, params, seen), params), dim=-1)


def row_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (request seed, response position): splitmix64 of the pair, so
    neighbouring seeds and positions give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(seed: int, group_id: int, index: int) -> int:
    """A sample's sampling seed from (run.seed, group id, index in the group): each request draws
    its own noise, so its tokens do not depend on which worker or batch generates it."""
    return row_seed(row_seed(seed, group_id), index)


def uniform_draws(
    rows: int,
    device: torch.device,
    generator: torch.Generator | None,
    seeds: list[int | None] | None = None,
    positions: list[int] | None = None,
) -> Tensor:
    """-> (B,) i.i.d. U[0, 1) in float64, one per row, for `inverse_cdf`. Row i with seeds[i] set
    draws from a generator reseeded by row_seed(seeds[i], positions[i]), so its draw depends on
    nothing else in the batch (nor on how its response was split over calls); the other rows draw
    from `generator` in one go.

    One number a row, not one a vocabulary entry: Gumbel-max sampling's (B, V) exponential noise
    cost 63 ms a decode step at B = 64 with a 49k vocabulary (2 Zen 4 cores), the draws here 0."""
    draws = torch.empty(rows, device=device, dtype=torch.float64)
    if seeds is None or all(s is None for s in seeds):
        return draws.uniform_(generator=generator)
    if positions is None or len(positions) != len(seeds) or len(seeds) != rows:
        raise ValueError(f"{rows} rows need one seed and one position each")
    free = [i for i, s in enumerate(seeds) if s is None]
    if free:
        draws[free] = torch.empty(len(free), device=device, dtype=torch.float64).uniform_(generator=generator)
    own = torch.Generator(device=device)
    for i, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        if seed is not None:
            own.manual_seed(row_seed(seed, position))
            draws[i : i + 1].uniform_(generator=own)
    return draws


def inverse_cdf(scores: Tensor, draws: Tensor, block: int = 256) -> Tensor:
    """scores (B, V) log-probs up to a constant per row (-inf: never drawn), draws (B,) U[0, 1)
    -> tokens (B,): row b's first token whose cumulative probability exceeds draws[b], so token i
    comes with probability softmax(scores)_i (`draw_token` of those probabilities)."""
    return draw_token(torch.softmax(scores, dim=-1), draws, block)


def draw_token(probs: Tensor, draws: Tensor, block: int = 256) -> Tensor:
    """probs (B, V) probabilities up to a factor per row (0: never drawn), draws (B,) U[0, 1) ->
    tokens (B,): row b's first token whose cumulative mass exceeds draws[b] times the row's total.
    Row by row (every operation runs along each row alone), so a row's token depends on nothing
    else in the batch; the sums in float64, so the cumulative mass of a 49k vocabulary loses no
    token to rounding.

    In two levels, so the (B, V) probabilities are read once more, not copied: each `block`-token
    block's mass (summed in fp32, read in place), their float64 running sum finds the block the
    draw falls in, a float64 cumsum of that block alone, scaled to the block's mass, the token. A
    token's chance is then its probability times its block's fp32 mass over the block's exact one,
    1 within ~1e-7. At B = 64 over a 49k vocabulary, 2 Zen 4 cores: 7 ms a decode step, against 17
    with the block sums in float64 (a (B, V) float64 copy) and 22 with one cumsum over the row. A
    token of zero mass has its predecessor's running mass, so no draw lands on it."""
    rows, vocab = probs.shape
    pad = -vocab % block
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, block)
    mass = blocks.sum(-1)  # (B, V / block)
    ends = mass.double().cumsum_(-1)  # the running mass up to each block's end
    target = (draws.to(ends) * ends[:, -1])[:, None]
    b = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)  # (B, 1)
    start = torch.where(b > 0, ends.gather(-1, (b - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, b[:, :, None].expand(-1, 1, block)).squeeze(1).double().cumsum_(-1)
    inside = inside * (mass.gather(-1, b).double() / inside[:, -1:]).nan_to_num_(0.0) + start
    offset = torch.searchsorted(inside, target, right=True).clamp_(max=block - 1)
    tokens = (b * block + offset).squeeze(-1).clamp_(max=vocab - 1)
    # A draw that rounds up to the row's total mass would land past the last token with any:
    # take the row's likeliest then (a chance of ~1e-16).
    empty = probs.gather(-1, tokens[:, None]).squeeze(-1) == 0
    return torch.where(empty, probs.argmax(-1), tokens) if bool(empty.any()) else tokens


def sample_next(
    logits: Tensor, params: SamplingParams, draws: Tensor | None = None, seen: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """logits (B, V), draws (B,) U[0, 1) (`uniform_draws`; unused when greedy), seen (B, V) bool
    tokens already in each row's prompt + response (repetition penalty) -> tokens (B,), logprobs (B,) per
    `params.logprobs_mode`: "raw" log softmax(logits / T) (greedy: T = 1), or "processed"."""
    raw = torch.log_softmax(tempered(logits.float(), params.temperature), dim=-1)
    penalize = seen is not None and params.repetition_penalty != 1.0
    scores = sampling_scores(tempered_logprobs(logits, params, seen) if penalize else raw, params)
    if params.temperature == 0:
        tokens = scores.argmax(-1)
    elif draws is None:
        raise ValueError("sampling at temperature > 0 needs draws (uniform_draws)")
    elif scores is raw:  # normalised already: exp is its softmax, in one pass over (B, V) for three
        tokens = draw_token(raw.exp(), draws)
    else:
        tokens = inverse_cdf(scores, draws)
    if params.logprobs_mode == "raw":
        return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1)
    # Renormalized over the kept tokens: log_softmax(scores) at the token, without the (B, V) copy.
    return tokens, scores.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scores, dim=-1)
