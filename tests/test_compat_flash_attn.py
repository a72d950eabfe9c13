"""opdispatch.compat.flash_attn: flash-attn 2.8's functions with their conventions (bshd, bottom-right causal,
causal forcing the right window to 0, ALiBi aligned bottom-right, packed and varlen forms, the KV-cache call with
in-place append, paged caches and rotary), checked against a float64 oracle written per sequence."""

from __future__ import annotations

import inspect
import math

import numpy
import pytest
import torch

from opdispatch.compat import flash_attn as fa
from tests.test_numerics import naive_attention

F32 = torch.float32


def oracle(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    """flash-attn semantics for one batch of (batch, seq, heads, dim) tensors, in float64: bottom-right alignment,
    causal = right window 0."""
    left, right = window
    if causal:
        right = 0
    win = None if left < 0 and right < 0 else (left, right)
    out, lse = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               scale=scale or q.shape[-1] ** -0.5, causal=causal, alignment="bottom_right",
                               window=win, softcap=softcap, alibi=alibi)
    return out.transpose(1, 2), lse


def rand(*shape, gen, grad=False):
    return torch.randn(*shape, generator=gen).requires_grad_(grad)


FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal, right window ignored": dict(causal=True, window_size=(3, 5)),
    "window (tensors)": dict(window_size=(torch.tensor(2), torch.tensor(1))),
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.1, 0.3, 0.5, 0.9])),
    "scale": dict(softmax_scale=0.2),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("lengths", [(6, 6), (4, 11), (9, 3)])
def test_flash_attn_func_matches_the_oracle(basic_manager, feature, lengths):
    kw = FEATURES[feature]
    sq, sk = lengths
    gen = torch.Generator().manual_seed(sq * 13 + sk)
    q, k, v = rand(2, sq, 4, 16, gen=gen, grad=True), rand(2, sk, 2, 16, gen=gen, grad=True), rand(
        2, sk, 2, 16, gen=gen, grad=True)
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    window = tuple(int(w) for w in kw.get("window_size", (-1, -1)))
    ref, ref_lse = oracle(q, k, v, causal=kw.get("causal", False), window=window, softcap=kw.get("softcap", 0.0),
                          alibi=kw.get("alibi_slopes"), scale=kw.get("softmax_scale"))
    assert probs is None and lse.shape == (2, 4, sq)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=1e-5, rtol=1e-5)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.float())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4)


def test_packed_forms_are_views_of_the_same_call(basic_manager):
    gen = torch.Generator().manual_seed(0)
    qkv = rand(2, 7, 3, 4, 16, gen=gen)
    expected = fa.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, causal=True), expected)
    q, kv = rand(2, 3, 4, 16, gen=gen), rand(2, 7, 2, 2, 16, gen=gen)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, causal=True),
                               fa.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True))


