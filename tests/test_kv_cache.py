"""A KV cache in the attention op itself: `seqused_k` (per-sequence fill) and `block_table` (paged pools).

The oracle gathers each sequence's keys with plain Python indexing and computes in float64 with the fakes'
independent math (`tests/fakes/_fa_math.attend`), never with the reference implementation under test.
"""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from tests.fakes._fa_math import attend

LAYOUTS = ("bshd", "bhsd", "sbhd")


def _to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (b, s, h, d) tensor stored in `layout` (a real copy in that memory order)."""
    if layout == "bhsd":
        return t.transpose(1, 2).contiguous()
    if layout == "sbhd":
        return t.transpose(0, 1).contiguous()
    return t.contiguous()


def _from_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bhsd" else t.transpose(0, 1) if layout == "sbhd" else t


def oracle_sequence(q, k, v, *, scale, causal=False, window=None, alignment="bottom_right", softcap=0.0):
    """q (sq, h, d), k/v (n, hk, d) of one sequence → out (sq, h, dv) float64, lse (h, sq) (computed in float64,
    returned as float32) with -inf where blind."""
    offset = k.shape[0] - q.shape[0] if alignment == "bottom_right" else 0
    out, lse = attend(q[None].double(), k[None].double(), v[None].double(), scale, causal,
                      window if window is not None else (-1, -1), softcap, None, offset, blind_lse=-math.inf)
    return out[0].double(), lse[0].double()


def paged_pools(keys: list[torch.Tensor], page_size: int, num_pages: int, gen: torch.Generator):
    """Scatter each sequence's (n, h, d) keys over randomly chosen pages of a pool filled with noise; returns
    (pool, block_table) — pages in a random order, unused slots random (they must never be read)."""
    h, d = keys[0].shape[1], keys[0].shape[2]
    pool = torch.randn(num_pages, page_size, h, d, generator=gen, dtype=keys[0].dtype) * 100
    order = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(-(-k.shape[0] // page_size) for k in keys) + 1  # one spare column, never read
    table = torch.full((len(keys), max_pages), num_pages + 7, dtype=torch.int32)  # out of range if ever read
    for b, kb in enumerate(keys):
        for p in range(-(-kb.shape[0] // page_size)):
            page = order.pop()
            table[b, p] = page
            chunk = kb[p * page_size:(p + 1) * page_size]
            pool[page, :chunk.shape[0]] = chunk
    return pool, table


def _rand(*shape, gen, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("impl", ["cpu.flash", "reference.math"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", ["none", "causal-br", "causal-tl", "window"])
def test_dense_cache_uses_each_sequences_fill(layout, mask, impl, manager):
    gen = torch.Generator().manual_seed(LAYOUTS.index(layout) * 10 + len(mask))
    b, sq, cap, h, hk, d = 4, 3, 11, 4, 2, 8
    q, k, v = _rand(b, sq, h, d, gen=gen), _rand(b, cap, hk, d, gen=gen), _rand(b, cap, hk, d, gen=gen)
    used = torch.tensor([5, 11, 0, 2], dtype=torch.int32)
    kw = {"none": {}, "causal-br": dict(causal=True, causal_alignment="bottom_right"),
          "causal-tl": dict(causal=True, causal_alignment="top_left"),
          "window": dict(window=(2, 1), causal_alignment="bottom_right")}[mask]
    out, lse = opdispatch.attention(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout),
                                    layout=layout, seqused_k=used, return_lse=True, impl=impl, **kw)
    out = _from_layout(out, layout)
    for i, n in enumerate(used.tolist()):
        want_out, want_lse = oracle_sequence(q[i], k[i, :n], v[i, :n], scale=d ** -0.5, causal=kw.get("causal", False),
                                             window=kw.get("window"), alignment=kw.get("causal_alignment",
                                                                                        "top_left"))
        torch.testing.assert_close(out[i], want_out, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[i], want_lse, atol=1e-6, rtol=1e-6)  # the fakes' math keeps lse in fp32
    assert out[2].abs().max() == 0 and torch.isneginf(lse[2]).all()  # an empty cache sees no key


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_paged_cache_reads_pages_in_block_table_order(layout, page_size, manager):
    gen = torch.Generator().manual_seed(page_size * 10 + len(layout))
    h, hk, d = 6, 3, 16
    used = [7, 1, 16, 0, 9]
    lens_q = [3, 1, 4, 2, 1] if layout == "thd" else [2] * len(used)
    keys = [_rand(n, hk, d, gen=gen) for n in used]
    values = [_rand(n, hk, d, gen=gen) for n in used]
    k_pool, table = paged_pools(keys, page_size, num_pages=sum(-(-n // page_size) for n in used) + 3, gen=gen)
    v_pool = torch.randn(k_pool.shape, generator=gen, dtype=torch.float64) * 100
    for b, vb in enumerate(values):
        for p in range(-(-vb.shape[0] // page_size)):
            chunk = vb[p * page_size:(p + 1) * page_size]
            v_pool[table[b, p].item(), :chunk.shape[0]] = chunk
    qs = [_rand(n, h, d, gen=gen) for n in lens_q]
    seqused = torch.tensor(used, dtype=torch.int32)
    if layout == "thd":
        cu = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
        out = opdispatch.attention(torch.cat(qs), k_pool, v_pool, layout="thd", cu_seqlens_q=cu, seqused_k=seqused,
                                   block_table=table, causal=True, causal_alignment="bottom_right")
        outs = list(out.split(lens_q))
    else:
        q = torch.stack(qs) if layout == "bshd" else torch.stack(qs).transpose(0, 1)
        out = opdispatch.attention(q, k_pool, v_pool, layout=layout, seqused_k=seqused, block_table=table,
                                   causal=True, causal_alignment="bottom_right")
        outs = list(out if layout == "bshd" else out.transpose(0, 1))
    for b in range(len(used)):
        want, _ = oracle_sequence(qs[b], keys[b], values[b], scale=d ** -0.5, causal=True)
        torch.testing.assert_close(outs[b], want, atol=1e-10, rtol=1e-10)


def test_packed_queries_over_an_unpaged_cache_use_seqused_k_of_each_span(manager):
    gen = torch.Generator().manual_seed(5)
    h, d = 2, 8
    spans, used, lens_q = [6, 4, 9], [6, 1, 3], [2, 1, 3]
    k, v = _rand(sum(spans), h, d, gen=gen), _rand(sum(spans), h, d, gen=gen)
    q = _rand(sum(lens_q), h, d, gen=gen)
    cu_k = torch.tensor([0, 6, 10, 19], dtype=torch.int32)
    cu_q = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    out = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               seqused_k=torch.tensor(used, dtype=torch.int32), window=(1, 0),
                               causal_alignment="bottom_right")
    starts_k, starts_q = [0, 6, 10], [0, 2, 3]
    for b in range(3):
        want, _ = oracle_sequence(q[starts_q[b]:starts_q[b] + lens_q[b]], k[starts_k[b]:starts_k[b] + used[b]],
                                  v[starts_k[b]:starts_k[b] + used[b]], scale=d ** -0.5, window=(1, 0))
        torch.testing.assert_close(out[starts_q[b]:starts_q[b] + lens_q[b]], want, atol=1e-10, rtol=1e-10)


def test_strided_cache_views_and_gradients(manager):
    """The cache as a strided view (a bhsd buffer seen as bshd, sliced along its length) and gradients that reach
    only the keys each sequence uses."""
    gen = torch.Generator().manual_seed(9)
    b, sq, h, d = 3, 2, 2, 4
    buffer_k, buffer_v = _rand(b, h, 20, d, gen=gen), _rand(b, h, 20, d, gen=gen)
    k = buffer_k.transpose(1, 2)[:, 2:14].detach().requires_grad_()  # (b, 12, h, d) view, not contiguous
    v = buffer_v.transpose(1, 2)[:, 2:14].detach().requires_grad_()
    assert not k.is_contiguous()
    q = _rand(b, sq, h, d, gen=gen).requires_grad_()
    used = torch.tensor([12, 5, 3], dtype=torch.int32)
    out = opdispatch.attention(q, k, v, seqused_k=used, causal=True, causal_alignment="bottom_right")
    grad = _rand(*out.shape, gen=gen)
    out.backward(grad)
    for i, n in enumerate(used.tolist()):
        qi, ki, vi = (t.detach()[i].clone().requires_grad_() for t in (q, k, v))
        want, _ = oracle_sequence(qi, ki[:n], vi[:n], scale=d ** -0.5, causal=True)
        torch.testing.assert_close(out[i], want, atol=1e-10, rtol=1e-10)
        want.backward(grad[i])
        torch.testing.assert_close(q.grad[i], qi.grad, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(k.grad[i], ki.grad, atol=1e-10, rtol=1e-10)
        assert k.grad[i, n:].abs().max() == 0 if n < k.shape[1] else True  # unused cache rows get no gradient


def test_compiled_decode_loop_matches_eager(manager):
    gen = torch.Generator().manual_seed(3)
    b, cap, h, d = 2, 16, 2, 8
    k_cache, v_cache = _rand(b, cap, h, d, gen=gen, dtype=torch.float32), _rand(b, cap, h, d, gen=gen,
                                                                               dtype=torch.float32)

    def step(q, k_cache, v_cache, used):
        return opdispatch.attention(q, k_cache, v_cache, seqused_k=used, causal=True,
                                    causal_alignment="bottom_right")

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for fill in (1, 4, 9, 16):
        q = _rand(b, 1, h, d, gen=gen, dtype=torch.float32)
        used = torch.tensor([fill, max(fill - 3, 0)], dtype=torch.int32)
        torch.testing.assert_close(compiled(q, k_cache, v_cache, used), step(q, k_cache, v_cache, used))


def test_decode_loop_decides_once(manager):
    """The cache's fill changes every step; the decision class does not."""
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = _rand(2, 32, 2, 8, gen=gen), _rand(2, 32, 2, 8, gen=gen)
    for fill in range(1, 20):
        q = _rand(2, 1, 2, 8, gen=gen)
        opdispatch.attention(q, k_cache, v_cache, seqused_k=torch.tensor([fill, fill + 3], dtype=torch.int32),
                             causal=True, causal_alignment="bottom_right")
    assert manager.decisions_made == 1


