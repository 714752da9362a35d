"""PagedKVCache and paged_attention: slot writes, gathers and block copies, and the tiny model run
through paged attention (prefill, a prefix-cache hit, a forked group, decode steps across block
boundaries) matching tandem's contiguous KVCache path in fp32 within the rounding bound of other
summation orders (`chain_tolerance`)."""

import torch
from helpers import VOCAB, chain_tolerance, longest_sum, tiny_config, tiny_model
from torch import Tensor

from tandem.model.decoder import CausalLM, apply_rope
from tandem.model.kv_cache import KVCache
from tandem.model.paged_kv import PagedKVCache, key_mask, paged_attention, real_tokens
from tandem.rollout.block_manager import BlockCopy, BlockManager

BLOCK_SIZE = 4


def test_write_gather_and_copy_blocks():
    cfg = tiny_config()
    cache = PagedKVCache(cfg, num_blocks=4, block_size=2, dtype=torch.float32, device=torch.device("cpu"))
    k = torch.randn(3, cfg.num_key_value_heads, cfg.head_dim)
    slots, index = real_tokens(torch.tensor([[5, -1, 2]]))  # the -1 token is padding, not stored
    assert slots.tolist() == [5, 2] and index.tolist() == [0, 2]
    assert real_tokens(torch.tensor([[4], [7]]))[1] is None  # a decode step: nothing to pick
    cache.write(1, slots, k[index], -k[index])
    assert torch.equal(cache.k[1][:, 2, 1], k[0]) and torch.equal(cache.v[1][:, 1, 0], k[2].neg())
    written = cache.k[1].flatten(1, 2).abs().sum((0, 2)).nonzero().flatten()  # slots holding a key
    assert written.tolist() == [2, 5] and cache.k[0].abs().sum() == 0
    keys, values = cache.gather(1, torch.tensor([[2, 1], [1, -1]]))
    mask = key_mask(torch.tensor([4, 1]), keys.shape[2])
    assert keys.shape == (2, cfg.num_key_value_heads, 4, cfg.head_dim)
    assert torch.equal(keys[0, :, 1], k[0]) and torch.equal(keys[0, :, 2], k[2])  # positions 1, 2
    assert torch.equal(values[1, :, 0], -k[2])
    assert mask.tolist() == [[True] * 4, [True, False, False, False]]
    cache.copy_blocks([BlockCopy(src=2, dst=3)])
    assert torch.equal(cache.k[1][:, 3], cache.k[1][:, 2]) and torch.equal(cache.v[0][:, 3], cache.v[0][:, 2])
    assert PagedKVCache.block_bytes(cfg, 2, torch.float32) == cache.k[0][:, 0].numel() * 4 * 2 * 2


# ---------------------------------------------------------------- the model, both ways


def paged_forward(model: CausalLM, cache: PagedKVCache, bm: BlockManager, rows: dict, new: dict):
    """CausalLM.forward with attention over the paged cache, for sequences `rows` (ids) whose last
    tokens `new[id]` are not yet computed -> logits (B, T, V) and each layer's attention output
    (B, T, E), rows right-padded to T."""
    b, t = len(rows), max(len(new[s]) for s in rows)
    tokens = torch.zeros(b, t, dtype=torch.long)
    slots = torch.full((b, t), -1)
    width = max(len(bm.block_table(s)) for s in rows)
    tables = torch.full((b, width), -1)
    for i, s in enumerate(rows):
        n, ctx = len(new[s]), bm.num_tokens(s)
        tokens[i, :n] = torch.tensor(new[s])
        slots[i, :n] = torch.tensor(bm.slots(s, ctx - n, ctx))
        tables[i, : len(bm.block_table(s))] = torch.tensor(bm.block_table(s))
    query_lens = torch.tensor([len(new[s]) for s in rows])
    context_lens = torch.tensor([bm.num_tokens(s) for s in rows])
    cos, sin = model.rope((context_lens - query_lens)[:, None] + torch.arange(t))
    x, attn_outs = model.model.embed_tokens(tokens), []
    for i, layer in enumerate(model.model.layers):
        attn, d = layer.self_attn, model.cfg.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, t, -1, d)  # (B, T, H, D), as decoder.Attention does
        k = attn.k_proj(h).view(b, t, -1, d)
        v = attn.v_proj(h).view(b, t, -1, d)
        if model.cfg.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)  # (B, T, Hkv, D)
        real, index = real_tokens(slots)
        flat = [x.reshape(-1, *x.shape[2:]) for x in (k, v)]  # (B·T, Hkv, D)
        cache.write(i, real, *(x if index is None else x[index] for x in flat))
        out = paged_attention(q, cache.k[i], cache.v[i], tables, context_lens, query_lens)
        attn_outs.append(attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)))
        x = x + attn_outs[-1]
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x)).float(), attn_outs


