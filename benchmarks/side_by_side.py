"""opdispatch vs torch's own best way to express the same attention call, forward and forward+backward.

For each cell (a kind of call users make) this times `opdispatch.attention` through the default policy and every
way torch itself offers for that call — `F.scaled_dot_product_attention` (torch picks its backend), SDPA with an
explicit boolean or additive mask, `flex_attention` compiled with a block mask and score_mod, and for varlen a
per-sequence SDPA loop and padded SDPA — and reports torch's fastest. Compilation and warm-up are excluded from the
timings (each callable runs `--warmup` times first). Times: CUDA events, median of `--reps`. Errors: max |Δ| of
each output against reference.math (fp32 compute) on the first batch row.

    python benchmarks/side_by_side.py --out side_by_side.json           # GPU, bf16, every cell
    python benchmarks/side_by_side.py --tiny --cells dense,softcap      # CPU smoke run, tiny sizes, fp32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402  (one environment block for every benchmark)

# name: (batch, sq, sk, heads_q, heads_kv, head_dim, head_dim_v, options, modes)
FULL: dict[str, dict[str, Any]] = {
    "dense causal GQA 4:1": dict(b=2, sq=4096, sk=4096, hq=32, hkv=8, d=128, kw=dict(causal=True)),
    "sliding window 1024": dict(b=1, sq=8192, sk=8192, hq=16, hkv=16, d=128, kw=dict(causal=True, window=(1024, 0))),
    "softcap 30": dict(b=2, sq=4096, sk=4096, hq=16, hkv=8, d=128, kw=dict(causal=True, softcap=30.0)),
    "ALiBi MHA": dict(b=2, sq=4096, sk=4096, hq=16, hkv=16, d=128, kw=dict(causal=True), alibi=True),
    "ALiBi GQA 4:1": dict(b=2, sq=4096, sk=4096, hq=32, hkv=8, d=128, kw=dict(causal=True), alibi=True),
    "varlen causal": dict(lens=[3000, 1200, 700, 5000, 2100, 4384], hq=16, hkv=4, d=128, kw=dict(causal=True)),
    "decode GQA 4:1": dict(b=8, sq=1, sk=4096, hq=32, hkv=8, d=128, kw={}, modes=("fwd",)),
    "deterministic": dict(b=2, sq=2048, sk=2048, hq=16, hkv=16, d=128, kw=dict(causal=True, deterministic=True),
                          modes=("fwd+bwd",)),
    "head_dim 64 MHA": dict(b=4, sq=2048, sk=2048, hq=16, hkv=16, d=64, kw=dict(causal=True)),
    "head_dim 72": dict(b=2, sq=4096, sk=4096, hq=16, hkv=16, d=72, kw=dict(causal=True)),
    "head_dim 96": dict(b=2, sq=4096, sk=4096, hq=16, hkv=16, d=96, kw=dict(causal=True)),
    "head_dim 100": dict(b=2, sq=4096, sk=4096, hq=16, hkv=16, d=100, kw=dict(causal=True)),
    "MLA decode 576/512": dict(b=4, sq=1, sk=4096, hq=128, hkv=1, d=576, dv=512, kw={}, modes=("fwd",)),
    # GPT-OSS's attention (64 query heads over 8, head dim 64, a learned sink per head; every other layer windowed
    # to 128 tokens). The row also times opdispatch on the same call without sinks: the epilogue's cost.
    "GPT-OSS sinks": dict(b=1, sq=4096, sk=4096, hq=64, hkv=8, d=64, kw=dict(causal=True), sinks=True),
    "GPT-OSS sinks + window 128": dict(b=1, sq=4096, sk=4096, hq=64, hkv=8, d=64,
                                       kw=dict(causal=True, window=(127, 0)), sinks=True),
}
KEYS = {"dense": "dense causal GQA 4:1", "window": "sliding window 1024", "softcap": "softcap 30",
        "alibi": "ALiBi MHA", "alibi_gqa": "ALiBi GQA 4:1", "varlen": "varlen causal", "decode": "decode GQA 4:1",
        "deterministic": "deterministic", "hd64": "head_dim 64 MHA",
        "hd72": "head_dim 72", "hd96": "head_dim 96", "hd100": "head_dim 100",
        "mla": "MLA decode 576/512", "sinks": "GPT-OSS sinks", "sinks_window": "GPT-OSS sinks + window 128"}


def tiny(cell: dict[str, Any]) -> dict[str, Any]:
    """The same cell with tiny sizes (CPU smoke runs)."""
    cell = dict(cell)
    if "lens" in cell:
        cell["lens"] = [max(1, n // 256) for n in cell["lens"]]
    else:
        cell["b"] = 1
        cell["sq"] = 1 if cell["sq"] == 1 else 24
        cell["sk"] = 24
    ratio = cell["hq"] // cell["hkv"]
    cell["hkv"] = 2 if ratio == 1 else 1
    cell["hq"] = cell["hkv"] * min(ratio, 4)
    if "window" in cell["kw"]:
        cell["kw"] = dict(cell["kw"], window=(6, 0))
    if "dv" in cell:
        cell["d"], cell["dv"] = 36, 32
    return cell


# -- timing -------------------------------------------------------------------------------------------------

def samples_ms(fn: Callable[[], Any], device: torch.device, n: int) -> list[float]:
    """`n` per-call times in milliseconds (CUDA events on a GPU, perf_counter elsewhere)."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return times