def test_repeated_calls_take_the_fast_path_with_flash_attns_conventions(basic_manager, resolves):
    gen = torch.Generator().manual_seed(9)
    q, k, v = rand(2, 3, 4, 16, gen=gen), rand(2, 7, 2, 16, gen=gen), rand(2, 7, 2, 16, gen=gen)
    want, want_lse = oracle(q.double(), k.double(), v.double(), causal=True, window=(3, 5))
    for _ in range(3):  # the first decides and binds; the others are fast-path hits
        out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 5), return_attn_probs=True)
        assert probs is None
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 5)), out)
    assert resolves == ["attention", "attention"]  # one decision per signature (with and without the LSE)
    keys = [key for key in basic_manager.fast if key[0] == "compat.flash_attn_func"]
    window = (torch.tensor(3), torch.tensor(5))  # tensors as window sizes: the general path, no key per object
    for _ in range(3):
        torch.testing.assert_close(fa.flash_attn_func(q, k, v, causal=True, window_size=window), out)
    assert [key for key in basic_manager.fast if key[0] == "compat.flash_attn_func"] == keys
    # The packed form's views reach the same fast path; its gradient lands in one packed tensor.
    qkv = rand(2, 7, 3, 2, 16, gen=gen, grad=True)
    for _ in range(2):
        out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    (grad,) = torch.autograd.grad(out.square().sum(), qkv)
    qkv64 = qkv.detach().double().requires_grad_()
    ref = oracle(qkv64[:, :, 0], qkv64[:, :, 1], qkv64[:, :, 2], causal=True)[0]
    (want_grad,) = torch.autograd.grad(ref.square().sum(), qkv64)
    torch.testing.assert_close(grad.double(), want_grad, atol=1e-4, rtol=1e-4)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_forms_match_each_sequence_alone(basic_manager):
    gen = torch.Generator().manual_seed(1)
    lq, lk = [3, 8, 1], [5, 8, 6]
    q, k, v = rand(sum(lq), 4, 16, gen=gen), rand(sum(lk), 2, 16, gen=gen), rand(sum(lk), 2, 16, gen=gen)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True,
                                            window_size=(4, -1), return_attn_probs=True)
    assert lse.shape == (4, sum(lq))
    for i in range(3):
        qs, ks = slice(sum(lq[:i]), sum(lq[:i + 1])), slice(sum(lk[:i]), sum(lk[:i + 1]))
        ref, _ = oracle(q[None, qs], k[None, ks], v[None, ks], causal=True, window=(4, -1))
        torch.testing.assert_close(out[qs].double(), ref[0], atol=1e-5, rtol=1e-5)
    qkv = rand(sum(lk), 3, 2, 16, gen=gen)
    torch.testing.assert_close(fa.flash_attn_varlen_qkvpacked_func(qkv, _cu(lk), max(lk), causal=True),
                               fa.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], _cu(lk), _cu(lk),
                                                         max(lk), max(lk), causal=True))
    kv = torch.stack([k, v], 1)
    torch.testing.assert_close(fa.flash_attn_varlen_kvpacked_func(q, kv, _cu(lq), _cu(lk), max(lq), max(lk)),
                               fa.flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk)))


def _pages(cache_lengths, block, heads, dim, gen, spare=3):
    """A paged cache holding sequences of `cache_lengths`, pages scattered (not in order), and its block table."""
    per_seq = [math.ceil((n + 4) / block) for n in cache_lengths]  # room to append 4
    total = sum(per_seq) + spare
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.zeros(len(cache_lengths), max(per_seq), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    return torch.randn(total, block, heads, dim, generator=gen), torch.randn(total, block, heads, dim,
                                                                             generator=gen), table


def test_varlen_with_a_block_table_reads_paged_keys(basic_manager):
    gen = torch.Generator().manual_seed(2)
    lk, lq = [5, 12], [2, 3]
    k_cache, v_cache, table = _pages(lk, 4, 2, 16, gen)
    q = rand(sum(lq), 4, 16, gen=gen)
    out = fa.flash_attn_varlen_func(q, k_cache, v_cache, _cu(lq), _cu(lk), max(lq), max(lk), causal=True,
                                    block_table=table)
    for i in range(2):
        keys = k_cache[table[i].long()].flatten(0, 1)[:lk[i]]
        values = v_cache[table[i].long()].flatten(0, 1)[:lk[i]]
        qs = slice(sum(lq[:i]), sum(lq[:i + 1]))
        ref, _ = oracle(q[None, qs], keys[None], values[None], causal=True)
        torch.testing.assert_close(out[qs].double(), ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_in_place_and_attends_over_each_sequence(basic_manager, paged):
    gen = torch.Generator().manual_seed(3)
    lens = [3, 9]
    q, k_new, v_new = rand(2, 2, 4, 16, gen=gen), rand(2, 2, 2, 16, gen=gen), rand(2, 2, 2, 16, gen=gen)
    if paged:
        k_cache, v_cache, table = _pages(lens, 4, 2, 16, gen)
        kw = dict(block_table=table)
    else:
        k_cache, v_cache = rand(3, 16, 2, 16, gen=gen), rand(3, 16, 2, 16, gen=gen)
        kw = dict(cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))  # sequence 0 lives in cache row 2
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                          cache_seqlens=torch.tensor(lens, dtype=torch.int32), causal=True,
                                          return_softmax_lse=True, **kw)
    assert out.shape == (2, 2, 4, 16) and lse.shape == (2, 4, 2)
    for i, n in enumerate(lens):
        if paged:
            keys = k_cache[kw["block_table"][i].long()].flatten(0, 1)
            values = v_cache[kw["block_table"][i].long()].flatten(0, 1)
            old = before_k[kw["block_table"][i].long()].flatten(0, 1)
        else:
            row = int(kw["cache_batch_idx"][i])
            keys, values, old = k_cache[row], v_cache[row], before_k[row]
        assert torch.equal(keys[n:n + 2], k_new[i]) and torch.equal(values[n:n + 2], v_new[i])  # appended
        assert torch.equal(keys[:n], old[:n]) and torch.equal(keys[n + 2:], old[n + 2:])  # nothing else moved
        ref, ref_lse = oracle(q[i:i + 1], keys[None, :n + 2], values[None, :n + 2], causal=True)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)
    if not paged:
        assert torch.equal(k_cache[1], before_k[1]) and torch.equal(v_cache[1], before_v[1])  # untouched row