# -- selection ----------------------------------------------------------------------------------------------

def _paged_call_args(gen, page_size=4):
    q = _rand(2, 1, 2, 8, gen=gen, dtype=torch.float32)
    pool = _rand(6, page_size, 2, 8, gen=gen, dtype=torch.float32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return (q, pool, pool.clone()), dict(seqused_k=torch.tensor([5, 8], dtype=torch.int32), block_table=table)


def test_implementations_without_kv_support_say_so(basic_manager, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    (q, k, v), kw = _paged_call_args(gen)
    # cpu.flash reads a paged cache by gathering its pages (vLLM's small pages on CPU), exactly as the reference
    decision = opdispatch.explain(q, k, v, **kw)
    assert decision.chosen_id == "cpu.flash"
    torch.testing.assert_close(opdispatch.attention(q, k, v, **kw),
                               opdispatch.attention(q, k, v, impl="reference.math", **kw), atol=1e-6, rtol=1e-6)
    # (the CUDA kernels' gather is bounded: tests/test_kv_cache_vendors.py; cpu.flash reads no sizes to select)
    flash = opdispatch.get_manager().implementation("attention", "cpu.flash")
    assert type(flash).selection_key is opdispatch.AttentionImpl.selection_key
    # A dense cache: cpu.flash takes it (its fill as a mask); ALiBi it declines, saying why.
    cache = _rand(2, 8, 2, 8, gen=gen, dtype=torch.float32), _rand(2, 8, 2, 8, gen=gen, dtype=torch.float32)
    assert opdispatch.explain(q, *cache, seqused_k=kw["seqused_k"]).chosen_id == "cpu.flash"
    alibi = opdispatch.explain(q, *cache, seqused_k=kw["seqused_k"], alibi_slopes=torch.rand(2))
    flash = next(c for c in alibi.candidates if c.impl_id == "cpu.flash")
    assert flash.reasons == ["ALiBi over a KV cache not supported (its distances follow each sequence's fill)"]
    with pytest.raises(opdispatch.NoImplementationError, match="ALiBi over a KV cache"):
        opdispatch.attention(q, *cache, seqused_k=kw["seqused_k"], alibi_slopes=torch.rand(2), impl="cpu.flash")


def test_policy_rules_see_kv_cache_and_page_size(basic_manager, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n"
                    "      - name: no-small-pages\n        when: {paged: true, page_size: '<8'}\n"
                    "        deny: [cpu.*]\n")
    basic_manager.set_policy(path)
    gen = torch.Generator().manual_seed(2)
    (q, k, v), kw = _paged_call_args(gen, page_size=4)
    decision = opdispatch.explain(q, k, v, **kw)
    assert decision.chosen_id == "reference.math"
    flash = next(c for c in decision.candidates if c.impl_id == "cpu.flash")
    assert flash.status == "denied by policy" and flash.decided_by.rule == "no-small-pages"
    (q, k, v), kw = _paged_call_args(gen, page_size=8)
    assert opdispatch.explain(q, k, v, **kw).chosen_id == "cpu.flash"


# -- errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, error, match", [
    (dict(seqused_k=None), ValueError, r"block_table needs seqused_k"),
    (dict(seqused_k=torch.tensor([5, 8])), TypeError, r"seqused_k must be int32, got torch.int64"),
    (dict(seqused_k=torch.tensor([5], dtype=torch.int32)), ValueError, r"seqused_k has 1 entries but the batch is 2"),
    (dict(seqused_k=torch.tensor([5, 9], dtype=torch.int32)), ValueError,
     r"seqused_k\[1\]=9 is out of range; allowed: 0..8 \(the block table's pages\)"),
    (dict(seqused_k=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, r"seqused_k\[0\]=-1 is out of range"),
    (dict(block_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)), ValueError,
     r"block_table\[1\] names page 9, but the pools hold pages 0..5"),
    (dict(block_table=torch.tensor([0, 1], dtype=torch.int32)), ValueError, r"block_table must be 2-D"),
    (dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, r"block_table has 1 rows"),
    (dict(attn_mask=torch.ones(1, 1, 1, 8, dtype=torch.bool)), ValueError, r"attn_mask/attn_bias are not taken"),
])
def test_kv_cache_errors_name_the_value_and_the_fix(change, error, match, basic_manager):
    gen = torch.Generator().manual_seed(0)
    (q, k, v), kw = _paged_call_args(gen)
    kw.update(change)
    with pytest.raises(error, match=match):
        opdispatch.attention(q, k, v, **kw)


