"""Turn Samples into model inputs (packed or padded), score them, split batches over ranks and
micro-batches by a token budget."""

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.model.experts import Routing, agreement
from tandem.model.experts import routing as routing_context
from tandem.model.logprobs import Targets
from tandem.model.segments import Segments
from tandem.sample import Sample


@dataclass
class Rows:
    """A micro-batch as the model takes it, and where each scored token goes in a (b, R) table."""

    ids: Tensor  # (b, T) padded, or (1, total) packed
    positions: Tensor  # like ids
    mask: Tensor | Segments  # (b, T) bool real tokens, or the packed row's segments
    targets: Targets  # the response tokens and the flat positions whose logits predict them
    size: int  # samples in the micro-batch (one row each of the (b, R) table, a response or not)
    row: Tensor  # (N,) the sample each target belongs to
    col: Tensor  # (N,) its index in that sample's response
    # Routing replay: the engine's experts of every token of `ids`, flattened, (tokens, L, k), -1
    # for padding and the unrecorded; None when the samples carry no routing.
    routing: Tensor | None = None
    agreement: float | None = None  # set by `score`: the share of top-k sets the router agreed on


def packed(
    samples: list[Sample], device: torch.device | str = "cpu", temperature: float = 1.0, share: bool = False
) -> Rows:
    """Prompt + response of every sample back to back in one (1, total) row, no padding. share:
    neighbours with the same prompt lay it once, followed by their responses (`Segments.shared`),
    unless the samples carry routing (the engine's experts of each sample's own prompt tokens)."""
    routing = None
    if all(s.routing is not None for s in samples):
        routing = torch.cat([_routing_of(s) for s in samples])
        share = False
    units = prompt_units(samples) if share else [[i] for i in range(len(samples))]
    segments = Segments.shared(
        [(len(samples[u[0]].prompt_ids), [len(samples[i].response_ids) for i in u]) for u in units]
    )
    ids, index = [], []
    for unit in units:
        prompt = samples[unit[0]].prompt_ids
        last = len(ids) + len(prompt) - 1  # the prompt's last token predicts each response's first
        ids += prompt
        for i in unit:
            response = samples[i].response_ids
            index += [last] + [len(ids) + j for j in range(len(response) - 1)] if response else []
            ids += response
    ids = torch.tensor(ids, dtype=torch.long)
    return _rows(samples, ids[None], segments.positions(), segments, index, device, temperature, routing)


def prompt_units(samples: list[Sample]) -> list[list[int]]:
    """Runs of neighbours (indices) with the same prompt ids: a GRPO group, laid out together."""
    units: list[list[int]] = []
    for i, s in enumerate(samples):
        if units and samples[units[-1][0]].prompt_ids == s.prompt_ids:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _routing_of(s: Sample) -> Tensor:
    """The sample's routing table, one row per prompt + response token."""
    n = len(s.prompt_ids) + len(s.response_ids)
    if s.routing.shape[0] != n:
        raise ValueError(f"sample {s.group_id}/{s.index} has routing for {s.routing.shape[0]} of {n} tokens")
    return s.routing