def _rotary_tables(positions, rotary_dim):
    """flash-attn's (positions, rotary_dim / 2) cos and sin tables (base 10000), float32 from float64 angles."""
    theta = torch.arange(positions, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, rotary_dim, 2) / rotary_dim)
    return theta.cos().float(), theta.sin().float()


def _rope(x, positions, cos, sin, interleaved):
    """Rotary embedding by hand, float64: pairs (2i, 2i+1) when interleaved, else (i, i + d/2)."""
    x = x.double()
    rot = cos.shape[-1] * 2
    c, s = cos[positions].double(), sin[positions].double()  # (..., rot/2)
    c, s = c[..., None, :], s[..., None, :]
    if interleaved:
        a, b = x[..., :rot:2], x[..., 1:rot:2]
        ra, rb = a * c - b * s, a * s + b * c
        head = torch.stack([ra, rb], -1).flatten(-2)
    else:
        a, b = x[..., :rot // 2], x[..., rot // 2:rot]
        head = torch.cat([a * c - b * s, a * s + b * c], -1)
    return torch.cat([head, x[..., rot:]], -1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_rotary_positions_follow_flash_attn(basic_manager, causal, interleaved):
    gen = torch.Generator().manual_seed(4)
    lens = torch.tensor([2, 6], dtype=torch.int32)
    q, k_new, v_new = rand(2, 3, 2, 16, gen=gen), rand(2, 3, 2, 16, gen=gen), rand(2, 3, 2, 16, gen=gen)
    k_cache, v_cache = rand(2, 12, 2, 16, gen=gen), rand(2, 12, 2, 16, gen=gen)
    cos, sin = _rotary_tables(32, 8)  # rotary_dim 8 of 16: partial
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved)
    for i, n in enumerate(lens.tolist()):
        positions = torch.arange(n, n + 3)
        k_rot = _rope(k_new[i], positions, cos, sin, interleaved)
        torch.testing.assert_close(k_cache[i, n:n + 3].double(), k_rot, atol=1e-6, rtol=1e-6)  # stored rotated
        q_positions = positions if causal else torch.full((3,), n)
        q_rot = _rope(q[i], q_positions, cos, sin, interleaved)
        ref, _ = oracle(q_rot[None].float(), k_cache[None, i, :n + 3], v_cache[None, i, :n + 3], causal=causal)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_idx", [False, True])
def test_kvcache_leftpad_attends_from_each_sequences_start(basic_manager, batch_idx):
    """cache_leftpad (found by flash-attn's test_flash_attn_kvcache[has_leftpad=True]): sequence i holds cache
    positions [leftpad[i], cache_seqlens[i]); new keys go in at cache_seqlens, rotary positions stay absolute, and
    the window, ALiBi and bottom-right alignment count from the sequence's first key."""
    gen = torch.Generator().manual_seed(6)
    lens, leftpad = torch.tensor([7, 4], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    q, k_new, v_new = rand(2, 3, 4, 16, gen=gen), rand(2, 3, 2, 16, gen=gen), rand(2, 3, 2, 16, gen=gen)
    k_cache, v_cache = rand(3, 12, 2, 16, gen=gen), rand(3, 12, 2, 16, gen=gen)
    rows = [2, 0] if batch_idx else [0, 1]
    before_k = k_cache.clone()
    cos, sin = _rotary_tables(16, 8)
    slopes = torch.rand(2, 4, generator=gen) * 0.5
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=lens, cache_leftpad=leftpad, causal=True, window_size=(5, -1),
                                     alibi_slopes=slopes, rotary_interleaved=False,
                                     cache_batch_idx=torch.tensor(rows, dtype=torch.int32) if batch_idx else None)
    for i, (n, pad) in enumerate(zip(lens.tolist(), leftpad.tolist())):
        row, positions = rows[i], torch.arange(n, n + 3)
        torch.testing.assert_close(k_cache[row, n:n + 3].double(), _rope(k_new[i], positions, cos, sin, False),
                                   atol=1e-6, rtol=1e-6)  # appended at cache_seqlens, rotated there
        assert torch.equal(k_cache[row, :n], before_k[row, :n])  # the left padding and old keys untouched
        q_rot = _rope(q[i], positions, cos, sin, False).float()  # causal: each query at its absolute position
        ref, _ = oracle(q_rot[None], k_cache[None, row, pad:n + 3], v_cache[None, row, pad:n + 3], causal=True,
                        window=(5, -1), alibi=slopes[i])
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(2, 1))])
def test_kvcache_rotary_with_fewer_new_keys_than_queries(basic_manager, mask):
    """Found by flash-attn's test_flash_attn_kvcache[seqlen_new_eq_seqlen_q=False]: 3 queries, 2 new keys, causal or
    windowed: queries rotate at cache_seqlens + i, new keys at cache_seqlens + j, each on its own length."""
    gen = torch.Generator().manual_seed(8)
    lens = torch.tensor([4, 1], dtype=torch.int32)
    q, k_new, v_new = rand(2, 3, 4, 16, gen=gen), rand(2, 2, 2, 16, gen=gen), rand(2, 2, 2, 16, gen=gen)
    k_cache, v_cache = rand(2, 10, 2, 16, gen=gen), rand(2, 10, 2, 16, gen=gen)
    cos, sin = _rotary_tables(16, 8)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=lens, **mask)
    for i, n in enumerate(lens.tolist()):
        torch.testing.assert_close(k_cache[i, n:n + 2].double(), _rope(k_new[i], torch.arange(n, n + 2), cos, sin,
                                                                       True), atol=1e-6, rtol=1e-6)
        q_rot = _rope(q[i], torch.arange(n, n + 3), cos, sin, True).float()
        ref, _ = oracle(q_rot[None], k_cache[None, i, :n + 2], v_cache[None, i, :n + 2],
                        causal=mask.get("causal", False), window=mask.get("window_size", (-1, -1)))
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_kvcache_rotary_window_as_long_as_the_cache_is_no_window(basic_manager):
    """flash-attn's kernel drops window bounds >= the cache's length before choosing q's rotary positions: such a
    window leaves every query rotated at cache_seqlens, as with no window."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([2, 5], dtype=torch.int32)
    q, k_new, v_new = rand(2, 3, 2, 16, gen=gen), rand(2, 3, 2, 16, gen=gen), rand(2, 3, 2, 16, gen=gen)
    k_cache, v_cache = rand(2, 10, 2, 16, gen=gen), rand(2, 10, 2, 16, gen=gen)
    cos, sin = _rotary_tables(16, 16)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=lens, window_size=(10, 12))
    for i, n in enumerate(lens.tolist()):
        q_rot = _rope(q[i], torch.full((3,), n), cos, sin, True).float()
        ref, _ = oracle(q_rot[None], k_cache[None, i, :n + 3], v_cache[None, i, :n + 3])
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_signatures_are_flash_attn_2_8s():
    expected = {
        "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                           "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
        "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                                  "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                  "alibi_slopes=None, deterministic=False, return_attn_probs=False, "
                                  "block_table=None",
        "flash_attn_with_kvcache": "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
                                   "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
                                   "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                   "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                                   "return_softmax_lse=False",
    }
    for name, params in expected.items():
        sig = inspect.signature(getattr(fa, name))
        text = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                         for p in sig.parameters.values())
        assert text == params, name


def test_the_tests_own_fake_flash_attn_agrees_with_the_front_door(basic_manager):
    """The flash-attn fake the vendor tests use implements the library's math independently: same answers."""
    from tests.fakes import flash_attn as module
    gen = torch.Generator().manual_seed(5)
    q, k, v = rand(2, 4, 4, 16, gen=gen), rand(2, 9, 2, 16, gen=gen), rand(2, 9, 2, 16, gen=gen)
    for kw in (dict(causal=True), dict(window_size=(3, 2)), dict(softcap=5.0, causal=True)):
        torch.testing.assert_close(fa.flash_attn_func(q, k, v, **kw), module.flash_attn_func(q, k, v, **kw),
                                   atol=1e-5, rtol=1e-5)