OURS, WITHOUT_SINKS = "opdispatch", "opdispatch without sinks"
ROUNDS = 5  # interleaved rounds: every callable is timed in each, in turn, so none sees only a cold or hot GPU


def interleaved_ms(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int, reps: int
                   ) -> dict[str, float | str]:
    """Median milliseconds per call of each callable, timed round-robin: `ROUNDS` rounds of `reps` calls each
    (rounded up), in a rotating order — a GPU's clock and cache state drift over a cell, and timing one callable
    after another biased the comparison by up to ~10% on the same kernel. A callable that raises is reported by
    its error (not fatal: a way torch cannot run here)."""
    result: dict[str, float | str] = {}
    live: dict[str, Callable[[], Any]] = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            live[name] = fn
        except Exception as exc:
            result[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in live}
    per_round = max(1, -(-reps // ROUNDS))
    names = list(live)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)] if names else []:
            samples[name] += samples_ms(live[name], device, per_round)
    result.update({name: statistics.median(values) for name, values in samples.items()})
    return {name: result[name] for name in fns}  # the callers' order


BACK_TO_BACK = 10


def back_to_back_ms(fns: dict[str, Callable[[], Any]], device: torch.device, samples: int,
                    calls: int = BACK_TO_BACK) -> dict[str, float | str]:
    """Milliseconds per call of each callable with `calls` calls between one pair of events (interleaved_ms over
    `samples` such runs): the device's time per call, as a model whose host runs ahead sees it. A callable that
    raises is reported by its error."""
    def batched(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()
        return run

    times = interleaved_ms({name: batched(fn) for name, fn in fns.items()}, device, 1, samples)
    return {name: t / calls if isinstance(t, float) else t for name, t in times.items()}


def write_report(out: Path | None, payload: dict[str, Any], text: str) -> None:
    """The result as JSON at `out` and its markdown beside it (nothing without `out`)."""
    if out is not None:
        out.write_text(json.dumps(payload, indent=1, default=str))
        out.with_suffix(".md").write_text(text)


def ms_text(ms: Any, digits: int = 3) -> str:
    """A time in a table: the number, or the error a callable gave instead."""
    return f"{ms:.{digits}f}" if isinstance(ms, float) else str(ms)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def sdpa_backend(inputs: dict[str, Any]) -> str:
    """The backend torch's SDPA picks for the plain call (`torch._fused_sdp_choice`): which kernel "SDPA" is."""
    qt, kt, vt = (inputs[name].transpose(1, 2) for name in ("q", "k", "v"))
    try:
        choice = torch._fused_sdp_choice(qt, kt, vt, None, 0.0, inputs["kw"].get("causal", False),
                                         enable_gqa=qt.shape[1] != kt.shape[1])
        return str(torch.nn.attention.SDPBackend(choice).name)
    except Exception as exc:  # a private torch function: its absence is reported, not fatal
        return f"unknown ({type(exc).__name__})"


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples_ms(fn, device, reps))


# -- inputs and torch's ways --------------------------------------------------------------------------------

