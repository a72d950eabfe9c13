"""Helpers shared by the vendor contract tests (inputs, the reference oracle, fake device properties)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

import opdispatch
from opdispatch.vendors.reference import ReferenceAttention

from tests.conftest import TOLERANCES


def dense_inputs(layout: str, b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
                 gen: torch.Generator, dv: int | None = None) -> tuple[torch.Tensor, ...]:
    dv = dv or d

    def make(s: int, h: int, dim: int) -> torch.Tensor:
        shape = {"bshd": (b, s, h, dim), "bhsd": (b, h, s, dim), "sbhd": (s, b, h, dim)}[layout]
        return torch.randn(*shape, generator=gen).to(dtype)

    return make(sq, hq, d), make(sk, hkv, d), make(sk, hkv, dv)


def varlen_inputs(lens_q: list[int], lens_k: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
                  gen: torch.Generator) -> dict[str, Any]:
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = cu_q if lens_k == lens_q else torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)),
                                                      dtype=torch.int32)
    return dict(q=torch.randn(sum(lens_q), hq, d, generator=gen).to(dtype),
                k=torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype),
                v=torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def reference(call: opdispatch.AttentionCall) -> Any:
    return ReferenceAttention().run(call)


def assert_matches_reference(call: opdispatch.AttentionCall, result: Any) -> None:
    expected = reference(call)
    tol = TOLERANCES[call.dtype]
    if call.return_lse:
        out, lse = result
        ref_out, ref_lse = expected
        assert lse.dtype == torch.float32
        assert lse.shape == ref_lse.shape
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    else:
        out, ref_out = result, expected
    assert out.shape == ref_out.shape and out.dtype == call.dtype
    torch.testing.assert_close(out, ref_out, **tol)


def gpu_props(name: str, *, arch: str | None = None, major: int = 9, minor: int = 4, sms: int = 304,
              memory_gib: int = 192) -> SimpleNamespace:
    props = SimpleNamespace(name=name, major=major, minor=minor, total_memory=memory_gib * 2**30,
                            multi_processor_count=sms)
    if arch is not None:
        props.gcnArchName = arch
    return props


def fake_cuda(monkeypatch: Any, props: SimpleNamespace) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def real_device(vendor: str, arch: str, name: str, **libraries: str) -> opdispatch.DeviceInfo:
    """A non-simulated device of another vendor, as its probe would report it (libraries found on the path)."""
    return opdispatch.DeviceInfo(vendor=vendor, type="cuda", arch=arch, name=name, index=0, libraries=libraries)


def allowed_keys(sq: int, sk: int, causal: bool, window: Any, alignment: str) -> torch.Tensor | None:
    """The test oracles' own bool (sq, sk) matrix of the keys each query sees (None: all), written here from the
    definition (not the library's `allowed_positions`, which it checks): causal and window aligned top-left, or
    bottom-right by seqlen_k - seqlen_q; -1 an unbounded window side."""
    if not causal and window is None:
        return None
    rel = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1)
    if alignment == "bottom_right":
        rel = rel - (sk - sq)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= rel <= 0
    if window is not None:
        if window[0] >= 0:
            ok &= rel >= -window[0]
        if window[1] >= 0:
            ok &= rel <= window[1]
    return ok


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor | None = None,
                 drop: torch.Tensor | None = None, keep: float = 1.0, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 attention over (batch, heads, seq, dim), written from the definition: q (b, h, sq, d), k/v
    (b, hk, sk, d); `allowed` bool and `bias` float broadcast to (b, h, sq, sk). Rows that see no key: output 0,
    LSE -inf (opdispatch's definition). `drop` (b, h, sq, sk) bool keeps, scaled by 1/keep. Returns (out, lse)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    if drop is not None:
        p = p * drop / keep
    return p @ v, lse


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A dense layout's tensor as a (batch, heads, seq, dim) view."""
    return {"bshd": t.transpose(1, 2), "bhsd": t, "sbhd": t.permute(1, 2, 0, 3)}[layout]
