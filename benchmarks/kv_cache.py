"""KV-cache attention on a GPU: what each kernel takes, whether it computes the right thing, and a decode step's cost.

Run on the GPU machine (see benchmarks/gpu_tests.sh for the setup): ``python3 benchmarks/kv_cache.py``.

1. Probes: torch's ``_flash_attention_forward`` with ``seqused_k`` and with ``block_table`` at several page sizes
   (the page-size rule of torch's vendored FlashAttention-2 is not documented), each checked against a float64
   per-sequence oracle.
2. Through ``opdispatch.attention``: the implementation chosen for a decode step over a dense cache and over paged
   caches (16 and 256 keys per page), and each KV-capable implementation pinned, checked against the oracle.
3. Paged varlen (chunked prefill: packed queries of several lengths over paged caches, ``cu_seqlens_q`` with
   ``seqused_k`` and ``block_table``): the implementation chosen, each one pinned, against torch's best way — the
   used pages gathered into packed keys through an index built once, then FlashAttention-2's varlen kernel.
4. A call's time, two ways: "step" — one call between CUDA events, synchronised (what one call costs
   including its host-side work while the GPU waits); "in a loop" — 100 calls issued back to back, then one
   synchronise (what a decode loop sustains when the host runs ahead). Baselines: torch SDPA over keys gathered
   into a dense tensor with the fill as a mask, the mask built once outside the timing (a caller that shares it
   across layers) and built on every call.

   And "first call": the path's first call in the process, synchronised (a graph build or a compile shows here;
   later paths that share the kernel find it built).

nvidia.cudnn_frontend (with the nvidia-cudnn-frontend wheel) takes these KV-cache calls by default (option
``kv_cache``: its padding-mask graph holds for every fill), dense and paged (pages of a multiple of 32 keys): the
rows the policy's KV-cache rule is measured on. ``--batch N`` sets the batch (default 8), ``--decode-only`` skips
the probes and the paged varlen part, ``--impls a,b`` times only those pinned implementations beside the pick.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import statistics
import subprocess
import sys
import time

import torch

import opdispatch

DEV = "cuda"
DT = torch.bfloat16
B, HQ, HK, D, CAP = 8, 32, 8, 128, 4096  # B: --batch
IMPLS: set[str] | None = None  # --impls: the pinned implementations timed (None: every eligible one)


def oracle(q, k_seqs, v_seqs):
    """q (b, 1, hq, d); per-sequence keys (n, hk, d) → (b, 1, hq, d) float64, bottom-right causal (decode)."""
    outs = []
    for i in range(q.shape[0]):
        qi = q[i].double().transpose(0, 1)  # (hq, 1, d)
        ki = k_seqs[i].double().transpose(0, 1).repeat_interleave(HQ // HK, 0)
        vi = v_seqs[i].double().transpose(0, 1).repeat_interleave(HQ // HK, 0)
        if ki.shape[1] == 0:
            outs.append(torch.zeros(1, HQ, D, dtype=torch.float64, device=q.device))
            continue
        p = torch.softmax(qi @ ki.transpose(-1, -2) / math.sqrt(D), -1)
        outs.append((p @ vi).transpose(0, 1))
    return torch.stack(outs)


def make_cache(gen, page_size=None):
    used = torch.randint(CAP // 2, CAP, (B,), generator=gen, device="cpu").to(torch.int32)
    used[0] = 1  # one sequence just started
    k_seqs = [torch.randn(int(n), HK, D, device=DEV, dtype=DT) for n in used]
    v_seqs = [torch.randn(int(n), HK, D, device=DEV, dtype=DT) for n in used]
    q = torch.randn(B, 1, HQ, D, device=DEV, dtype=DT)
    if page_size is None:
        k = torch.randn(B, CAP, HK, D, device=DEV, dtype=DT)
        v = torch.randn(B, CAP, HK, D, device=DEV, dtype=DT)
        for i, n in enumerate(used.tolist()):
            k[i, :n], v[i, :n] = k_seqs[i], v_seqs[i]
        return q, k, v, dict(seqused_k=used.to(DEV)), k_seqs, v_seqs
    per_seq = CAP // page_size
    pages = B * per_seq + 4
    order = torch.randperm(pages, generator=gen)[: B * per_seq].view(B, per_seq).to(torch.int32)
    k = torch.randn(pages, page_size, HK, D, device=DEV, dtype=DT)
    v = torch.randn(pages, page_size, HK, D, device=DEV, dtype=DT)
    for i, n in enumerate(used.tolist()):
        for p in range(-(-n // page_size)):
            rows = slice(p * page_size, min((p + 1) * page_size, n))
            k[order[i, p], : rows.stop - rows.start] = k_seqs[i][rows]
            v[order[i, p], : rows.stop - rows.start] = v_seqs[i][rows]
    return q, k, v, dict(seqused_k=used.to(DEV), block_table=order.to(DEV)), k_seqs, v_seqs


def err(out, want):
    return (out.double() - want).abs().max().item()


def probe_torch_flash(gen):
    print("## torch _flash_attention_forward with seqused_k / block_table")
    fwd = torch.ops.aten._flash_attention_forward.default
    names = [a.name for a in fwd._schema.arguments]
    print(f"schema has seqused_k: {'seqused_k' in names}, block_table: {'block_table' in names}")
    for page_size in (None, 16, 64, 128, 256):
        q, k, v, kw, ks, vs = make_cache(gen, page_size)
        used = kw["seqused_k"]
        cu_q = torch.arange(B + 1, device=DEV, dtype=torch.int32)
        extra = {}
        if page_size is None:
            kk, vv = k.reshape(-1, HK, D), v.reshape(-1, HK, D)
            cu_k = torch.arange(B + 1, device=DEV, dtype=torch.int32) * CAP
        else:
            kk, vv = k, v
            cu_k = torch.nn.functional.pad(used.cumsum(0, dtype=torch.int32), (1, 0))
            extra["block_table"] = kw["block_table"]
        try:
            res = fwd(q.reshape(B, HQ, D), kk, vv, cu_q, cu_k, 1, CAP, 0.0, True, False, scale=D ** -0.5,
                      seqused_k=used, **extra)
            torch.cuda.synchronize()
            print(f"page_size={page_size}: max error {err(res[0].view(B, 1, HQ, D), oracle(q, ks, vs)):.2e}")
        except Exception as exc:  # noqa: BLE001 - a probe reports what the kernel says
            print(f"page_size={page_size}: {type(exc).__name__}: {str(exc).splitlines()[0]}")


def through_opdispatch(gen):
    print("\n## opdispatch.attention over a KV cache (decode: one query, bottom-right causal)")
    print(f"batch {B}, heads {HQ}/{HK}, head_dim {D}, capacity {CAP}, fills {CAP // 2}..{CAP}, bf16")
    rows = []
    for page_size in (None, 16, 32, 256):
        q, k, v, kw, ks, vs = make_cache(gen, page_size)
        want = oracle(q, ks, vs)
        label = "dense cache" if page_size is None else f"paged, {page_size} keys/page"
        args = dict(causal=True, causal_alignment="bottom_right", **kw)
        decision = opdispatch.explain(q, k, v, **args)
        print(f"{label}: chosen {decision.chosen_id}")
        for c in decision.candidates:
            if c.status != "unavailable":
                print(f"    {c.impl_id:22s} {c.status:10s} {'; '.join(c.reasons)[:150]}")
        for impl in [None] + pinned(decision):
            try:
                fn = (lambda: opdispatch.attention(q, k, v, **args)) if impl is None else (
                    lambda impl=impl: opdispatch.attention(q, k, v, impl=impl, **args))
                out, first = first_call(fn)
                rows.append((label, impl or f"auto ({decision.chosen_id})", err(out, want), time_ms(fn, first)))
            except Exception as exc:  # noqa: BLE001
                rows.append((label, impl, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", None))
        dense_k = [torch.nn.functional.pad(s, (0, 0, 0, 0, 0, CAP - s.shape[0])) for s in ks]
        dense_v = [torch.nn.functional.pad(s, (0, 0, 0, 0, 0, CAP - s.shape[0])) for s in vs]
        kd, vd = torch.stack(dense_k).transpose(1, 2), torch.stack(dense_v).transpose(1, 2)
        mask = torch.arange(CAP, device=DEV)[None, :] < kw["seqused_k"][:, None].long()
        mask = mask[:, None, None, :]

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kd, vd, attn_mask=mask,
                                                                    enable_gqa=True).transpose(1, 2)

        used = kw["seqused_k"]

        def sdpa_mask_per_call():
            m = (torch.arange(CAP, device=DEV)[None, :] < used[:, None].long())[:, None, None, :]
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kd, vd, attn_mask=m,
                                                                    enable_gqa=True).transpose(1, 2)

        out, first = first_call(sdpa)
        rows.append((label, "torch SDPA, keys gathered dense + mask (built once)", err(out, want),
                     time_ms(sdpa, first)))
        out, first = first_call(sdpa_mask_per_call)
        rows.append((label, "torch SDPA, keys gathered dense + mask (built per call)", err(out, want),
                     time_ms(sdpa_mask_per_call, first)))
        if page_size is None:  # which of SDPA's backends that baseline is
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                try:
                    with sdpa_kernel(backend):
                        out, first = first_call(sdpa)
                        rows.append((label, f"torch SDPA + mask (built once), {backend.name} only", err(out, want),
                                     time_ms(sdpa, first)))
                except RuntimeError as exc:
                    rows.append((label, f"torch SDPA, {backend.name} only", str(exc).splitlines()[0][:80], None))
    print_rows(rows)


def paged_varlen(gen):
    lens_q = [1, 37, 128, 300, 5, 64, 200, 17]
    print("\n## paged varlen (chunked prefill): packed queries over paged caches, bottom-right causal")
    print(f"query lengths {lens_q}, heads {HQ}/{HK}, head_dim {D}, capacity {CAP}, bf16")
    rows = []
    nseq = len(lens_q)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    for page_size in (16, 32, 256):
        used = torch.randint(CAP // 4, CAP, (nseq,), generator=gen).to(torch.int32)
        used = torch.maximum(used, torch.tensor(lens_q, dtype=torch.int32))
        per_seq = CAP // page_size
        pages = nseq * per_seq + 4
        table = torch.randperm(pages, generator=gen)[: nseq * per_seq].view(nseq, per_seq).to(torch.int32)
        k = torch.randn(pages, page_size, HK, D, device=DEV, dtype=DT)
        v = torch.randn(pages, page_size, HK, D, device=DEV, dtype=DT)
        q = torch.randn(int(cu_q[-1]), HQ, D, device=DEV, dtype=DT)
        # Each sequence's keys in order, read through its pages (the oracle's and the gather baseline's view).
        slots = [(table[i].repeat_interleave(page_size).long() * page_size
                  + torch.arange(page_size).repeat(per_seq))[: int(used[i])] for i in range(nseq)]
        flat_k, flat_v = k.flatten(0, 1), v.flatten(0, 1)
        index = torch.cat(slots).to(DEV)
        cu_k = torch.tensor([0] + used.cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        want = []
        for i in range(nseq):
            qi = q[cu_q[i]:cu_q[i + 1]].double().transpose(0, 1)
            ki = flat_k[slots[i].to(DEV)].double().transpose(0, 1).repeat_interleave(HQ // HK, 0)
            vi = flat_v[slots[i].to(DEV)].double().transpose(0, 1).repeat_interleave(HQ // HK, 0)
            lq, n = qi.shape[1], ki.shape[1]
            scores = qi @ ki.transpose(-1, -2) / math.sqrt(D)
            keep = torch.arange(n, device=DEV)[None, :] <= torch.arange(lq, device=DEV)[:, None] + (n - lq)
            want.append((torch.softmax(scores.masked_fill(~keep, -math.inf), -1) @ vi).transpose(0, 1))
        want = torch.cat(want)
        args = dict(layout="thd", cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), seqused_k=used.to(DEV),
                    block_table=table.to(DEV), causal=True, causal_alignment="bottom_right")
        label = f"paged varlen, {page_size} keys/page"
        decision = opdispatch.explain(q, k, v, **args)
        print(f"{label}: chosen {decision.chosen_id}")
        for c in decision.candidates:
            if c.status != "unavailable":
                print(f"    {c.impl_id:22s} {c.status:10s} {'; '.join(c.reasons)[:150]}")
        for impl in [None] + pinned(decision):
            try:
                fn = (lambda: opdispatch.attention(q, k, v, **args)) if impl is None else (
                    lambda impl=impl: opdispatch.attention(q, k, v, impl=impl, **args))
                out, first = first_call(fn)
                rows.append((label, impl or f"auto ({decision.chosen_id})", err(out, want), time_ms(fn, first)))
            except Exception as exc:  # noqa: BLE001
                rows.append((label, impl, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", None))
        fwd = torch.ops.aten._flash_attention_forward.default
        max_k = int(used.max())

        def gathered_flash():
            return fwd(q, flat_k[index], flat_v[index], cu_q, cu_k, max(lens_q), max_k, 0.0, True, False,
                       scale=D ** -0.5)[0]

        try:
            out, first = first_call(gathered_flash)
            rows.append((label, "torch: pages gathered (index built once) + FA2 varlen", err(out, want),
                         time_ms(gathered_flash, first)))
        except Exception as exc:  # noqa: BLE001
            rows.append((label, "torch: pages gathered + FA2 varlen", f"{type(exc).__name__}", None))
    print_rows(rows)


def pinned(decision):
    """The implementations timed pinned beside the pick: every eligible one, or those --impls names."""
    return [c.impl_id for c in decision.candidates if c.status in ("chosen", "eligible")
            and (IMPLS is None or c.impl_id in IMPLS)]


def print_rows(rows):
    print("\n| cache | path | max error vs float64 | step (ms, median) | in a loop (ms per call) | first call (ms) |\n"
          "|---|---|---|---|---|---|")
    for label, path, e, t in rows:
        step, loop, first = ("-", "-", "-") if t is None else (f"{t[0]:.3f}", f"{t[1]:.3f}", f"{t[2]:.1f}")
        print(f"| {label} | {path} | {e if isinstance(e, str) else f'{e:.2e}'} | {step} | {loop} | {first} |")


def first_call(fn):
    """(fn's result, ms of that call synchronised): a path's first call, graph builds and compiles included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def step_ms(fn):
    """One synchronised call between CUDA events, in ms (its host-side work included while the GPU waits)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def loop_ms(fn, calls=100):
    """ms per call of `calls` calls issued back to back, then one synchronise (what a decode loop sustains)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_ms(fn, first, reps=50):
    """(median step_ms of `reps` calls, median loop_ms of 5 loops, `first`) after 5 warm-up calls."""
    for _ in range(5):
        fn()
    return (statistics.median(step_ms(fn) for _ in range(reps)), statistics.median(loop_ms(fn) for _ in range(5)),
            first)


def main():
    global B, IMPLS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=B)
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--impls", help="comma-separated implementation ids timed pinned beside the pick")
    args = parser.parse_args()
    print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| cuDNN",
          torch.backends.cudnn.version())
    try:
        import flag_gems
        print("flag_gems", flag_gems.__version__)
    except Exception as exc:  # noqa: BLE001
        print("flag_gems not importable:", exc)
    B = args.batch
    IMPLS = None if args.impls is None else set(args.impls.split(","))
    try:
        print("nvidia-cudnn-frontend", importlib.metadata.version("nvidia-cudnn-frontend"))
    except importlib.metadata.PackageNotFoundError:
        print("nvidia-cudnn-frontend not installed (nvidia.cudnn_frontend unavailable)")
    gen = torch.Generator().manual_seed(0)
    if not args.decode_only:
        probe_torch_flash(gen)
    through_opdispatch(gen)
    if not args.decode_only:
        paged_varlen(gen)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        main()
    else:  # a kernel that kills the CUDA context must not take the report with it
        sys.exit(subprocess.call([sys.executable, __file__, "--child", *sys.argv[1:]]))
