"""Context-parallel attention across the GPUs of one host: opdispatch's ring and all-gather modes against one GPU
computing the whole sequence, and torch's own context parallelism where it runs.

    python benchmarks/context_parallel.py --out benchmarks/results/context_parallel-h100x2.md
    python benchmarks/context_parallel.py --smoke --out /tmp/cp.md      # CPU, gloo, 2 ranks, tiny shapes

It spawns one process per GPU (NCCL; ``--world`` to use fewer), prints the device and versions, and for each
sequence length (default 8k, 32k, 64k; bf16, batch 1, 32 query heads, 8 kv heads, head_dim 128, causal):

1. checks numerics: each mode's output and gradients (zigzag shards) against the unsharded single-GPU result
   (``opdispatch.attention`` on rank 0's GPU, sharded the same way), as the max absolute difference;
2. times forward and forward+backward: single GPU unsharded (rank 0), ``opdispatch.context_parallel_attention``
   ring and allgather, and ``torch.distributed.tensor.experimental.context_parallel`` (SDPA patched inside the
   context; head-tail load balancing, which is the zigzag layout; its all-gather and all-to-all rotations) when
   it runs. A CP time is the slowest rank's median (the step waits for it).

TransformerEngine's context parallelism (``attn_mask_type``/``cp_group``/``cp_comm_type`` on its
``DotProductAttention``) is not compared: TransformerEngine is not installed on the GPU machine.
"""

from __future__ import annotations

import os

# The GPU host requires NVLink multicast off (NVLS in NCCL, multicast in torch's symmetric memory): forced, not
# defaulted, before torch initialises either; the spawned ranks inherit it.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import opdispatch  # noqa: E402
from opdispatch import distributed as od  # noqa: E402

