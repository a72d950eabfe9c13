"""The plugin authors' toolkit (`opdispatch.plugins.toolkit`): packing, kernel conventions and version helpers,
each against independent expectations."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from opdispatch.plugins import toolkit

from .conftest import randn


def dense_call(layout, b, sq, sk, hq, hkv, d, dv=None, *, contiguous=True, rng=None, **kw):
    dv = dv or d

    def make(s, h, dim):
        shape = {"bshd": (b, s, h, dim), "bhsd": (b, h, s, dim), "sbhd": (s, b, h, dim)}[layout]
        t = randn(*shape, gen=rng)
        if not contiguous:  # a strided view of a wider buffer
            t = torch.cat([t, randn(*shape, gen=rng)], dim=-1)[..., ::2]
        return t

    return opdispatch.validate_attention(make(sq, hq, d), make(sk, hkv, d), make(sk, hkv, dv), layout=layout, **kw)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("b, sq, sk", [(1, 5, 5), (3, 1, 7), (2, 9, 4)])
def test_pack_dense_puts_each_token_at_its_sequence_offset(layout, contiguous, b, sq, sk, rng):
    call = dense_call(layout, b, sq, sk, 4, 2, 8, 6, contiguous=contiguous, rng=rng)
    packed = toolkit.pack_dense(call)
    assert packed.q.shape == (b * sq, 4, 8) and packed.k.shape == (b * sk, 2, 8) and packed.v.shape == (b * sk, 2, 6)
    assert packed.cu_seqlens_q.dtype == torch.int32
    assert packed.cu_seqlens_q.tolist() == [i * sq for i in range(b + 1)]
    assert packed.cu_seqlens_k.tolist() == [i * sk for i in range(b + 1)]
    assert (packed.cu_seqlens_k is packed.cu_seqlens_q) == (sq == sk)
    assert (packed.max_seqlen_q, packed.max_seqlen_k) == (sq, sk)
    bhsd = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (1, 2, 0, 3)}[layout]
    q = call.q.permute(*bhsd)  # independent of the call's own views: (batch, heads, seq, dim)
    for batch in range(b):
        for token in range(sq):
            assert torch.equal(packed.q[batch * sq + token], q[batch, :, token])
    v = call.v.permute(*bhsd)
    assert torch.equal(packed.v[(b - 1) * sk + sk - 1], v[b - 1, :, sk - 1])


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_unpack_restores_the_layout_and_lse_shape(layout, rng):
    b, sq, hq, dv = 3, 5, 4, 6
    call = dense_call(layout, b, sq, 7, hq, 2, 8, dv, rng=rng)
    out = randn(b * sq, hq, dv, gen=rng)
    got = toolkit.unpack_out(call, out)
    assert got.shape == {"bshd": (b, sq, hq, dv), "bhsd": (b, hq, sq, dv), "sbhd": (sq, b, hq, dv)}[layout]
    index = {"bshd": lambda i, s, h: got[i, s, h], "bhsd": lambda i, s, h: got[i, h, s],
             "sbhd": lambda i, s, h: got[s, i, h]}[layout]
    for i, s, h in [(0, 0, 0), (2, 4, 3), (1, 2, 1)]:
        assert torch.equal(index(i, s, h), out[i * sq + s, h])
    lse = randn(hq, b * sq, gen=rng)
    got_lse = toolkit.unpack_lse(call, lse)
    assert got_lse.shape == (b, hq, sq)
    assert got_lse[2, 3, 4] == lse[3, 2 * sq + 4]


def test_pack_round_trip_through_a_packed_kernel_matches_dense_attention(rng):
    """pack -> a packed (varlen) reference kernel -> unpack equals the dense computation."""
    call = dense_call("bhsd", 2, 6, 6, 4, 2, 8, rng=rng, causal=True)
    packed = toolkit.pack_dense(call)
    outs = []
    for i in range(2):
        lo, hi = packed.cu_seqlens_q[i].item(), packed.cu_seqlens_q[i + 1].item()
        q = packed.q[lo:hi].double().transpose(0, 1)
        k = packed.k[lo:hi].double().transpose(0, 1).repeat_interleave(2, 0)
        v = packed.v[lo:hi].double().transpose(0, 1).repeat_interleave(2, 0)
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
        outs.append((s.softmax(-1) @ v).transpose(0, 1))
    got = toolkit.unpack_out(call, torch.cat(outs))
    q, k, v = (t.double() for t in (call.q, call.k, call.v))
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    torch.testing.assert_close(got, want)


def test_uniform_cu_seqlens_edge_cases():
    assert toolkit.uniform_cu_seqlens(3, 4, "cpu").tolist() == [0, 4, 8, 12]
    assert toolkit.uniform_cu_seqlens(2, 0, "cpu").tolist() == [0, 0, 0]  # empty sequences
    assert toolkit.uniform_cu_seqlens(0, 5, "cpu").tolist() == [0]


def test_kernel_window_and_alibi_alignment(rng):
    plain = dense_call("bshd", 1, 4, 4, 2, 2, 8, rng=rng)
    assert toolkit.kernel_window(plain) == (-1, -1)
    windowed = dense_call("bshd", 1, 4, 6, 2, 2, 8, rng=rng, causal=True, window=(3, 0),
                          causal_alignment="bottom_right")
    assert toolkit.kernel_window(windowed) == (3, 0)
    slopes = torch.rand(2)
    top_left = dense_call("bshd", 1, 4, 6, 2, 2, 8, rng=rng, alibi_slopes=slopes)
    reason = toolkit.alibi_alignment_reason(top_left, "kernel_x")
    assert reason is not None and "ALiBi is aligned bottom-right by kernel_x" in reason
    assert "causal_alignment='bottom_right'" in reason
    assert toolkit.alibi_alignment_reason(dense_call("bshd", 1, 4, 4, 2, 2, 8, rng=rng, alibi_slopes=slopes)) is None
    bottom = dense_call("bshd", 1, 4, 6, 2, 2, 8, rng=rng, alibi_slopes=slopes, causal=True,
                        causal_alignment="bottom_right")
    assert toolkit.alibi_alignment_reason(bottom) is None


def test_empty_rows_to_neg_inf():
    lse = torch.tensor([[1.5, math.inf, -math.inf, 0.0]])
    assert toolkit.empty_rows_to_neg_inf(lse).tolist() == [[1.5, -math.inf, -math.inf, 0.0]]


@pytest.mark.parametrize("text, release", [
    ("2.6.3", (2, 6, 3)), ("2.7.0.post2", (2, 7, 0)), ("0.1.dev1+g123", (0, 1)), ("9.19.0+cu13", (9, 19, 0)),
    ("2.11.0a0+git1234", (2, 11, 0)), ("3.0.0rc1", (3, 0, 0)), ("1.2.x", (1, 2)), ("abc", ()), ("", ()),
    (None, ()),
])
def test_version_tuple(text, release):
    assert toolkit.version_tuple(text) == release


def test_at_least_and_installed_versions():
    assert toolkit.at_least("2.7.0.post2", "2.6") and toolkit.at_least("2.6.0", "2.6.0")
    assert not toolkit.at_least("2.5.9", "2.6") and not toolkit.at_least(None, "1.0")
    assert toolkit.at_least("10.0", "9.19")  # numeric, not text, order
    import importlib.metadata

    found = toolkit.installed_versions({"yaml": "PyYAML", "missing": "no-such-distribution-xyz"})
    assert found == {"yaml": importlib.metadata.version("PyYAML")}
    assert toolkit.installed_versions(["pluggy"]) == {"pluggy": importlib.metadata.version("pluggy")}


def test_every_exported_helper_is_documented_in_the_module_docstring():
    for name in toolkit.__all__:
        assert f"`{name}" in toolkit.__doc__, f"{name} is exported but not listed in the toolkit's docstring"


def test_pack_padded_lse_keeps_each_sequences_rows_and_drops_padding(rng):
    lengths = [3, 0, 5, 1]
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    padded = randn(4, 2, 6, gen=rng)  # (batch, heads, max_seqlen_q = 6), padding past each length
    got = toolkit.pack_padded_lse(padded, cu, 9)
    want = torch.cat([padded[b, :, :n] for b, n in enumerate(lengths)], dim=1)
    assert got.shape == (2, 9) and torch.equal(got, want)


def test_unaccepted_keywords():
    def kernel(q, k, *, causal=False, scale=None):
        return None

    def anything(q, **kwargs):
        return None

    assert toolkit.unaccepted_keywords(kernel, ["q", "causal", "window_size"]) == ["window_size"]
    assert toolkit.unaccepted_keywords(anything, ["whatever"]) == []  # **kwargs: only the call can tell
    assert toolkit.unaccepted_keywords(torch.add, ["alpha", "nonsense"]) in ([], ["nonsense"])  # builtin: maybe unreadable
    assert toolkit.unaccepted_keywords_reason(kernel, ["q", "causal"], "lib.kernel") is None
    assert toolkit.unaccepted_keywords_reason(kernel, ["q", "window_size"], "lib.kernel") == (
        "lib.kernel does not accept the keywords ['window_size'] this adapter passes; signature "
        "(q, k, *, causal=False, scale=None)")


def test_aten_sdpa_call_leaves_out_exactly_the_default_arguments():
    seen = []

    def op(q, k, v, *args, **kwargs):  # records what torch's parser would be handed
        seen.append((args, kwargs))
        return (q * 2, None)

    q = torch.randn(1, 1, 3, 8)
    default = 1.0 / math.sqrt(8)
    cases = [((0.0, False), default, ((), {})),
             ((0.0, True), default, ((0.0, True), {})),
             ((0.0, False), 0.5, ((), {"scale": 0.5})),
             ((0.0, False), 8 ** -0.5, ((), {"scale": 8 ** -0.5})),  # one ulp off torch's own: kept
             ((0, False), default, ((0,), {})),  # an int is not the float default: kept
             ((None, True, 0.0, False, False), default, ((None, True), {}))]
    for tail, scale, expected in cases:
        defaults = (0.0, False, False) if len(tail) == 5 else (0.0, False)
        bound = toolkit.aten_sdpa_call(op, *tail, defaults=defaults, scale=scale, head_dim=8)
        assert torch.equal(bound(q, q, q), q * 2)
        assert seen.pop() == expected, (tail, scale)
    with pytest.raises(ValueError, match="3 defaults for a tail of 2"):
        toolkit.aten_sdpa_call(op, 0.0, False, defaults=(0.0, False, False), scale=default, head_dim=8)


@pytest.mark.parametrize("head_dim", [8, 24, 80])
@pytest.mark.parametrize("causal", [False, True])
def test_aten_sdpa_call_computes_what_the_explicit_call_computes(head_dim, causal, rng):
    kernel = torch._scaled_dot_product_flash_attention_for_cpu
    q, k, v = (randn(2, 3, 7, head_dim, gen=rng) for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    bound = toolkit.aten_sdpa_call(kernel, 0.0, causal, defaults=(0.0, False), scale=scale, head_dim=head_dim)
    assert torch.equal(bound(q, k, v), kernel(q, k, v, 0.0, causal, scale=scale)[0])  # bit for bit
    ref = torch.softmax((q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(
        torch.ones(7, 7, dtype=torch.bool).triu(1) if causal else torch.zeros(7, 7, dtype=torch.bool), -math.inf),
        dim=-1) @ v.double()
    torch.testing.assert_close(bound(q, k, v).double(), ref, rtol=1e-5, atol=1e-5)
