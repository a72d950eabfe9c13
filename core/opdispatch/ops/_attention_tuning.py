"""How `opdispatch tune` and `bench` time the attention op: its presets of cases (`AttentionCase`, in
`_attention_case`) and tuned-table buckets — the `TuningSpec` of attention's `OpSpec` (core/opdispatch/ops/_attention.py
registers it).

It sits below `_attention`: the op's validator comes in as an argument (`attention_tuning(validate_attention)`,
called where the op registers), so nothing here imports the op's module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base._cases import grid
from ..base._ops import BucketFeature, TuningSpec
from ._attention_case import AttentionCase

__all__ = ["PRESETS", "attention_bucket", "attention_preset", "attention_tuning"]


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