def alibi_slopes(heads: int, device: torch.device) -> torch.Tensor:
    """The ALiBi paper's geometric slopes (power-of-two head counts)."""
    start = 2.0 ** (-8.0 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)], dtype=torch.float32, device=device)


def make_inputs(cell: dict[str, Any], device: torch.device, dtype: torch.dtype, grad: bool) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    d, dv = cell["d"], cell.get("dv", cell["d"])

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    if "lens" in cell:
        total = sum(cell["lens"])
        cu = torch.tensor([0, *torch.tensor(cell["lens"]).cumsum(0).tolist()], dtype=torch.int32, device=device)
        kw = dict(cell["kw"], layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(cell["lens"]),
                  max_seqlen_k=max(cell["lens"]))
        return dict(q=t(total, cell["hq"], d), k=t(total, cell["hkv"], d), v=t(total, cell["hkv"], dv), kw=kw)
    kw = dict(cell["kw"])
    if cell.get("alibi"):
        kw["alibi_slopes"] = alibi_slopes(cell["hq"], device)
    if cell.get("sinks"):  # trained sinks are O(1) logits, some positive: they change every row
        sinks = torch.randn(cell["hq"], generator=gen, device=device, dtype=torch.float32) * 2
        kw["sinks"] = sinks.requires_grad_(grad)
    return dict(q=t(cell["b"], cell["sq"], cell["hq"], d), k=t(cell["b"], cell["sk"], cell["hkv"], d),
                v=t(cell["b"], cell["sk"], cell["hkv"], dv), kw=kw)