def padded(
    samples: list[Sample], pad_token_id: int, device: torch.device | str = "cpu", temperature: float = 1.0
) -> Rows:
    """One right-padded row per sample, (b, longest)."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    index = []
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + n] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[i, : p + n] = True
        index.extend(i * width + p - 1 + j for j in range(n))
    positions = torch.arange(width).expand_as(ids)
    routing = None
    if all(s.routing is not None for s in samples):
        routing = torch.full((len(samples), width, *samples[0].routing.shape[1:]), -1, dtype=torch.int16)
        for i, s in enumerate(samples):
            routing[i, : len(s.prompt_ids) + len(s.response_ids)] = _routing_of(s)
        routing = routing.flatten(0, 1)
    return _rows(samples, ids, positions, mask, index, device, temperature, routing)


def _rows(
    samples: list[Sample],
    ids: Tensor,
    positions: Tensor,
    mask: Tensor | Segments,
    index: list[int],
    device: torch.device | str,
    temperature: float,
    routing: Tensor | None = None,
) -> Rows:
    tokens = [t for s in samples for t in s.response_ids]
    row = [i for i, s in enumerate(samples) for _ in s.response_ids]
    col = [j for s in samples for j in range(len(s.response_ids))]
    targets = Targets(
        torch.tensor(index, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
        temperature,
    )
    return Rows(
        ids.to(device),
        positions.to(device),
        mask.to(device) if isinstance(mask, Tensor) else mask,
        targets,
        len(samples),
        torch.tensor(row, dtype=torch.long, device=device),
        torch.tensor(col, dtype=torch.long, device=device),
        routing,
    )


def score(model, rows: Rows, width: int) -> tuple[Tensor, Tensor]:
    """One forward -> logp, entropy (b, width) fp32 of each response token, 0 past its end. With
    `rows.routing` the MoE layers use the engine's experts (routing replay), and `rows.agreement`
    says how often their own top-k was the same."""
    if rows.routing is None:
        logp, entropy = model(rows.ids, rows.positions, rows.mask, targets=rows.targets)
    else:
        table = rows.routing.to(rows.ids.device)
        with routing_context(model, Routing.replay(table, model, record=True)) as trace:
            logp, entropy = model(rows.ids, rows.positions, rows.mask, targets=rows.targets)
        own = torch.stack([trace.own[i] for i in sorted(trace.own)], dim=1)
        rows.agreement = agreement(table, own)
    table = logp.new_zeros(rows.size, width)
    return table.index_put((rows.row, rows.col), logp), table.index_put((rows.row, rows.col), entropy)


@torch.no_grad()
def sequence_logprobs(
    model, samples: list[Sample], token_budget: int, temperature: float = 1.0, pad_token_id: int | None = None
) -> Tensor:
    """Logprobs of every response token under `model` -> (B, R_max), 0 past each response's end.
    Micro-batches of `token_budget` tokens, packed; padded rows when `pad_token_id` is given."""
    width = max(max(len(s.response_ids) for s in samples), 1)
    out = torch.zeros(len(samples), width)
    device = next(model.parameters()).device
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    for part in micro_batches(lengths, token_budget, padded=pad_token_id is not None):
        chosen = [samples[i] for i in part]
        if pad_token_id is None:
            rows = packed(chosen, device, temperature)
        else:
            rows = padded(chosen, pad_token_id, device, temperature)
        out[part] = score(model, rows, width)[0].cpu()
    return out


def pad_rows(rows: list[list[float]], width: int) -> Tensor:
    """Ragged per-token lists -> (B, width) float tensor, zero-padded."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return out


def micro_batches(lengths: list[int], token_budget: int, padded: bool = True) -> list[list[int]]:
    """Index groups whose size stays within the budget: count x longest when `padded`, else the sum
    of the lengths (a packed row).

    Sequences are taken shortest first, so each micro-batch holds similar lengths: a padded one
    pads little, and a packed one has long runs of equal lengths for its attention. A sequence
    longer than the budget gets a micro-batch of its own rather than an error.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        n = lengths[i]
        size = (len(current) + 1) * max(longest, n) if padded else total + n
        if current and size > token_budget:
            groups.append(current)
            current, longest, total = [], 0, 0
        current.append(i)
        longest, total = max(longest, n), total + n
    if current:
        groups.append(current)
    return groups


def shard(n: int, rank: int, world: int) -> list[int]:
    """Rank `rank`'s rows of n: a contiguous block, the blocks' sizes differing by at most one."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return list(range(start, start + per + (rank < extra)))


def rank_micro_batches(
    lengths: list[int], token_budget: int, padded: bool, rank: int, world: int
) -> list[list[int]]:
    """Rank `rank`'s micro-batches of a batch with these lengths (indices into it): its `shard` of
    the rows, split by the budget. Every rank gets as many micro-batches — an empty one stands for a
    dummy forward — since FSDP2 all-gathers in every forward and DDP reduces in backward, collectively."""
    plans = []
    for r in range(world):
        mine = shard(len(lengths), r, world)
        parts = micro_batches([lengths[i] for i in mine], token_budget, padded)
        plans.append([[mine[j] for j in part] for part in parts])
    count = max(len(p) for p in plans)
    return plans[rank] + [[] for _ in range(count - len(plans[rank]))]
