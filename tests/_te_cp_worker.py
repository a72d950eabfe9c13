"""The ranks of tests/test_compat_te.py's context-parallel tests: one spawned gloo group of 2 CPU processes runs
every case of `CASES` (and `EXTRAS`) through opdispatch.compat.te.DotProductAttention with a cp_group, and writes
per case this rank's max abs errors (output, dq, dk, dv of its shard) against the float64 oracle of the unsharded
call, sharded the TransformerEngine way (`te_shard`), to a JSON file the tests read."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from opdispatch.compat.te import DotProductAttention
from tests._distributed_worker import _fresh
from tests.test_compat_te import oracle

WORLD = 2
BATCH, SEQ, HEADS, DIM, DIM_V = 2, 8, 4, 8, 6  # SEQ: divisible by 2 x WORLD (TE's DualChunkSwap)

# fmt, attn_mask_type, cp_comm_type, num_gqa_groups, dtype
CASES = [(fmt, mask, comm, heads_kv, dtype)
         for fmt in ("bshd", "sbhd") for mask in ("no_mask", "causal") for comm in ("p2p", "all_gather")
         for heads_kv, dtype in ((HEADS, torch.float64), (2, torch.float32), (1, torch.float32))]
EXTRAS = ("set_context_parallel_group", "a2a+p2p with an a2a group of one", "packed qkv_layer",
          "cross-attention no_mask", "checkpoint_core_attention", "eval with attention_dropout", "softmax_scale",
          "group of one rank: no context parallelism (window honoured)")


def case_name(case: tuple[Any, ...]) -> str:
    fmt, mask, comm, heads_kv, dtype = case
    return f"{fmt}-{mask}-{comm}-{HEADS}:{heads_kv}-{str(dtype)[6:]}"


def te_shard(x: torch.Tensor, seq_dim: int, rank: int, world: int) -> torch.Tensor:
    """TE's DualChunkSwap, written from context_parallel.get_batch_on_this_cp_rank: the sequence in 2 x world
    slices, this rank taking slices `rank` and `2 x world - rank - 1`, in that order."""
    size = x.shape[seq_dim] // (2 * world)
    index = torch.cat([torch.arange(rank * size, (rank + 1) * size),
                       torch.arange((2 * world - rank - 1) * size, (2 * world - rank) * size)])
    return x.index_select(seq_dim, index)


def _errors(rank: int, module: DotProductAttention, fmt: str, causal: bool, heads_kv: int, dtype: torch.dtype,
            seed: int, *, scale: float | None = None, window: tuple[int, int] | None = None, shard: bool = True,
            packed: bool = False, **forward: Any) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)  # the same full sequence on every rank
    shape = (lambda h, d: (SEQ, BATCH, h, d)) if fmt == "sbhd" else (lambda h, d: (BATCH, SEQ, h, d))
    q = torch.randn(shape(HEADS, DIM), generator=gen, dtype=torch.float64)
    k = torch.randn(shape(heads_kv, DIM), generator=gen, dtype=torch.float64)
    v = torch.randn(shape(heads_kv, DIM_V if not packed else DIM), generator=gen, dtype=torch.float64)
    dim_v = v.shape[-1]
    grad = torch.randn(*shape(HEADS, dim_v)[:2], HEADS * dim_v, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    seqs = [(i, [i * SEQ + j for j in range(SEQ)], [i * SEQ + j for j in range(SEQ)]) for i in range(BATCH)]
    expected = oracle(*leaves, fmt, seqs, causal=causal, bottom_right=False, window=window,
                      scale=DIM ** -0.5 if scale is None else scale, out_shape=(BATCH, SEQ))
    expected.backward(grad)
    seq_dim = 0 if fmt == "sbhd" else 1

    def mine(t: torch.Tensor) -> torch.Tensor:
        return te_shard(t, seq_dim, rank, WORLD) if shard else t

    if packed:  # [.., 3, h, d]: one tensor, q/k/v its views
        qkv = torch.stack([mine(t) for t in (q, k, v)], dim=-3).to(dtype).requires_grad_()
        out = module(qkv_layer=qkv, **forward)
        out.backward(mine(grad).to(dtype))
        assert qkv.grad is not None
        grads = qkv.grad.unbind(-3)
    else:
        local = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
        out = module(*local, **forward)
        out.backward(mine(grad).to(dtype))
        grads = tuple(t.grad for t in local)  # type: ignore[misc]
    assert out.dtype == dtype and out.shape == mine(expected).shape, (out.shape, mine(expected).shape)
    errors = {"out": (out.double() - mine(expected.detach())).abs().max().item()}
    for name, g, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert g is not None and leaf.grad is not None
        errors[name] = (g.double() - mine(leaf.grad)).abs().max().item()
    return errors


def run_cases(rank: int) -> dict[str, Any]:
    _fresh()
    pair = dist.new_group([0, 1])
    ones = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
    ranks = dist.get_process_group_ranks(pair)
    results: dict[str, Any] = {}
    for seed, case in enumerate(CASES):
        fmt, mask, comm, heads_kv, dtype = case
        module = DotProductAttention(HEADS, (DIM, DIM_V), num_gqa_groups=heads_kv, qkv_format=fmt,
                                     attn_mask_type=mask, cp_group=pair, cp_global_ranks=ranks, cp_comm_type=comm)
        results[case_name(case)] = _errors(rank, module, fmt, mask == "causal", heads_kv, dtype, seed)

    base = dict(num_attention_heads=HEADS, kv_channels=(DIM, DIM_V), num_gqa_groups=2, qkv_format="bshd")
    extra: dict[str, Any] = {}
    m = DotProductAttention(**base)
    m.set_context_parallel_group(pair, ranks, None, "all_gather")
    extra["set_context_parallel_group"] = _errors(rank, m, "bshd", True, 2, torch.float32, 100)
    m = DotProductAttention(**base, cp_group=[ones[rank], pair], cp_global_ranks=ranks, cp_comm_type="a2a+p2p")
    extra["a2a+p2p with an a2a group of one"] = _errors(rank, m, "bshd", True, 2, torch.float32, 101)
    m = DotProductAttention(HEADS, DIM, qkv_format="sbhd", cp_group=pair, cp_global_ranks=ranks)
    extra["packed qkv_layer"] = _errors(rank, m, "sbhd", True, HEADS, torch.float32, 102, packed=True)
    m = DotProductAttention(**base, attn_mask_type="no_mask", attention_type="cross", cp_group=pair,
                            cp_global_ranks=ranks)
    extra["cross-attention no_mask"] = _errors(rank, m, "bshd", False, 2, torch.float32, 103)
    m = DotProductAttention(**base, cp_group=pair, cp_global_ranks=ranks, cp_comm_type="all_gather")
    extra["checkpoint_core_attention"] = _errors(rank, m, "bshd", True, 2, torch.float32, 104,
                                                 checkpoint_core_attention=True)
    m = DotProductAttention(**base, attention_dropout=0.1, cp_group=pair, cp_global_ranks=ranks).eval()
    extra["eval with attention_dropout"] = _errors(rank, m, "bshd", True, 2, torch.float32, 105)
    m = DotProductAttention(**base, softmax_scale=0.3, cp_group=pair, cp_global_ranks=ranks)
    extra["softmax_scale"] = _errors(rank, m, "bshd", True, 2, torch.float32, 106, scale=0.3)
    # TE: a cp_group of one rank is cp_size 1, no context parallelism: the whole sequence here, every feature.
    m = DotProductAttention(**base, window_size=(2, 0), cp_group=ones[rank], cp_global_ranks=[rank])
    extra["group of one rank: no context parallelism (window honoured)"] = _errors(
        rank, m, "bshd", True, 2, torch.float32, 107, window=(2, 0), shard=False)
    results["extras"] = extra
    return results


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        try:
            results = run_cases(rank)
        except Exception:
            results = {"crashed": traceback.format_exc()}
            print(f"rank {rank}:\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
