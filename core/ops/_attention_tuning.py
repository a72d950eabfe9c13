"""How `opdispatch tune` and `bench` time the attention op: its case (a call signature without data), presets and
tuned-table buckets — the `TuningSpec` of attention's `OpSpec` (core/ops/_attention.py registers it).

It sits below `_attention`: the op's validator comes in as an argument (`attention_tuning(validate_attention)`,
called where the op registers), so nothing here imports the op's module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..base._ops import BucketFeature, TuningSpec
from ..base._cases import grid, known_fields, random_tensor

__all__ = ["AttentionCase", "PRESETS", "attention_bucket", "attention_preset", "attention_tuning"]


@dataclass(frozen=True)
class AttentionCase:
    """A call signature to time: the shapes and flags of one attention call, without data.

    `layout` is ``bshd`` (dense) or ``thd`` (packed varlen: `batch` sequences, the longest `seqlen_q`). A causal
    call with seqlen_q != seqlen_k is aligned bottom-right (decode: the new tokens see the whole cache).
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
        return out

    def describe(self) -> str:
        if self.name:
            return self.name
        parts = [self.dtype, "varlen" if self.layout == "thd" else "dense", f"b{self.batch}",
                 f"q{self.seqlen_q}", f"k{self.seqlen_k}", f"h{self.heads_q}/{self.heads_kv}", f"d{self.head_dim}"]
        if self.causal:
            parts.append("causal")
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

    def inputs(self, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]:
        """Fresh random inputs: keyword arguments for `opdispatch.attention` / `validate_attention`."""
        from ..base._dtypes import dtype_from_name

        dtype = dtype_from_name(self.dtype)
        device = torch.device(device)

        def rand(*shape: int) -> torch.Tensor:
            return random_tensor(shape, dtype, device, generator, self.requires_grad)

        kw: dict[str, Any] = dict(causal=self.causal, softcap=self.softcap)
        if self.window is not None:
            kw["window"] = tuple(self.window)
        if self.causal and self.seqlen_q != self.seqlen_k:
            kw["causal_alignment"] = "bottom_right"
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
        pairs = sum(_allowed_pairs(a, b, self.causal, self.window) for a, b in zip(lq, lk))
        forward = 2.0 * pairs * (self.head_dim + self.head_dim) * self.heads_q
        return forward * (3.5 if self.requires_grad else 1.0)


def _cumulative(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32, device=device)


def _allowed_pairs(sq: int, sk: int, causal: bool, window: tuple[int, int] | None) -> int:
    """How many (query, key) pairs a call with these lengths computes (bottom-right alignment when causal)."""
    if not causal and window is None:
        return sq * sk
    offset = sk - sq if causal else 0
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


# -- presets -----------------------------------------------------------------------------------------------------

def _heads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        row = dict(row)
        row["heads_q"], row["heads_kv"], row["head_dim"] = row.pop("heads")
        out.append(row)
    return out


def attention_preset(name: str, device_type: str = "cuda") -> list[AttentionCase]:
    """A preset list of attention cases: ``decode``, ``prefill`` or ``training``.

    Accelerators get bf16 model-sized shapes; the CPU gets float32 shapes small enough to time in seconds.
    """
    cpu = device_type == "cpu"
    dtype = "fp32" if cpu else "bf16"
    heads = [(8, 2, 64), (8, 8, 64)] if cpu else [(32, 8, 128), (32, 32, 128), (16, 16, 64)]
    if name == "decode":
        rows = grid(batch=[1, 4] if cpu else [1, 8, 64], seqlen_k=[256, 1024] if cpu else [1024, 8192],
                     heads=heads)
        return [AttentionCase(dtype=dtype, seqlen_q=1, causal=True, **r) for r in _heads(rows)]
    if name == "prefill":
        seqs = [64, 256] if cpu else [512, 2048, 8192]
        rows = grid(batch=[1, 2] if cpu else [1, 4], seqlen_q=seqs, heads=heads)
        specs = [AttentionCase(dtype=dtype, causal=True, seqlen_k=r["seqlen_q"], **r) for r in _heads(rows)]
        h, hkv, d = heads[0]
        long = seqs[-1]
        specs += [
            AttentionCase(dtype=dtype, layout="thd", batch=4 if cpu else 8, seqlen_q=long, seqlen_k=long, heads_q=h,
                     heads_kv=hkv, head_dim=d, causal=True),
            AttentionCase(dtype=dtype, batch=1, seqlen_q=long, seqlen_k=long, heads_q=h, heads_kv=hkv, head_dim=d,
                     causal=True, window=(long // 4, 0)),
            AttentionCase(dtype=dtype, batch=1, seqlen_q=long, seqlen_k=long, heads_q=h, heads_kv=hkv, head_dim=d,
                     causal=True, softcap=50.0),
        ]
        return specs
    if name == "training":
        rows = grid(batch=[1, 2] if cpu else [2, 8], seqlen_q=[64, 128] if cpu else [1024, 4096],
                     heads=heads[:2])
        return [AttentionCase(dtype=dtype, causal=True, requires_grad=True, seqlen_k=r["seqlen_q"], **r)
                for r in _heads(rows)]
    raise ValueError(f"unknown attention preset {name!r}; allowed: {', '.join(PRESETS)}")


PRESETS = ("decode", "prefill", "training")


# -- buckets -----------------------------------------------------------------------------------------------------

DISCRETE = (BucketFeature("dtype", str), BucketFeature("layout", str, choices=("dense", "varlen")),
            BucketFeature("head_dim", int), BucketFeature("heads_q", int), BucketFeature("heads_kv", int),
            BucketFeature("causal", bool), BucketFeature("window", bool, False), BucketFeature("softcap", bool, False),
            BucketFeature("requires_grad", bool, False))
SIZES = ("seqlen_q", "seqlen_k", "batch")


def bucket_discrete(call: Any) -> tuple[Any, ...]:
    from ..base._dtypes import dtype_name

    return (dtype_name(call.dtype), "varlen" if call.layout == "thd" else "dense", call.head_dim, call.heads_q,
            call.heads_kv, bool(call.causal), call.window is not None, call.softcap > 0, bool(call.requires_grad))


def bucket_sizes(call: Any) -> tuple[int, ...]:
    return (call.seqlen_q, call.seqlen_k, call.batch)


def attention_bucket(call: Any) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """(discrete features, (seqlen_q, seqlen_k, batch)) of an AttentionCall — what a tuned bucket is keyed by."""
    return bucket_discrete(call), bucket_sizes(call)


def describe_bucket(discrete: tuple[Any, ...], sizes: tuple[int, ...]) -> str:
    d = {f.name: v for f, v in zip(DISCRETE, discrete)}
    flags = [k for k in ("causal", "window", "softcap", "requires_grad") if d[k]]
    return (f"{d['dtype']}/{d['layout']} d{d['head_dim']} h{d['heads_q']}/{d['heads_kv']}"
            f"{' ' + ','.join(flags) if flags else ''} q{sizes[0]} k{sizes[1]} b{sizes[2]}")


def attention_tuning(validate: Callable[..., Any]) -> TuningSpec:
    """Attention's `TuningSpec`, with `validate` (`validate_attention`) as the validator cases are called with."""
    return TuningSpec(case=AttentionCase, presets=PRESETS, preset=attention_preset, validate=validate,
                      discrete=DISCRETE, bucket_discrete=bucket_discrete, sizes=SIZES, bucket_sizes=bucket_sizes,
                      describe_bucket=describe_bucket)
