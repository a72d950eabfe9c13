"""Rank-consistent decisions over NCCL, one process per GPU: agreement of a new decision, rank 0's choice winning
over a diverging rank, a choice no other rank can run, and what agreeing costs (the first call of a decision
class, against the next calls: the fast path, no collective).

    python benchmarks/agreement_nccl.py --out benchmarks/results/agreement_nccl-h100x2.md
    python benchmarks/agreement_nccl.py --smoke --out /tmp/agreement.md       # CPU, gloo

Rank 1 diverges through `policy_override` (it prefers nvidia.mem_efficient); rank 0 keeps the default policy. bf16,
(1, 1024, 32, 128) q, 8 kv heads, causal. Exits 1 when a check fails.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # the GPU host requires NVLink multicast off, forced before NCCL starts
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rank_main(rank: int, world: int, port: int, out: str, smoke: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu" if smoke else "cuda"
    if smoke:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import opdispatch
    from opdispatch import distributed as od

    result: dict[str, Any] = {"rank": rank}
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    # Rank 1's diverging preference, and the kernels it denies for a choice no other rank can run.
    prefer, deny = (("reference.math", ["cpu.*", "torch.*"]) if smoke
                    else ("nvidia.mem_efficient", ["nvidia.*", "flagos.*"]))

    def _ms(fn: Any) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return (time.perf_counter() - start) * 1e3

    def qkv(s: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(1, s, 32, 128, device=device, dtype=dtype, generator=gen),
                *(torch.randn(1, s, 8, 128, device=device, dtype=dtype, generator=gen) for _ in range(2)))

    manager = opdispatch.get_manager()
    with od.consistent():
        q, k, v = qkv(64 if smoke else 1024)
        first = _ms(lambda: opdispatch.attention(q, k, v, causal=True))
        again = min(_ms(lambda: opdispatch.attention(q, k, v, causal=True)) for _ in range(5))
        decision = opdispatch.explain(q, k, v, causal=True)
        result["agreed"] = {"chosen": decision.chosen_id, "group": decision.agreement, "first_ms": first,
                            "again_ms": again, "agreements": manager.agreement.agreements}
        # A new class (head_dim 64) where rank 1 prefers another kernel: rank 0's wins where rank 1 can run it.
        q2, k2, v2 = (t[..., :64].contiguous() for t in (q, k, v))
        if rank == 1:
            with opdispatch.policy_override(prefer=prefer):
                answer = opdispatch.attention(q2, k2, v2, causal=True)
                decision = opdispatch.explain(q2, k2, v2, causal=True)
        else:
            answer = opdispatch.attention(q2, k2, v2, causal=True)
            decision = opdispatch.explain(q2, k2, v2, causal=True)
        result["diverged"] = {"chosen": decision.chosen_id, "group": decision.agreement,
                              "out_finite": bool(answer.isfinite().all())}
        # A choice rank 1 cannot run (its kernels denied there; on the GPU FlagGems too, which would compile
        # Triton kernels for a minute first): every rank raises AgreementError, none hangs.
        # A new class on every rank (head_dim 96), so that every rank decides it here: agreement is collective.
        q3, k3, v3 = (t[:, :32, :, :96].contiguous() for t in (q, k, v))
        try:
            if rank == 1:
                with opdispatch.policy_override(deny=deny):
                    opdispatch.attention(q3, k3, v3, causal=True)
            else:
                opdispatch.attention(q3, k3, v3, causal=True)
            result["no_common"] = {"raised": None}
        except od.AgreementError as exc:
            result["no_common"] = {"raised": str(exc).splitlines()[0]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears the group down while another is still inside its last collective
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes (checks the script runs)")
    args = p.parse_args(argv)
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(world, port, tmp, args.smoke), nprocs=world, join=True,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    import opdispatch

    where = ("CPU x2, gloo" if args.smoke else f"{torch.cuda.get_device_name(0)} x{world}, CUDA {torch.version.cuda}, "
             f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    lines = [f"# Rank-consistent decisions over {'gloo' if args.smoke else 'NCCL'}", "",
             f"- {where}; torch {torch.__version__}, opdispatch {opdispatch.__version__}", "",
             "| rank | agreed: chosen | group line | first call (agrees) ms | next call ms | diverging rank: chosen "
             "| group line | no common choice |", "|---|---|---|--:|--:|---|---|---|"]
    for r in ranks:
        a, d, n = r["agreed"], r["diverged"], r["no_common"]
        lines.append(f"| {r['rank']} | {a['chosen']} | {a['group']} | {a['first_ms']:.2f} | {a['again_ms']:.3f} | "
                     f"{d['chosen']} | {d['group']} | {n['raised']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    ok = (len({r["agreed"]["chosen"] for r in ranks}) == 1 and len({r["diverged"]["chosen"] for r in ranks}) == 1
          and all(r["diverged"]["out_finite"] for r in ranks) and all(r["no_common"]["raised"] for r in ranks))
    print("checks:", "pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