def _positions(sq: int, sk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(sq, device=device)[:, None], torch.arange(sk, device=device)[None, :]


def torch_ways(inputs: dict[str, Any], device: torch.device, compile_flex: bool) -> dict[str, Callable[[], Any]]:
    """Every way torch itself can compute this call, as zero-argument callables over bhsd views."""
    q, k, v, kw = inputs["q"], inputs["k"], inputs["v"], inputs["kw"]
    causal, window, softcap = kw.get("causal", False), kw.get("window"), kw.get("softcap", 0.0)
    slopes = kw.get("alibi_slopes")
    ways: dict[str, Callable[[], Any]] = {}
    if kw.get("layout") == "thd":
        cu = kw["cu_seqlens_q"].tolist()
        spans = list(zip(cu, cu[1:]))
        gqa = q.shape[1] != k.shape[1]

        def per_sequence() -> torch.Tensor:
            outs = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                                   v[a:b].transpose(0, 1)[None], is_causal=causal,
                                                   enable_gqa=gqa)[0].transpose(0, 1) for a, b in spans]
            return torch.cat(outs)

        ways["SDPA per sequence"] = per_sequence
        longest = max(b - a for a, b in spans)
        index = torch.cat([torch.arange(a, b, device=device) for a, b in spans])
        rows = torch.cat([torch.full((b - a,), i, device=device) for i, (a, b) in enumerate(spans)])
        cols = torch.cat([torch.arange(b - a, device=device) for a, b in spans])
        lengths = torch.tensor([b - a for a, b in spans], device=device)
        i, j = _positions(longest, longest, device)
        mask = (j[None] < lengths[:, None, None]) & ((j <= i)[None] if causal else True)
        mask = mask | (i[None] >= lengths[:, None, None])  # padded queries see something: no NaN rows

        def padded() -> torch.Tensor:
            def pad(t: torch.Tensor) -> torch.Tensor:
                out = t.new_zeros(len(spans), longest, *t.shape[1:])
                out[rows, cols] = t[index]
                return out.transpose(1, 2)
            o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask[:, None], enable_gqa=gqa)
            return o.transpose(1, 2)[rows, cols]

        ways["SDPA padded + mask"] = padded
        return ways

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sq, sk = qt.shape[2], kt.shape[2]
    gqa = qt.shape[1] != kt.shape[1]
    scale = kw.get("scale")
    if kw.get("sinks") is not None:
        return _sink_ways(qt, kt, vt, kw["sinks"], causal, window, gqa, device, compile_flex)
    plain = window is None and slopes is None and not softcap
    if plain:
        ways["SDPA"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    if not softcap:
        i, j = _positions(sq, sk, device)
        keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if causal:
            keep &= j <= i
        if window is not None:
            keep &= j >= i - window[0]
        if slopes is not None:
            bias = (-slopes[:, None, None] * (i - j).abs()[None].float()).masked_fill(~keep, float("-inf"))
            bias = bias[None].to(q.dtype)
            ways["SDPA + additive bias"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias,
                                                                                   enable_gqa=gqa)
        elif window is not None:
            ways["SDPA + boolean mask"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep,
                                                                                  enable_gqa=gqa)
    # flex only where SDPA needs a materialised mask or cannot express the call (plain causal: SDPA's own kernels).
    if (window is not None or slopes is not None or softcap) and qt.shape[-1] >= 16:
        ways["flex_attention"] = _flex_way(qt, kt, vt, causal, window, softcap, slopes, gqa, scale, device,
                                           compile_flex)
    return ways


def _sink_ways(qt, kt, vt, sinks, causal, window, gqa, device, compile_flex):  # noqa: ANN001
    """torch's ways to give each row's softmax a virtual key scored by its head's sink, with a zero value: SDPA over
    the keys plus a zero key whose additive bias is the sink; flex_attention's LSE and the rescale
    out * sigmoid(lse - sink); and what transformers' eager GPT-OSS does (the sink as a logit column, softmax, drop)."""
    b, hk, sk, d = kt.shape
    sq, hq = qt.shape[2], qt.shape[1]
    i, j = _positions(sq, sk, device)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i + (sk - sq)
    if window is not None:
        keep &= j >= i + (sk - sq) - window[0]
    blocked = torch.zeros(sq, sk, device=device, dtype=qt.dtype).masked_fill(~keep, float("-inf"))
    zero_kv = kt.new_zeros(b, hk, 1, d)

    def sdpa_sink_column() -> torch.Tensor:
        column = sinks.to(qt.dtype)[None, :, None, None].expand(1, hq, sq, 1)
        bias = torch.cat([blocked[None, None].expand(1, hq, sq, sk), column], dim=-1)
        return F.scaled_dot_product_attention(qt, torch.cat([kt, zero_kv], 2), torch.cat([vt, zero_kv], 2),
                                              attn_mask=bias, enable_gqa=gqa)

    def eager() -> torch.Tensor:
        kr, vr = (t.repeat_interleave(hq // hk, dim=1) for t in (kt, vt))
        logits = (qt @ kr.transpose(-1, -2)) * d ** -0.5 + blocked
        logits = torch.cat([logits, sinks.to(logits.dtype)[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
        probs = torch.softmax(logits.float(), dim=-1)[..., :-1].to(vr.dtype)
        return probs @ vr

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention) if compile_flex else flex_attention
    offset = sk - sq

    def mask_mod(b, h, i, j):  # noqa: ANN001
        ok = j <= i + offset if causal else j >= 0
        if window is not None:
            ok = ok & (j >= i + offset - window[0])
        return ok

    block_mask = create_block_mask(mask_mod, None, None, sq, sk, device=device, _compile=compile_flex)

    def flex_lse_rescale() -> torch.Tensor:
        out, lse = flex(qt, kt, vt, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
        return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)

    return {"SDPA + sink column": sdpa_sink_column, "flex_attention + LSE rescale": flex_lse_rescale,
            "eager (transformers GPT-OSS)": eager}


def _flex_way(qt, kt, vt, causal, window, softcap, slopes, gqa, scale, device, compile_flex):  # noqa: ANN001
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention) if compile_flex else flex_attention

    def mask_mod(b, h, i, j):  # noqa: ANN001
        keep = j <= i if causal else j >= 0
        if window is not None:
            keep = keep & (j >= i - window[0])
        return keep

    block_mask = create_block_mask(mask_mod, None, None, qt.shape[2], kt.shape[2], device=device,
                                   _compile=compile_flex) if (causal or window is not None) else None

    def score_mod(score, b, h, i, j):  # noqa: ANN001
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (i - j).abs()
        return score

    use_score = softcap or slopes is not None
    return lambda: flex(qt, kt, vt, score_mod=score_mod if use_score else None, block_mask=block_mask,
                        enable_gqa=gqa, scale=scale)


def to_bshd(out: Any, layout_thd: bool) -> torch.Tensor:
    return out if layout_thd else out.transpose(1, 2)


# -- one cell -----------------------------------------------------------------------------------------------

def run_cell(name: str, cell: dict[str, Any], mode: str, device: torch.device, dtype: torch.dtype,
             warmup: int, reps: int, compile_flex: bool) -> dict[str, Any]:
    grad = mode == "fwd+bwd"
    inputs = make_inputs(cell, device, dtype, grad)
    q, k, v, kw = inputs["q"], inputs["k"], inputs["v"], inputs["kw"]
    thd = kw.get("layout") == "thd"
    row: dict[str, Any] = {"cell": name, "mode": mode}
    row["pick"] = opdispatch.explain(q, k, v, **kw).chosen_id
    ours = lambda: opdispatch.attention(q, k, v, **kw)  # noqa: E731
    ways = torch_ways(inputs, device, compile_flex)
    if grad:
        grad_out = torch.randn_like(ours())

        def with_backward(fn: Callable[[], Any], bshd: bool) -> Callable[[], Any]:
            def step() -> None:
                out = fn()
                out = out if bshd else to_bshd(out, thd)
                out.backward(grad_out)
            return step

        timed_ours = with_backward(ours, True)
        timed_ways = {n: with_backward(f, False) for n, f in ways.items()}
    else:
        timed_ours, timed_ways = ours, ways
    candidates: dict[str, Callable[[], Any]] = {OURS: timed_ours}
    if kw.get("sinks") is not None:  # what the sinks cost opdispatch: the same call without them
        plain = {n: a for n, a in kw.items() if n != "sinks"}
        row["pick_without_sinks"] = opdispatch.explain(q, k, v, **plain).chosen_id
        without = lambda: opdispatch.attention(q, k, v, **plain)  # noqa: E731
        candidates[WITHOUT_SINKS] = with_backward(without, True) if grad else without
    candidates.update(timed_ways)
    row["torch_sdpa_backend"] = sdpa_backend(inputs) if "SDPA" in ways else None
    # torch's way to ask for determinism is the global flag (it changes kernels and inductor's choices); a user
    # who sets it gets it for opdispatch too, so both sides run under it (opdispatch also gets deterministic=True).
    def flag() -> contextlib.AbstractContextManager[None]:
        return deterministic_algorithms() if kw.get("deterministic") else contextlib.nullcontext()

    with flag():
        if kw.get("deterministic"):
            row["pick"] = opdispatch.explain(q, k, v, **kw).chosen_id
        times = interleaved_ms(candidates, device, warmup, reps)
    row["opdispatch_ms"] = times.pop(OURS)
    if isinstance(row["opdispatch_ms"], str):
        raise RuntimeError(f"opdispatch: {row['opdispatch_ms']}")  # the row reports the cell as failed
    if WITHOUT_SINKS in times:
        row["opdispatch_without_sinks_ms"] = times.pop(WITHOUT_SINKS)
    row["torch_ms"] = times
    measured = {w: t for w, t in row["torch_ms"].items() if isinstance(t, float)}
    if measured:
        best = min(measured, key=measured.get)
        row["torch_best"], row["torch_best_ms"] = best, measured[best]
        row["speedup"] = measured[best] / row["opdispatch_ms"]
        # Back to back (events around BACK_TO_BACK calls): the device's time per call, as a model whose host runs
        # ahead sees it; per call above, the host's time before the launch shows too (the device is idle).
        with flag():
            pair = back_to_back_ms({OURS: timed_ours, best: timed_ways[best]}, device, 2 * ROUNDS)
        ours_b2b, best_b2b = pair[OURS], pair[best]
        if isinstance(ours_b2b, float) and isinstance(best_b2b, float):
            row["back_to_back_ms"] = pair
            row["back_to_back_speedup"] = best_b2b / ours_b2b
    row["errors"] = errors(q, k, v, kw, ours, ways.get(row.get("torch_best", ""), None), thd)
    return row


def errors(q, k, v, kw, ours, best, thd):  # noqa: ANN001
    """max |Δ| against reference.math on the first batch row (the whole call for varlen)."""
    with torch.no_grad():
        if thd:
            ref = opdispatch.attention(q, k, v, impl="reference.math", **kw).float()
            got = {"opdispatch": ours().float()}
            if best is not None:
                got["torch"] = best().float()
        else:
            one = {name: value[:1] if name == "alibi_slopes" and value.dim() == 2 else value
                   for name, value in kw.items()}
            ref = opdispatch.attention(q[:1], k[:1], v[:1], impl="reference.math", **one).float()
            got = {"opdispatch": ours()[:1].float()}
            if best is not None:
                got["torch"] = to_bshd(best(), False)[:1].float()
    return {name: (out - ref).abs().max().item() for name, out in got.items()}


# -- report -------------------------------------------------------------------------------------------------

def markdown(rows: list[dict[str, Any]], env: dict[str, Any], dtype: str) -> str:
    lines = ["# opdispatch vs torch's best way, side by side", "",
             f"{env['device']}; torch {env['torch']}" + (f", CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}"
                                                         if "cuda" in env else "")
             + (f", triton {env['triton']}" if "triton" in env else "") + f"; {dtype}"
             + f"; fast path {env.get('fast_path')}; commit {env.get('commit')}",
             "", "| cell | mode | opdispatch pick | opdispatch ms | torch's best way | torch ms | torch / opdispatch "
             "| back to back: torch / opdispatch | max err opd / torch | other torch ways |",
             "|---|---|---|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['cell']} | {r['mode']} | {r.get('pick', '-')} | failed: {r['failed']} | | | | | | |")
            continue
        others = "; ".join(f"{w} {t:.3f}" if isinstance(t, float) else f"{w}: {t}" for w, t in r["torch_ms"].items()
                           if w != r.get("torch_best"))
        if "opdispatch_without_sinks_ms" in r:
            others += (f"; opdispatch without sinks {r['opdispatch_without_sinks_ms']:.3f} "
                       f"({r['pick_without_sinks']})")
        speed = r.get("speedup")
        flag = "" if speed is None or speed >= 0.97 else " **slower**"
        backend = f" ({r['torch_sdpa_backend']})" if r.get("torch_best") == "SDPA" and r.get(
            "torch_sdpa_backend") else ""
        b2b = "-"
        if "back_to_back_ms" in r:
            ratio = r["back_to_back_speedup"]
            b2b = f"{ratio:.2f}x" + (" **slower**" if ratio < 0.97 else "") + (
                f" ({r['back_to_back_ms']['opdispatch']:.3f} ms)")
        errs = " / ".join(f"{r['errors'].get(n, float('nan')):.3g}" for n in ("opdispatch", "torch"))
        lines.append(f"| {r['cell']} | {r['mode']} | {r['pick']} | {r['opdispatch_ms']:.3f} | "
                     f"{r.get('torch_best', '-')}{backend} | {r.get('torch_best_ms', math.nan):.3f} | "
                     f"{'-' if speed is None else f'{speed:.2f}x'}{flag} | {b2b} | {errs} | {others} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU in fp32 (smoke run)")
    p.add_argument("--cells", help="comma-separated cell keys: " + ",".join(KEYS))
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, help="JSON here, markdown beside it")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    keys = args.cells.split(",") if args.cells else list(KEYS)
    unknown = [key for key in keys if key not in KEYS]
    if unknown:
        p.error(f"unknown cells {unknown}; known: {', '.join(KEYS)}")
    env = environment(device)
    rows = []
    for key in keys:
        name = KEYS[key]
        cell = tiny(FULL[name]) if args.tiny else FULL[name]
        modes = [m for m in cell.get("modes", ("fwd", "fwd+bwd")) if not (args.fwd_only and m != "fwd")]
        for mode in modes:
            try:
                row = run_cell(name, cell, mode, device, dtype, args.warmup, args.reps,
                               compile_flex=device.type != "cpu")
            except Exception as exc:  # one cell's failure (OOM, unsupported) is reported in its row
                row = {"cell": name, "mode": mode, "failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                traceback.print_exc(file=sys.stderr)
            rows.append(row)
            print(json.dumps(row, default=str), file=sys.stderr, flush=True)
            # after every row: a run cut short by its time limit still leaves its table
            write_report(args.out, {"environment": env, "rows": rows}, markdown(rows, env, str(dtype)[6:]))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = markdown(rows, env, str(dtype)[6:])
    sys.stdout.write(text)
    write_report(args.out, {"environment": env, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
