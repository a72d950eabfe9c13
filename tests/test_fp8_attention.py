"""FP8 attention in the op: q/k/v in float8_e4m3fn/e5m2 with their descales, an output dtype, validation, caps and
the reference — checked against an independent float64 oracle of the dequantized inputs."""

from __future__ import annotations

import itertools

import pytest
import torch

import opdispatch

F8 = torch.float8_e4m3fn
E5 = torch.float8_e5m2


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            window: tuple[int, int] | None = None, bottom_right: bool = False) -> torch.Tensor:
    """float64 attention of one sequence: q (sq, hq, d), k/v (sk, hkv, d), already dequantized; rows without any
    key give zeros."""
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    group = hq // hkv
    out = torch.zeros(sq, hq, v.shape[-1], dtype=torch.float64)
    offset = sk - sq if bottom_right else 0
    for h in range(hq):
        for i in range(sq):
            keep = []
            for j in range(sk):
                rel = j - (i + offset)
                ok = not (causal and rel > 0)
                if window is not None:
                    left, right = window
                    ok = ok and (left < 0 or rel >= -left) and (right < 0 or rel <= right)
                keep.append(ok)
            idx = [j for j, ok in enumerate(keep) if ok]
            if not idx:
                continue
            s = torch.stack([q[i, h] @ k[j, h // group] for j in idx]) / d ** 0.5
            p = torch.softmax(s, dim=0)
            out[i, h] = (p[:, None] * torch.stack([v[j, h // group] for j in idx])).sum(0)
    return out


def _quantized(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = F8) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 3).to(dtype)


def _factors(batch: int, heads_kv: int, per_head: bool, gen: torch.Generator) -> torch.Tensor:
    if per_head:
        return torch.rand(batch, heads_kv, generator=gen) * 0.5 + 0.05
    return torch.rand((), generator=gen) * 0.5 + 0.05


def _to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """(b, s, h, d) -> layout (a permuted copy, so strides are the layout's own)."""
    return {"bshd": t, "bhsd": t.transpose(1, 2), "sbhd": t.transpose(0, 1)}[layout].contiguous()


def _per_sequence_scale(t: torch.Tensor, descale: torch.Tensor, b: int, ratio: int) -> torch.Tensor:
    """(s, h, d) float64 of sequence b times its factors (kv head h // ratio for query heads)."""
    if descale.dim() == 0:
        return t.double() * descale.double()
    heads = torch.arange(t.shape[1]) // ratio
    return t.double() * descale[b, heads].double()[None, :, None]


@pytest.mark.parametrize("layout,causal,window,heads,per_head,kind,out_dtype", [
    ("bshd", False, None, (4, 4), False, F8, None),
    ("bshd", True, None, (4, 2), True, F8, torch.float16),
    ("bhsd", False, (3, 1), (4, 1), True, F8, torch.bfloat16),
    ("sbhd", True, (2, 0), (6, 3), True, E5, None),
    ("bhsd", True, None, (2, 2), False, E5, torch.float16),
])
def test_dense_fp8_matches_the_dequantized_float64_oracle(layout, causal, window, heads, per_head, kind, out_dtype):
    gen = torch.Generator().manual_seed(hash((layout, causal, heads, per_head)) % 2**31)
    b, sq, sk, d = 2, 5, 7, 16
    hq, hkv = heads
    q, k, v = (_quantized(shape, gen, kind) for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    qs, ks, vs = (_factors(b, hkv, per_head, gen) for _ in range(3))
    out = opdispatch.attention(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout), layout=layout,
                               causal=causal, causal_alignment="bottom_right", window=window, q_descale=qs,
                               k_descale=ks, v_descale=vs, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.bfloat16)
    got = {"bshd": out, "bhsd": out.transpose(1, 2), "sbhd": out.transpose(0, 1)}[layout].double()
    for i in range(b):
        want = _oracle(_per_sequence_scale(q[i], qs, i, hq // hkv), _per_sequence_scale(k[i], ks, i, 1),
                       _per_sequence_scale(v[i], vs, i, 1), causal=causal, window=window, bottom_right=True)
        # the only rounding after float32 compute is the output's (bf16: 2**-8 relative)
        torch.testing.assert_close(got[i], want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_varlen_and_paged_fp8_match_the_oracle_per_sequence():
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 4, 2, 8
    lengths_q, lengths_k = [3, 5], [6, 4]
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 10], dtype=torch.int32)
    q = _quantized((8, hq, d), gen)
    k, v = _quantized((10, hkv, d), gen), _quantized((10, hkv, d), gen)
    qs, ks, vs = (_factors(2, hkv, True, gen) for _ in range(3))
    out = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                               causal_alignment="bottom_right", q_descale=qs, k_descale=ks, v_descale=vs)
    for b in range(2):
        sl_q, sl_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want = _oracle(_per_sequence_scale(q[sl_q], qs, b, 2), _per_sequence_scale(k[sl_k], ks, b, 1),
                       _per_sequence_scale(v[sl_k], vs, b, 1), causal=True, bottom_right=True)
        torch.testing.assert_close(out[sl_q].double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert lengths_q == [3, 5] and lengths_k == [6, 4]

    # A paged cache whose pages two sequences share: each reads the shared page with its own factors.
    page, pages = 2, 5
    pool_k, pool_v = _quantized((pages, page, hkv, d), gen), _quantized((pages, page, hkv, d), gen)
    table = torch.tensor([[4, 0, 2], [0, 3, 1]], dtype=torch.int32)
    used = torch.tensor([5, 6], dtype=torch.int32)
    qd = _quantized((2, 2, hq, d), gen)
    for per_head in (False, True):
        qs, ks, vs = (_factors(2, hkv, per_head, gen) for _ in range(3))
        out = opdispatch.attention(qd, pool_k, pool_v, seqused_k=used, block_table=table, causal=True,
                                   causal_alignment="bottom_right", q_descale=qs, k_descale=ks, v_descale=vs)
        for b in range(2):
            n = int(used[b])
            keys = torch.cat([pool_k[p] for p in table[b].tolist()])[:n]
            values = torch.cat([pool_v[p] for p in table[b].tolist()])[:n]
            want = _oracle(_per_sequence_scale(qd[b], qs, b, 2), _per_sequence_scale(keys, ks, b, 1),
                           _per_sequence_scale(values, vs, b, 1), causal=True, bottom_right=True)
            torch.testing.assert_close(out[b].double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_descales_scale_the_result_as_dequantization_says():
    """v's factor scales the output linearly, q's and k's the scores: a doubled v_descale doubles the output."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_quantized((1, 4, 2, 8), gen) for _ in range(3))
    one = torch.ones(())
    base = opdispatch.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one, out_dtype=torch.float16)
    twice = opdispatch.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one * 2, out_dtype=torch.float16)
    torch.testing.assert_close(twice.double(), base.double() * 2, rtol=2e-3, atol=1e-3)
    sharper = opdispatch.attention(q, k, v, q_descale=one * 2, k_descale=one, v_descale=one)
    assert not torch.allclose(sharper.float(), base.float(), atol=1e-2)


# -- validation ----------------------------------------------------------------------------------------------

def _call(**over):
    gen = torch.Generator().manual_seed(1)
    args = dict(q=_quantized((2, 3, 4, 8), gen), k=_quantized((2, 3, 2, 8), gen), v=_quantized((2, 3, 2, 8), gen),
                q_descale=torch.ones(()), k_descale=torch.ones(()), v_descale=torch.ones(()))
    args.update(over)
    return opdispatch.attention(**args)


@pytest.mark.parametrize("over,error,words", [
    (dict(q_descale=None), ValueError, ["missing q_descale", "(batch, heads_kv) = (2, 2)"]),
    (dict(k_descale=None, v_descale=None), ValueError, ["missing k_descale, v_descale"]),
    (dict(q_descale=torch.ones((), dtype=torch.float64)), TypeError, ["q_descale must be float32"]),
    (dict(k_descale=torch.ones(2, 4)), ValueError, ["k_descale has shape (2, 4)", "(2, 2)"]),
    (dict(v_descale=torch.ones(3)), ValueError, ["v_descale has shape (3,)"]),
    (dict(v_descale=torch.ones((), device="meta")), ValueError, ["v_descale is on meta"]),
    (dict(q_descale=torch.tensor(float("nan"))), ValueError, ["non-finite"]),
    (dict(v_descale=[1.0]), TypeError, ["v_descale must be a torch.Tensor"]),
    (dict(out_dtype=torch.float32), ValueError, ["out_dtype=torch.float32", "torch.bfloat16, torch.float16"]),
    (dict(out_dtype="bf16"), TypeError, ["out_dtype must be a torch.dtype"]),
    (dict(k=torch.zeros(2, 3, 2, 8, dtype=E5)), TypeError, ["one FP8 kind", "k=torch.float8_e5m2"]),
    (dict(v=torch.zeros(2, 3, 2, 8, dtype=torch.bfloat16)), TypeError, ["one FP8 kind"]),
    (dict(sinks=torch.zeros(4)), ValueError, ["does not take sinks"]),
    (dict(q_descale=torch.ones((), requires_grad=True)), ValueError, ["forward-only", "detach"]),
])
def test_fp8_validation_names_the_argument_and_the_fix(over, error, words):
    with pytest.raises(error) as info:
        _call(**over)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_descales_and_out_dtype_are_refused_for_non_fp8_inputs():
    x = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="q_descale, v_descale given but q/k/v are fp32"):
        opdispatch.attention(x, x, x, q_descale=torch.ones(()), v_descale=torch.ones(()))
    with pytest.raises(ValueError, match="out_dtype=torch.bfloat16 differs from q's dtype torch.float32"):
        opdispatch.attention(x, x, x, out_dtype=torch.bfloat16)
    same = opdispatch.attention(x, x, x, out_dtype=torch.float32)  # q's own dtype: the call as without it
    torch.testing.assert_close(same, opdispatch.attention(x, x, x))


# -- capabilities, policy, explain -----------------------------------------------------------------------------

def test_caps_reasons_for_fp8_output_and_granularity():
    from opdispatch import AttentionCaps
    from opdispatch.ops._attention import capability_reasons, validate_attention

    gen = torch.Generator().manual_seed(2)
    q, k, v = (_quantized((2, 3, 2, 8), gen) for _ in range(3))
    per_head = validate_attention(q, k, v, q_descale=torch.ones(2, 2), k_descale=torch.ones(()),
                                  v_descale=torch.ones(()), out_dtype=torch.float16)
    caps = AttentionCaps(dtypes=frozenset({F8}), layouts=frozenset({"bshd"}),
                         fp8_out_dtypes=frozenset({torch.bfloat16}))
    assert capability_reasons(caps, per_head) == [
        "FP8 output dtype fp16 not supported (supported: bf16)",
        "FP8 descales per (batch, kv head) not supported (one descale per tensor only)"]
    no_fp8 = AttentionCaps(dtypes=frozenset({torch.bfloat16}), layouts=frozenset({"bshd"}))
    assert capability_reasons(no_fp8, per_head) == ["dtype fp8_e4m3fn not supported (supported: bf16)"]
    # signature and class key tell the output dtype and the granularity apart
    per_tensor = validate_attention(q, k, v, q_descale=torch.ones(()), k_descale=torch.ones(()),
                                    v_descale=torch.ones(()), out_dtype=torch.float16)
    assert per_head.class_key() != per_tensor.class_key() and per_head.signature() != per_tensor.signature()


def test_policy_when_dtype_fp8_e4m3_matches_fp8_calls_only():
    from opdispatch.base._dtypes import dtype_from_name
    from opdispatch.policies import parse_policy

    assert dtype_from_name("fp8_e4m3") is F8 and dtype_from_name("fp8_e4m3fn") is F8
    manager = opdispatch.get_manager()
    before = manager.policy
    manager.set_policy(parse_policy(
        "ops:\n  attention:\n    order: [cpu.flash, reference.math]\n    rules:\n      - name: fp8-oracle\n"
        "        when: {dtype: fp8_e4m3}\n        prefer: [reference.math]\n", "<test>"))
    try:
        gen = torch.Generator().manual_seed(4)
        q, k, v = (_quantized((1, 3, 2, 8), gen) for _ in range(3))
        one = torch.ones(())
        fp8 = opdispatch.explain(q, k, v, q_descale=one, k_descale=one, v_descale=one)
        x = torch.randn(1, 3, 2, 8)
        plain = opdispatch.explain(x, x, x)
    finally:
        manager.set_policy(before)
    assert fp8.chosen_id == "reference.math" and "fp8-oracle" in str(fp8)
    assert plain.chosen_id == "cpu.flash" and "fp8-oracle" not in str(plain)


def test_cli_explain_takes_fp8_e4m3(capsys):
    from opdispatch.tools._cli import main

    assert main(["explain", "--dtype", "fp8_e4m3", "--shape", "1,16,2,8", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "dtype=fp8_e4m3fn" in text and "out_dtype=bf16 descales per tensor" in text
    assert "chosen:  reference.math" in text


@pytest.mark.parametrize("per_head,out_dtype", list(itertools.product((False, True), (None, torch.float16))))
def test_fp8_calls_are_refused_under_compile_with_the_fix(per_head, out_dtype):
    from opdispatch.compile._compile import attention_for_compile

    gen = torch.Generator().manual_seed(5)
    q, k, v = (_quantized((1, 3, 2, 8), gen) for _ in range(3))
    d = torch.ones(1, 2) if per_head else torch.ones(())
    with pytest.raises(ValueError, match="run this call eagerly"):
        attention_for_compile(q, k, v, q_descale=d, k_descale=d, v_descale=d, out_dtype=out_dtype)