def test_paged_pools_must_be_four_dimensional(basic_manager):
    gen = torch.Generator().manual_seed(0)
    (q, k, v), kw = _paged_call_args(gen)
    with pytest.raises(ValueError, match=r"with block_table k and v are page pools of 4 dims"):
        opdispatch.attention(q, k.flatten(0, 1), v.flatten(0, 1), **kw)
    with pytest.raises(ValueError, match=r"cu_seqlens_k is not taken with block_table"):
        opdispatch.attention(q[:, 0], k, v, layout="thd", cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 1, 2], dtype=torch.int32), **kw)
    packed = _rand(8, 2, 8, gen=gen, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"seqused_k\[0\]=7 is out of range; allowed: 0..6 \(its cu_seqlens_k span\)"):
        opdispatch.attention(q[:, 0], packed, packed, layout="thd",
                             cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 6, 8], dtype=torch.int32),
                             seqused_k=torch.tensor([7, 1], dtype=torch.int32))


@pytest.mark.parametrize("paged", [False, True])
def test_a_decode_loop_takes_the_fast_path_with_each_steps_lengths(paged, basic_manager, resolves, monkeypatch):
    """On an accelerator a KV-cache call's lengths and pages join the fast-path key by shape (their values are not
    read); the bound function gets each step's tensors. The CPU checks values per call instead, so this test lets
    CPU index tensors into the key the way an accelerator's are."""
    from opdispatch.doors import _api

    monkeypatch.setattr(_api, "_index_key", lambda t: (t.shape, t.dtype, t.device))
    gen = torch.Generator().manual_seed(5 + paged)
    b, cap, h, hk, d, page = 3, 12, 4, 2, 8, 4
    keys = [_rand(cap, hk, d, gen=gen) for _ in range(b)]
    values = [_rand(cap, hk, d, gen=gen) for _ in range(b)]
    if paged:
        k, table = paged_pools(keys, page, 3 * b + 2, torch.Generator().manual_seed(1))
        v, _ = paged_pools(values, page, 3 * b + 2, torch.Generator().manual_seed(1))
        # pages of one table hold both pools: the same generator places them alike
    else:
        k, v, table = torch.stack(keys), torch.stack(values), None
    lengths = torch.tensor([1, 4, 7])
    for step in range(5):
        used = (lengths + step).to(torch.int32)  # a new tensor each step, as a serving loop makes it
        q = _rand(b, 1, h, d, gen=gen)
        out = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right", seqused_k=used,
                                   block_table=table)
        for i, n in enumerate(used.tolist()):
            want, _ = oracle_sequence(q[i], keys[i][:n], values[i][:n], scale=d ** -0.5, causal=True)
            torch.testing.assert_close(out[i], want, atol=1e-10, rtol=1e-10)
    assert resolves == ["attention"]  # one decision; every later step was a fast-path hit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["nowindow", "window3"])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("layout, page_size", [("bshd", 1), ("bhsd", 5), ("sbhd", 16)])
