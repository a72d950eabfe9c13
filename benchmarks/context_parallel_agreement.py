"""What agreeing each context-parallel call costs: `opdispatch.context_parallel_attention` with its per-call
agreement (one all-gather of a small int64 record, and on NCCL one device-to-host copy of it) against the same
calls with the agreement patched out, in loops of back-to-back calls (as the layers of a step issue them: the
host runs ahead of the device, which a per-call host copy interrupts).

    python benchmarks/context_parallel_agreement.py --out benchmarks/results/context_parallel_agreement-h100x2.md
    python benchmarks/context_parallel_agreement.py --smoke --out /tmp/cpa.md    # CPU, gloo, 2 ranks, tiny shapes

A and B alternate round by round; each figure is the slowest rank's median over rounds of (loop time / calls).
"""

from __future__ import annotations

import os

# The GPU host requires NVLink multicast off (see benchmarks/context_parallel.py).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from opdispatch.distributed import _context_parallel as cp  # noqa: E402
from opdispatch import distributed as od  # noqa: E402


def _rank(rank: int, world: int, port: int, out: str, smoke: bool, lengths: list[int]) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", rank=rank, world_size=world, device_id=None)
    dtype = torch.float32 if smoke else torch.bfloat16
    heads, kv_heads, dim = (4, 2, 16) if smoke else (32, 8, 128)
    calls, rounds = (2, 3) if smoke else (8, 15)
    agreed = cp.agree_call

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()

    rows = []
    try:
        for length in lengths:
            shard = length // world
            gen = torch.Generator(device=device).manual_seed(rank)
            q = torch.randn(1, shard, heads, dim, device=device, dtype=dtype, generator=gen)
            k = torch.randn(1, shard, kv_heads, dim, device=device, dtype=dtype, generator=gen)
            v = torch.randn(1, shard, kv_heads, dim, device=device, dtype=dtype, generator=gen)
            for training in (False, True):
                leaves = [t.clone().requires_grad_(training) for t in (q, k, v)]

                def loop() -> float:
                    sync()
                    start = time.perf_counter()
                    for _ in range(calls):
                        out = od.context_parallel_attention(*leaves, causal=True, mode="ring")
                        if training:
                            out.sum().backward()
                    sync()
                    return (time.perf_counter() - start) / calls * 1e3

                with torch.set_grad_enabled(training):
                    loop()  # warm-up: decisions, kernels
                    times: dict[str, list[float]] = {"agreed": [], "not agreed": []}
                    for _ in range(rounds):
                        cp.agree_call = agreed  # type: ignore[assignment]
                        times["agreed"].append(loop())
                        cp.agree_call = lambda *a, **kw: 0  # type: ignore[assignment]
                        times["not agreed"].append(loop())
                    cp.agree_call = agreed  # type: ignore[assignment]
                medians = {name: statistics.median(t) for name, t in times.items()}
                rows.append({"length": length, "pass": "forward+backward" if training else "forward", **medians})
        # The agreement alone, device idle.
        alone = []
        for _ in range(50):
            sync()
            start = time.perf_counter()
            agreed(None, cp._CALL, cp._signature(q, k, v, True, "ring", "zigzag", "bshd", 0.1),
                   device=cp._agreement_device(None, q))
            alone.append((time.perf_counter() - start) * 1e6)
        # Ranks that disagree (rank 1's shard is shorter): the same error on every rank, nothing exchanged.
        short = k[:, : max(2, shard // 2)] if rank == 1 else k
        try:
            od.context_parallel_attention(q[:, : short.shape[1]], short, short, causal=True)
            mismatch = "no error"
        except od.AgreementError as exc:
            mismatch = str(exc)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "alone_us": statistics.median(alone),
                                                             "mismatch": mismatch}))
        dist.barrier()  # no rank tears the group down while another is still inside its last collective
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 8192,32768)")
    args = p.parse_args(argv)
    world = 2 if args.smoke else torch.cuda.device_count()
    lengths = [int(x) for x in (args.lengths or ("64" if args.smoke else "8192,32768")).split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, port, tmp, args.smoke, lengths), nprocs=world, join=True,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    device = "CPU (gloo)" if args.smoke else f"{world}x {torch.cuda.get_device_name(0)} (NCCL)"
    lines = [f"# Cost of agreeing each context-parallel call: {device}", "",
             f"torch {torch.__version__}; ring, causal, zigzag; per call, slowest rank's median over rounds.", "",
             "| sequence | pass | agreed (ms) | not agreed (ms) | difference |", "|---|---|---|---|---|"]
    for i, row in enumerate(ranks[0]["rows"]):
        a = max(r["rows"][i]["agreed"] for r in ranks)
        b = max(r["rows"][i]["not agreed"] for r in ranks)
        lines.append(f"| {row['length']} | {row['pass']} | {a:.3f} | {b:.3f} | {(a - b) / b * 100:+.1f}% |")
    lines += ["", f"The agreement alone, device idle: {max(r['alone_us'] for r in ranks):.0f} µs (slowest rank's "
              "median)."]
    same = len({r["mismatch"] for r in ranks}) == 1 and ranks[0]["mismatch"] != "no error"
    lines += ["", "Ranks with shards of other lengths: the same AgreementError on every rank: "
              f"{'yes' if same else 'NO'}",
              "", "```", ranks[0]["mismatch"], "```"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