def test_calling_it_from_inside_an_implementation_is_refused_not_looped(basic_manager):
    import opdispatch

    class Aliased(opdispatch.AttentionImpl):
        vendor, name = "alias", "fa"
        caps = opdispatch.AttentionCaps(dtypes=frozenset({F32}), layouts=frozenset({"bshd"}), causal=True,
                                        causal_alignments=frozenset({"bottom_right", "top_left"}))

        def run(self, call):  # as the nvidia.flash_attn adapter would, were flash_attn aliased to the front door
            return fa.flash_attn_func(call.q, call.k, call.v, causal=call.causal)

    basic_manager.register_impl(Aliased())
    q = torch.randn(1, 4, 2, 16)
    with opdispatch.policy_override(pin="alias.fa"), pytest.raises(RuntimeError, match="do not alias"):
        fa.flash_attn_func(q, q, q, causal=True)


def test_kvcache_refuses_what_it_does_not_support(basic_manager):
    q, cache = torch.randn(1, 1, 2, 16), torch.randn(1, 8, 2, 16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_leftpad and block_table cannot be used together"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, cache_leftpad=torch.tensor([1], dtype=torch.int32),
                                   block_table=table)
    with pytest.raises(TypeError, match=r"cache_leftpad must be torch.int32 \(as in flash-attn\), got torch.int64"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, cache_leftpad=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\]=4 is out of range; allowed: 0..cache_seqlens\[b\]"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, cache_leftpad=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="pass k and v together"):
        fa.flash_attn_with_kvcache(q, cache, cache, k=torch.randn(1, 1, 2, 16), cache_seqlens=3)


