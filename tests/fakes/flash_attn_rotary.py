"""Fake `flash_attn.layers.rotary` (flash-attn 2.8): `apply_rotary_emb` with the real signature and asserts, as an
autograd Function whose backward is the conjugate rotation (as the real one's). Computes with complex numbers,
not with opdispatch's reference formula."""

from __future__ import annotations

import sys
import types

import torch

calls: list = []


def _positions(x, seqlen_offsets, cu_seqlens):
    if cu_seqlens is None:
        b, s = x.shape[:2]
        pos = torch.arange(s).expand(b, s)
        return pos + (seqlen_offsets.long()[:, None] if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets)
    pos = torch.empty(x.shape[0], dtype=torch.long)
    for i, (a, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        off = int(seqlen_offsets[i]) if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
        pos[a:e] = torch.arange(e - a) + off
    return pos


def _rotate(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, conjugate):
    r = 2 * cos.shape[-1]
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    rot = torch.complex(cos[pos].float(), (-1 if conjugate else 1) * sin[pos].float()).unsqueeze(-2)
    head = x[..., :r].float()
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], r // 2, 2).contiguous()) * rot
        out = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(head[..., : r // 2], head[..., r // 2:]) * rot
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


class _ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, seqlen_offsets, cu_seqlens):
        ctx.args = (cos, sin, interleaved, seqlen_offsets, cu_seqlens)
        return _rotate(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, conjugate=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin, interleaved, seqlen_offsets, cu_seqlens = ctx.args
        return _rotate(grad, cos, sin, interleaved, seqlen_offsets, cu_seqlens, conjugate=True), *([None] * 5)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    seqlen_ro, rotary_dim = cos.shape
    assert sin.shape == cos.shape
    assert 2 * rotary_dim <= x.shape[-1], "rotary_dim must be <= headdim"
    assert x.shape[-1] <= 256, "Only support headdim <= 256"
    seqlen = max_seqlen if cu_seqlens is not None else x.shape[1]
    assert cu_seqlens is None or max_seqlen is not None, "If cu_seqlens is passed in, then max_seqlen must be passed"
    assert seqlen_ro >= seqlen, "seqlen_ro must be >= seqlen"
    assert cos.dtype == sin.dtype and x.dtype == cos.dtype, "Input and cos/sin must have the same dtype"
    if isinstance(seqlen_offsets, torch.Tensor):
        assert seqlen_offsets.dtype in (torch.int32, torch.int64)
    else:
        assert seqlen_offsets + seqlen <= seqlen_ro
    assert not inplace
    calls.append(("apply_rotary_emb", dict(interleaved=interleaved, varlen=cu_seqlens is not None)))
    return _ApplyRotaryEmb.apply(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens)


def install(monkeypatch) -> types.ModuleType:
    """Put this fake into sys.modules as `flash_attn.layers.rotary` (with a `flash_attn` package around it)."""
    from tests.fakes import flash_attn as fake_fa2

    layers = types.ModuleType("flash_attn.layers")
    rotary = types.ModuleType("flash_attn.layers.rotary")
    rotary.apply_rotary_emb = apply_rotary_emb
    layers.rotary = rotary
    monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2)
    monkeypatch.setitem(sys.modules, "flash_attn.layers", layers)
    monkeypatch.setitem(sys.modules, "flash_attn.layers.rotary", rotary)
    calls.clear()
    return rotary