def test_cpu_flash_reads_paged_caches_by_gathering_their_pages(layout, page_size, seqlen_q, window, dtype,
                                                               basic_manager):
    """cpu.flash takes paged calls (vLLM's 16-key pages on CPU), gathering each block table's pages: every layout,
    GQA, one and several queries (bottom-right; rows before the fill see nothing), windows, an empty sequence and
    table entries past the used pages that name no page — against the float64 oracle per sequence."""
    gen = torch.Generator().manual_seed(page_size * 31 + seqlen_q + len(layout))
    h, hk, d = 6, 3, 16
    used = [7, 0, 17, 2]
    keys = [_rand(n, hk, d, gen=gen, dtype=dtype) for n in used]
    values = [_rand(n, hk, d, gen=gen, dtype=dtype) for n in used]
    num_pages = sum(-(-n // page_size) for n in used) + 2
    k_pool, table = paged_pools(keys, page_size, num_pages, gen)
    v_pool = torch.zeros_like(k_pool)
    for b, vb in enumerate(values):
        for p in range(-(-vb.shape[0] // page_size)):
            chunk = vb[p * page_size:(p + 1) * page_size]
            v_pool[table[b, p].item(), :chunk.shape[0]] = chunk
    qs = [_rand(seqlen_q, h, d, gen=gen, dtype=dtype) for _ in used]
    q = torch.stack(qs)  # bshd
    q = {"bshd": q, "bhsd": q.transpose(1, 2), "sbhd": q.transpose(0, 1)}[layout]
    kw = dict(layout=layout, seqused_k=torch.tensor(used, dtype=torch.int32), block_table=table, causal=True,
              causal_alignment="bottom_right", window=window)
    assert opdispatch.explain(q, k_pool, v_pool, **kw).chosen_id == "cpu.flash"
    out = opdispatch.attention(q, k_pool, v_pool, **kw)
    out = {"bshd": out, "bhsd": out.transpose(1, 2), "sbhd": out.transpose(0, 1)}[layout]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(used)):
        want, _ = oracle_sequence(qs[b], keys[b], values[b], scale=d ** -0.5, causal=True, window=window)
        torch.testing.assert_close(out[b].double(), want, atol=tol, rtol=tol)