@pytest.mark.parametrize("window_size", [(1.5, 0), (2, 0.0), (torch.tensor(2.0), 0), (True, 0), ("2", 0), (2,),
                                         (2, 0, 1), 3, (torch.tensor([1, 2]), 0)],
                         ids=["float left", "float right", "float tensor", "bool", "str", "one bound", "three",
                              "an int", "two-element tensor"])
def test_window_size_must_be_two_integers(window_size):
    """flash-attn's kernels take int window bounds: 1.5 must not silently become 1 — a TypeError naming the
    argument, in every form, before anything is computed or written (with_kvcache's append included)."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="window_size"):
        fa.flash_attn_func(q, q, q, window_size=window_size)
    k_cache = torch.zeros(1, 8, 2, 8)
    before = k_cache.clone()
    with pytest.raises(TypeError, match="window_size"):
        fa.flash_attn_with_kvcache(q[:, :1], k_cache, k_cache.clone(), k=q[:, :1], v=q[:, :1],
                                           cache_seqlens=torch.tensor([3], dtype=torch.int32),
                                           window_size=window_size)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("window_size", [(2, 0), (numpy.int64(2), numpy.int32(0)),
                                         (torch.tensor(2), torch.tensor(0, dtype=torch.int32))])
def test_window_size_integer_forms_accepted(window_size):
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    got = fa.flash_attn_func(q, k, v, window_size=window_size)
    want, _ = oracle(q, k, v, window=(2, 0))
    torch.testing.assert_close(got, want.to(got.dtype))