METHODS = ("single GPU (unsharded)", "opdispatch ring", "opdispatch allgather", "torch CP allgather",
           "torch CP alltoall")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="markdown file to write (a .json with the raw rows next to it)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, tiny shapes (checks the script runs)")
    p.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 with --smoke)")
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 8192,32768,65536)")
    p.add_argument("--heads", default="32,8", help="query heads,kv heads (default 32,8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--full", action="store_true", help="not causal")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-torch-cp", action="store_true", help="skip torch's context_parallel")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths = args.lengths or "96"
        args.heads, args.head_dim, args.warmup, args.reps = "4,2", 16, 1, 2
        args.world = args.world or 2
    args.lengths = [int(x) for x in (args.lengths or "8192,32768,65536").split(",")]
    args.heads = tuple(int(x) for x in args.heads.split(","))
    if args.world is None:
        args.world = torch.cuda.device_count()
    if args.world < 2:
        p.error(f"--world {args.world}: context parallelism needs at least 2 ranks (GPUs here: "
                f"{torch.cuda.device_count()}); use --smoke on a machine without GPUs")
    for length in args.lengths:
        if length % (2 * args.world):
            p.error(f"--lengths: {length} is not divisible by 2 x world = {2 * args.world} (zigzag sharding)")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def versions(device: torch.device) -> dict[str, str]:
    info = {"torch": torch.__version__, "opdispatch": opdispatch.__version__, "python": sys.version.split()[0]}
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        info.update(device=torch.cuda.get_device_name(device), cuda=str(torch.version.cuda),
                    cudnn=str(torch.backends.cudnn.version()),
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    else:
        info["device"] = "cpu (gloo)"
    return info


class Timer:
    """Median seconds of `fn` on this rank over `reps` (after `warmup`), ranks started together; the group's
    figure is the slowest rank's median."""

    def __init__(self, device: torch.device, warmup: int, reps: int, group: Any = None) -> None:
        self.device, self.warmup, self.reps, self.group = device, warmup, reps, group

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], Any], collective: bool = True) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(self.reps):
            if collective:
                dist.barrier(group=self.group)
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - start)
        mine = statistics.median(samples)
        if not collective:
            return mine
        slowest = torch.tensor([mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        return float(slowest.item())


def _step(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor | None) -> Callable[[], Any]:
    """fn's forward, or forward + backward into `leaves` (their .grad reset each time)."""
    if grad is None:
        def forward() -> Any:
            with torch.no_grad():
                return fn()
        return forward

    def training() -> Any:
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(grad)
        return out
    return training


def run_rank(rank: int, args: argparse.Namespace, port: int, out_file: str) -> None:
    torch.set_num_threads(1 if args.smoke else max(1, torch.get_num_threads()))
    cuda = not args.smoke and torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world,
                            device_id=device if cuda else None)
    world = args.world
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv = args.heads
    causal = not args.full
    timer = Timer(device, args.warmup, args.reps)
    rows: list[dict[str, Any]] = []
    info = versions(device)
    if rank == 0:
        print(json.dumps(info), flush=True)
    for length in args.lengths:
        gen = torch.Generator(device=device).manual_seed(length)  # the same inputs on every rank
        shape_q, shape_kv = (args.batch, length, hq, args.head_dim), (args.batch, length, hkv, args.head_dim)
        q, k, v = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
        grad = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
        shard = lambda t: od.shard_sequence(t, sharding="zigzag").contiguous()  # noqa: E731
        local = [shard(t).requires_grad_() for t in (q, k, v)]
        local_grad = shard(grad)
        base = {"seqlen": length, "dtype": str(dtype).replace("torch.", ""), "heads": f"{hq}/{hkv}",
                "head_dim": args.head_dim, "causal": causal, "world": world}

        # The unsharded single-GPU result (rank 0 computes; every rank gets its shards for the numerics check).
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        single = functools.partial(opdispatch.attention, *whole, causal=causal)
        expected: list[torch.Tensor] = []
        if rank == 0:
            out = single()
            out.backward(grad)
            expected = [out.detach()] + [t.grad for t in whole]
            chosen = opdispatch.explain(*whole, causal=causal).chosen_id
            row = dict(base, method=METHODS[0], chosen=chosen)
            row["fwd_ms"] = 1e3 * timer.median(_step(single, whole, None), collective=False)
            row["fwd_bwd_ms"] = 1e3 * timer.median(_step(single, whole, grad), collective=False)
            rows.append(row)
            del out
        else:
            expected = [torch.empty_like(t) for t in (q, q, k, v)]
        for t in expected:
            dist.broadcast(t, src=0)
        expected_shards = [shard(t) for t in expected]
        del whole
        dist.barrier()

        for mode in ("ring", "allgather"):
            run = functools.partial(od.context_parallel_attention, *local, causal=causal, mode=mode)
            row = dict(base, method=f"opdispatch {mode}", note=_block_kernels(local, causal))
            row.update(_errors(run, local, local_grad, expected_shards))
            row["fwd_ms"] = 1e3 * timer.median(_step(run, local, None))
            row["fwd_bwd_ms"] = 1e3 * timer.median(_step(run, local, local_grad))
            rows.append(row)

        if not args.no_torch_cp:
            for rotate in ("allgather", "alltoall"):
                rows.append(dict(base, method=f"torch CP {rotate}",
                                 **_torch_cp(q, k, v, grad, expected_shards, causal, rotate, timer, world, device)))
        del q, k, v, grad, local, expected, expected_shards
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        Path(out_file).write_text(json.dumps({"versions": info, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def _block_kernels(local: list[torch.Tensor], causal: bool) -> str:
    """Which implementations the policy picks here for the blocks both modes compute, forward and training: the
    diagonal and, when causal, a block over earlier keys (not causal, fewer keys than queries)."""
    q, k, v = local
    half = k.shape[1] // 2
    kinds = [("diagonal", k, v, causal)] + ([("earlier keys", k[:, :half], v[:, :half], False)] if causal else [])
    parts = []
    for name, kb, vb, block_causal in kinds:
        with torch.no_grad():
            forward = opdispatch.explain(q.detach(), kb.detach(), vb.detach(), causal=block_causal,
                                         return_lse=True).chosen_id
        training = opdispatch.explain(q, kb, vb, causal=block_causal, return_lse=True).chosen_id
        parts.append(f"{name} {forward} (fwd), {training} (training)")
    return "blocks: " + "; ".join(parts)


def _errors(run: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor,
            expected: list[torch.Tensor]) -> dict[str, Any]:
    """Relative max difference (`_relative`) of the output and each gradient against the single-GPU result's
    shards, the worst rank's."""
    for t in leaves:
        t.grad = None
    out = run()
    out.backward(grad)
    got = [out.detach()] + [t.grad for t in leaves]
    diffs = torch.tensor([_relative(a, b) for a, b in zip(got, expected)], dtype=torch.float64, device=out.device)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return dict(zip(("err_out", "err_dq", "err_dk", "err_dv"), diffs.tolist()))


_MESH: dict[int, Any] = {}  # torch CP's device mesh, made once per process


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|: one figure for outputs and gradients of any magnitude."""
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30))


def _torch_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, expected: list[torch.Tensor],
              causal: bool, rotate: str, timer: Timer, world: int, device: torch.device) -> dict[str, Any]:
    """torch.distributed.tensor.experimental.context_parallel around F.scaled_dot_product_attention (bhsd): its
    buffers are sharded in place (head-tail load balancing, our zigzag), so its shards compare with ours."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(rotate)
        mesh = _MESH.get(world) or _MESH.setdefault(world, init_device_mesh(device.type, (world,)))
        groups = q.shape[2] // k.shape[2]
        # bhsd buffers, kv heads repeated: torch's CP dispatches SDPA's aten ops, which take no GQA.
        buffers = [q.transpose(1, 2).contiguous(), k.repeat_interleave(groups, 2).transpose(1, 2).contiguous(),
                   v.repeat_interleave(groups, 2).transpose(1, 2).contiguous(), grad.transpose(1, 2).contiguous()]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
            leaves = [t.detach().requires_grad_() for t in buffers[:3]]
            run = functools.partial(F.scaled_dot_product_attention, *leaves, is_causal=causal)
            out = run()
            out.backward(buffers[3])
            got = [out.detach().transpose(1, 2), leaves[0].grad.transpose(1, 2)]
            diffs = torch.tensor([_relative(a, b) for a, b in zip(got, expected[:2])], dtype=torch.float64,
                                 device=device)
            dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
            row: dict[str, Any] = {"err_out": diffs[0].item(), "err_dq": diffs[1].item(),
                                   "note": "kv heads repeated (no GQA)" if groups > 1 else ""}
            row["fwd_ms"] = 1e3 * timer.median(_step(run, leaves, None))
            row["fwd_bwd_ms"] = 1e3 * timer.median(_step(run, leaves, buffers[3]))
        return row
    except Exception as exc:  # a prototype API: say why it did not run, keep the rest of the table
        if dist.get_rank() == 0:
            traceback.print_exc()
        return {"note": f"did not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    v = result["versions"]
    lines = [f"# Context-parallel attention, {args.world} ranks ({v['device']})", "",
             "`python benchmarks/context_parallel.py " + " ".join(sys.argv[1:]) + "`", "",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), "",
             "Times: median of the slowest rank (single GPU: rank 0 alone, the whole sequence). Errors: max |a - b| / "
             "max |b| against the single-GPU result's shards b, the worst rank's (torch CP: out and dq).", "",
             "| seqlen | method | fwd ms | fwd+bwd ms | fwd speed-up | fwd+bwd speed-up | err out | err dq | err dk "
             "| err dv | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    single = {r["seqlen"]: r for r in result["rows"] if r["method"] == METHODS[0]}

    def cell(x: Any, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)

    for r in result["rows"]:
        base = single.get(r["seqlen"], {})
        speed = [None if r.get(key) is None or not base.get(key) else base[key] / r[key]
                 for key in ("fwd_ms", "fwd_bwd_ms")]
        note = r.get("note") or (f"chosen: {r['chosen']}" if r.get("chosen") else "")
        lines.append(f"| {r['seqlen']} | {r['method']} | {cell(r.get('fwd_ms'))} | {cell(r.get('fwd_bwd_ms'))} | "
                     f"{cell(speed[0], '{:.2f}x')} | {cell(speed[1], '{:.2f}x')} | "
                     f"{cell(r.get('err_out'), '{:.2e}')} | "
                     f"{cell(r.get('err_dq'), '{:.2e}')} | {cell(r.get('err_dk'), '{:.2e}')} | "
                     f"{cell(r.get('err_dv'), '{:.2e}')} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "rows.json")
        mp.start_processes(run_rank, args=(args, _free_port(), raw), nprocs=args.world, join=True,
                           start_method="spawn")  # not fork: a forked child hangs in torch's OpenMP pool
        result = json.loads(Path(raw).read_text())
    text = markdown(result, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(text)
    # Numerics: blocks merged in float32 differ from one kernel over the whole sequence by rounding only (bf16:
    # a few ulps of 2^-8 relative to the largest value).
    limit = 1e-5 if args.smoke else 2e-2
    bad = [r for r in result["rows"] if r["method"].startswith("opdispatch")
           and max(r.get(k, 0.0) for k in ("err_out", "err_dq", "err_dk", "err_dv")) > limit]
    if bad:
        print(f"NUMERICS: {len(bad)} opdispatch rows differ from the single-GPU result by more than {limit} "
              "(relative)", file=sys.stderr)
        return 1
    print(f"numerics: every opdispatch row within {limit} (relative) of the single-GPU result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
