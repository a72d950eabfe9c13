"""Attention's case: the shapes, dtype and flags of one attention call, without data — the one record of it.

`opdispatch tune` and `bench` time cases (`_attention_tuning`'s presets, or a YAML file of them), and
`opdispatch validate` builds each cell of its conformance matrix around one (`core/opdispatch/tools/_validate.py`, which
adds what only a conformance check has: KV caches, masks, biases, strided views, per-sequence lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..base._cases import known_fields, random_tensor

__all__ = ["AttentionCase"]


@dataclass(frozen=True)
class AttentionCase:
    """A call signature: the shapes and flags of one attention call, without data.

    `layout` is ``bshd``, ``bhsd``, ``sbhd`` (dense) or ``thd`` (packed varlen: `batch` sequences, the first and
    longest of `seqlen_q`/`seqlen_k` tokens). `causal_alignment` left ``None``: a causal call with
    seqlen_q != seqlen_k is aligned bottom-right (decode: the new tokens see the whole cache), else top-left.
    """

    dtype: str = "bf16"
    layout: str = "bshd"
    batch: int = 1
    seqlen_q: int = 128
    seqlen_k: int = 128
    heads_q: int = 8
    heads_kv: int = 8
    head_dim: int = 64
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    requires_grad: bool = False
    name: str = ""
    causal_alignment: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> AttentionCase:
        data = known_fields(cls, data, where)
        if data.get("window") is not None:
            data["window"] = tuple(int(x) for x in data["window"])
        data.setdefault("seqlen_k", data.get("seqlen_q", cls.seqlen_k))
        data.setdefault("heads_kv", data.get("heads_q", cls.heads_kv))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["window"] is not None:
            out["window"] = list(out["window"])
        if out["causal_alignment"] is None:  # the default rule: a case file need not name it
            del out["causal_alignment"]
        return out

    def alignment(self) -> str:
        """The causal alignment the call is made with (see the class docstring)."""
        if self.causal_alignment is not None:
            return self.causal_alignment
        return "bottom_right" if self.causal and self.seqlen_q != self.seqlen_k else "top_left"

    def describe(self) -> str:
        if self.name:
            return self.name
        parts = [self.dtype, "varlen" if self.layout == "thd" else "dense", f"b{self.batch}",
                 f"q{self.seqlen_q}", f"k{self.seqlen_k}", f"h{self.heads_q}/{self.heads_kv}", f"d{self.head_dim}"]
        if self.causal:
            parts.append("causal" if self.causal_alignment is None else f"causal({self.causal_alignment})")
        if self.window:
            parts.append(f"win{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.requires_grad:
            parts.append("fwd+bwd")
        return " ".join(parts)

    def seq_lengths(self) -> tuple[list[int], list[int]]:
        """Per-sequence (q, k) lengths: all equal for dense; uneven for varlen, the first being the longest."""
        if self.layout != "thd":
            return [self.seqlen_q] * self.batch, [self.seqlen_k] * self.batch
        fractions = [1.0, 0.5, 0.75, 0.625, 0.875, 0.5625, 0.8125, 0.6875]
        q = [max(1, int(self.seqlen_q * fractions[i % len(fractions)])) for i in range(self.batch)]
        k = [max(1, int(self.seqlen_k * fractions[i % len(fractions)])) for i in range(self.batch)]
        return q, k

    def flags(self) -> dict[str, Any]:
        """The call's keyword flags (causal, its alignment where not top-left, window, softcap) for the op."""
        kw: dict[str, Any] = dict(causal=self.causal, softcap=self.softcap)
        if self.window is not None:
            kw["window"] = tuple(self.window)
        if self.alignment() != "top_left":
            kw["causal_alignment"] = self.alignment()
        return kw

    def inputs(self, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]:
        """Fresh random inputs for timing: keyword arguments for `opdispatch.attention` / `validate_attention`
        (bshd or thd; the varlen sequences of uneven lengths, `seq_lengths`)."""
        from ..base._dtypes import dtype_from_name

        dtype = dtype_from_name(self.dtype)
        device = torch.device(device)

        def rand(*shape: int) -> torch.Tensor:
            return random_tensor(shape, dtype, device, generator, self.requires_grad)

        kw = self.flags()
        if self.layout == "thd":
            lq, lk = self.seq_lengths()
            kw.update(layout="thd", q=rand(sum(lq), self.heads_q, self.head_dim),
                      k=rand(sum(lk), self.heads_kv, self.head_dim), v=rand(sum(lk), self.heads_kv, self.head_dim),
                      cu_seqlens_q=_cumulative(lq, device), cu_seqlens_k=_cumulative(lk, device),
                      max_seqlen_q=max(lq), max_seqlen_k=max(lk))
            if lq == lk and self.seqlen_q == self.seqlen_k:
                kw["cu_seqlens_k"] = kw["cu_seqlens_q"]
        elif self.layout == "bshd":
            kw.update(layout="bshd", q=rand(self.batch, self.seqlen_q, self.heads_q, self.head_dim),
                      k=rand(self.batch, self.seqlen_k, self.heads_kv, self.head_dim),
                      v=rand(self.batch, self.seqlen_k, self.heads_kv, self.head_dim))
        else:
            raise ValueError(f"shape {self.describe()}: layout {self.layout!r} cannot be tuned; use bshd or thd")
        return kw

    def flops(self) -> float:
        """Floating-point operations of the call (2 per multiply-add; backward counted as 2.5x forward)."""
        lq, lk = self.seq_lengths()
        bottom_right = self.alignment() == "bottom_right"
        pairs = sum(_allowed_pairs(a, b, self.causal, self.window, bottom_right) for a, b in zip(lq, lk))
        forward = 2.0 * pairs * (self.head_dim + self.head_dim) * self.heads_q
        return forward * (3.5 if self.requires_grad else 1.0)


def _cumulative(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32, device=device)


def _allowed_pairs(sq: int, sk: int, causal: bool, window: tuple[int, int] | None, bottom_right: bool = True) -> int:
    """How many (query, key) pairs a call with these lengths computes (`bottom_right`: the diagonal ends at the
    last key)."""
    if not causal and window is None:
        return sq * sk
    offset = sk - sq if bottom_right else 0
    total = 0
    for i in range(sq):
        lo, hi = 0, sk - 1
        centre = i + offset
        if causal:
            hi = min(hi, centre)
        if window is not None:
            left, right = window
            if left >= 0:
                lo = max(lo, centre - left)
            if right >= 0 and not causal:
                hi = min(hi, centre + right)
        total += max(0, hi - lo + 1)
    return total