def contiguous_run(model: CausalLM, prompts: list[list[int]], decode: Tensor):
    """The built-in engine's path: left-padded prefill into a KVCache, then one decode step per
    column of `decode` (B, steps) -> [(logits (B, T, V), attention outputs per layer)] per forward."""
    outs: list[Tensor] = []
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, i, o: outs.append(o)) for layer in model.model.layers
    ]
    b, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(model.cfg, b, width + decode.shape[1], torch.float32, torch.device("cpu"))
    calls = [(model(ids, positions, mask, cache), list(outs))]
    next_pos = mask.sum(-1)
    for step in range(decode.shape[1]):
        outs.clear()
        logits = model(decode[:, step, None], next_pos[:, None], torch.ones(b, 1, dtype=torch.bool), cache)
        calls.append((logits, list(outs)))
        next_pos = next_pos + 1
    for hook in hooks:
        hook.remove()
    return calls


def assert_rows_match(paged, ref, pairs):
    """For each (paged row, ref row, n): the last n real positions of both agree, logits and every
    layer's attention output. Paged rows are right-padded, ref rows left-padded. Each ends a chain
    of at most the model's 4·L + 1 matmuls, summed in other orders by the two paths: within
    `chain_tolerance` (~7e-5 of its magnitude); a key at the wrong slot or position, or a block
    read before it was copied, moves them by 1e-2 or more."""
    (p_logits, p_attn), (r_logits, r_attn) = paged, ref
    cfg = tiny_config()
    k, matmuls = longest_sum(cfg), 4 * cfg.num_hidden_layers + 1
    for p, r, n in pairs:
        for a, b in [(p_logits, r_logits), *zip(p_attn, r_attn, strict=True)]:
            expected = b[r, b.shape[1] - n :]
            atol = chain_tolerance(expected, k, matmuls)
            torch.testing.assert_close(a[p, :n], expected, atol=atol, rtol=0)


@torch.no_grad()
def test_paged_attention_matches_the_contiguous_cache():
    model = tiny_model().eval()
    gen = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    # Row 1 is forked from row 0 after its prefill (a group sharing a partial last block); row 2
    # shares row 0's first two blocks through the prefix cache; row 3 shares nothing.
    p0, p3 = rand(10), rand(5)
    prompts = [p0, p0, p0[:8] + rand(3), p3]
    decode = torch.randint(3, VOCAB, (4, 6), generator=gen)  # crosses block boundaries
    ref = contiguous_run(model, prompts, decode)

    bm = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    cache = PagedKVCache(model.cfg, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    bm.allocate(0, p0)
    bm.allocate(3, p3)
    out = paged_forward(model, cache, bm, [0, 3], {0: p0, 3: p3})
    assert_rows_match(out, ref[0], [(0, 0, 10), (1, 3, 5)])
    bm.mark_computed(0, 10)
    bm.mark_computed(3, 5)
    bm.fork(0, 1)
    bm.allocate(2, prompts[2])
    assert bm.num_cached_tokens(2) == 8 and bm.block_table(2)[:2] == bm.block_table(0)[:2]
    out = paged_forward(model, cache, bm, [2], {2: prompts[2][8:]})
    assert_rows_match(out, ref[0], [(0, 2, 3)])
    bm.mark_computed(2, 11)

    rows = [0, 1, 2, 3]
    for step in range(decode.shape[1]):
        copies = [bm.append(s, int(decode[s, step])) for s in rows]
        copies = [c for c in copies if c is not None]
        assert len(copies) == (1 if step == 0 else 0)  # row 0 copies the block it shares with row 1
        cache.copy_blocks(copies)
        out = paged_forward(model, cache, bm, rows, {s: [int(decode[s, step])] for s in rows})
        assert_rows_match(out, ref[1 + step], [(i, i, 1) for i in rows])
        for s in rows:
            bm.mark_computed(s, bm.num_tokens(s))
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2] == bm.block_table(2)[:2]
