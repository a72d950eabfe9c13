"""The ranks of tests/test_distributed.py: one spawned gloo group (3 ranks) runs every scenario in turn and writes
each scenario's outcome per rank to a JSON file the tests read. Scenarios are functions of this module
(`SCENARIOS`), run in order on every rank (agreement is collective)."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import opdispatch
from opdispatch import distributed as od

SEQ = 12  # divisible by 2 x world for 2 and 3 ranks (zigzag)


def _fresh(environ: dict[str, str] | None = None) -> opdispatch.OpManager:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env["OPDISPATCH_QUARANTINE"] = "/nonexistent/opdispatch-test-quarantine.yaml"
    env.update(environ or {})
    manager = opdispatch.OpManager(environ=env)
    opdispatch.set_manager(manager)
    return manager


def _error(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def _inputs(dtype: torch.dtype = torch.float32, causal: bool = True) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)  # the same on every rank
    q = torch.randn(2, 16, 4, 8, generator=gen, dtype=dtype)
    kv = torch.randn(2, 16, 2, 8, generator=gen, dtype=dtype)
    return q, kv, kv


# -- agreement --------------------------------------------------------------------------------------------------

def agreed(rank: int, world: int) -> dict[str, Any]:
    manager = _fresh()
    od.consistent()
    q, k, v = _inputs()
    opdispatch.attention(q, k, v, causal=True)
    first = manager.agreement.agreements
    opdispatch.attention(q, k, v, causal=True)  # the fast path: no collective
    opdispatch.attention(q[:, :9], k[:, :9], v[:, :9], causal=True)  # a new length, same class: cached
    decision = opdispatch.explain(q, k, v, causal=True)
    new_class = opdispatch.explain(q.double(), k.double(), v.double(), causal=True)
    return {"agreements_after_first": first, "agreements": manager.agreement.agreements,
            "chosen": decision.chosen_id, "explain": str(decision), "not_yet": new_class.agreement}


def env_mode(rank: int, world: int) -> dict[str, Any]:
    manager = _fresh({"OPDISPATCH_DISTRIBUTED": "consistent"})  # the default group, no consistent() call
    q, k, v = _inputs()
    opdispatch.attention(q, k, v, causal=False)
    return {"agreements": manager.agreement.agreements,
            "explain": opdispatch.explain(q, k, v, causal=False).agreement}


def override(rank: int, world: int) -> dict[str, Any]:
    # Rank 2 prefers the reference: it decides differently; rank 0's cpu.flash is eligible there, so it wins.
    manager = _fresh({"OPDISPATCH_PREFER": "reference.math"} if rank == 2 else {})
    od.consistent()
    q, k, v = _inputs()
    out = opdispatch.attention(q, k, v, causal=True)
    ran = [fn.decision.chosen_id for fn in manager.fast.values()]
    reference = _oracle(q.double(), k.double(), v.double(), True)
    decision = opdispatch.explain(q, k, v, causal=True)
    return {"ran": ran, "chosen": decision.chosen_id, "explain": str(decision),
            "error": (out.double() - reference).abs().max().item()}


def denied(rank: int, world: int) -> dict[str, Any]:
    # Rank 1 denies rank 0's choice: no rule can agree; every rank raises the same error.
    _fresh({"OPDISPATCH_DENY": "cpu.flash"} if rank == 1 else {})
    od.consistent()
    q, k, v = _inputs()
    return _error(lambda: opdispatch.attention(q, k, v, causal=True))


def pinned(rank: int, world: int) -> dict[str, Any]:
    # Rank 1 pins an implementation that cannot take the call: its error is shared, nobody waits.
    _fresh({"OPDISPATCH_IMPL_ATTENTION": "nvidia.flash"} if rank == 1 else {})
    od.consistent()
    q, k, v = _inputs()
    return _error(lambda: opdispatch.attention(q, k, v, causal=True))


class _HostLibrary(opdispatch.AttentionImpl):
    """A kernel whose library is installed on ranks 0 and 1 only (`RANK_WITHOUT`): a host that lacks it."""

    vendor = "test"
    name = "hostlib"
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, causal=True,
                                    causal_alignments=frozenset({"top_left"}), layouts=frozenset({"bshd"}))
    rank_without = 2

    def availability(self, device: Any) -> str | None:
        return "hostlib is not installed on this host" if dist.get_rank() == self.rank_without else None

    def run(self, call: Any) -> Any:
        return _oracle(call.q, call.k, call.v, call.causal).to(call.dtype)


def unavailable(rank: int, world: int) -> dict[str, Any]:
    # Every rank prefers test.hostlib; rank 2 lacks its library and decides cpu.flash: no common choice.
    manager = _fresh({"OPDISPATCH_PREFER": "test.hostlib"})
    manager.register_impl(_HostLibrary())
    od.consistent()
    q, k, v = _inputs()
    return _error(lambda: opdispatch.attention(q, k, v, causal=True))


def mismatch(rank: int, world: int) -> dict[str, Any]:
    _fresh()
    od.consistent()
    q, k, v = _inputs()
    return _error(lambda: opdispatch.attention(q, k, v, causal=rank == 0))


def local_calls(rank: int, world: int) -> dict[str, Any]:
    manager = _fresh()
    q, k, v = _inputs()
    opdispatch.attention(q, k, v, causal=False)  # before agreement: this rank's own decision and fast path
    od.consistent()
    opdispatch.attention(q, k, v, causal=False)  # decided again, collectively
    after_switch = manager.agreement.agreements
    with od.local():
        if rank == 0:  # rank-specific code: no collective, nobody waits
            opdispatch.attention(q, k, v, causal=True)
    inside = manager.agreement.agreements
    opdispatch.attention(q, k, v, causal=True)  # every rank: rank 0's local decision is made again with the others
    return {"after_switch": after_switch, "inside": inside, "after": manager.agreement.agreements,
            "explain": str(opdispatch.explain(q, k, v, causal=True))}


def tuned(rank: int, world: int) -> dict[str, Any]:
    from opdispatch.policies._tuned_table import TunedEntry, TunedTable

    gen = torch.Generator().manual_seed(100 + rank)  # each rank measures differently
    times = torch.rand(2, 3, generator=gen).mul(100).add(1).tolist()
    entries = [TunedEntry(("x", i), (128 * (i + 1),), [], dict(zip(("a.one", "b.two", "c.three"), row)),
                          {"c.three": "RuntimeError: boom"} if (rank == 1 and i == 0) else {}, f"case {i}")
               for i, row in enumerate(times)]
    for entry in entries:
        entry.order = sorted(entry.median_us, key=entry.median_us.__getitem__)
        for impl in entry.failed:
            entry.median_us.pop(impl)
            entry.order.remove(impl)
    if rank == 2:  # b.two cannot run on rank 2 in bucket 1: not timed there
        entries[1].median_us.pop("b.two")
        entries[1].order.remove("b.two")
    table = TunedTable({"name": "cpu"}, entries, op="attention", settings={"reps": 3})
    agreed_table = od.agree_tuned_table(table)
    other = TunedTable({"name": "other" if rank == 2 else "cpu"}, entries, op="attention")
    return {"mine": [e.median_us for e in entries],
            "agreed": [{"order": e.order, "median_us": e.median_us, "failed": e.failed}
                       for e in agreed_table.entries],
            "settings": agreed_table.settings,
            "fingerprint_error": _error(lambda: od.agree_tuned_table(other))}


# -- context-parallel attention --------------------------------------------------------------------------------

def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64 over the full sequence (bshd, GQA by repeating kv heads)."""
    groups = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.double().transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2)


CP_CASES = [  # mode, sharding, causal, heads q/kv, layout, dtype
    ("ring", "zigzag", True, (4, 2), "bshd", torch.float64),
    ("ring", "zigzag", False, (2, 2), "bshd", torch.float64),
    ("ring", "contiguous", True, (4, 1), "bshd", torch.float64),
    ("ring", "zigzag", True, (4, 2), "bhsd", torch.float64),
    ("ring", "zigzag", True, (4, 2), "bshd", torch.float32),
    ("allgather", "zigzag", True, (4, 2), "bshd", torch.float64),
    ("allgather", "contiguous", True, (2, 2), "sbhd", torch.float64),
    ("allgather", "zigzag", False, (4, 2), "bshd", torch.float64),
]


def _cp_errors(group: Any, mode: str, sharding: str, causal: bool, heads: tuple[int, int], layout: str,
               dtype: torch.dtype, seed: int) -> dict[str, float]:
    """Max abs errors of this rank's output and input gradients against the float64 oracle's shards."""
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    q = torch.randn(b, SEQ, heads[0], d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, SEQ, heads[1], d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, SEQ, heads[1], d, generator=gen, dtype=torch.float64)
    grad = torch.randn(b, SEQ, heads[0], d, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _oracle(*leaves, causal)
    expected.backward(grad)
    to = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.transpose(0, 1)}[layout]

    def shard(t: torch.Tensor) -> torch.Tensor:  # the caller's layout, sharded along its sequence dim
        return od.shard_sequence(to(t).contiguous(), group=group, sharding=sharding, layout=layout)

    mine = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
    out = od.context_parallel_attention(*mine, group=group, causal=causal, mode=mode, sharding=sharding,
                                        layout=layout)
    out.backward(shard(grad).to(dtype))
    whole = od.unshard_sequence(out.detach(), group=group, sharding=sharding, layout=layout)
    errors = {"out": (out.double() - shard(expected.detach())).abs().max().item(),
              "unsharded": (to(whole).double() - expected.detach()).abs().max().item()}
    for name, t, leaf in zip(("dq", "dk", "dv"), mine, leaves):
        assert t.grad is not None and leaf.grad is not None
        errors[name] = (t.grad.double() - shard(leaf.grad)).abs().max().item()
    return errors


def _oracle_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                       causal: bool) -> torch.Tensor:
    """`_oracle` with one more key per query head: score `sinks[h]`, value zero (float64, bshd)."""
    groups = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.double().transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probabilities = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # the sink's share carries no value
    return (probabilities @ vh).transpose(1, 2)


CP_SINK_CASES = [  # mode, sharding, causal, heads q/kv, layout, dtype
    ("ring", "zigzag", True, (4, 2), "bshd", torch.float64),
    ("ring", "contiguous", False, (2, 1), "bhsd", torch.float64),
    ("ring", "contiguous", True, (4, 2), "bshd", torch.float32),
    ("allgather", "zigzag", True, (4, 2), "sbhd", torch.float64),
    ("allgather", "contiguous", True, (2, 2), "bshd", torch.float64),
    ("allgather", "zigzag", False, (4, 1), "bshd", torch.float32),
]


def _cp_sink_errors(group: Any, mode: str, sharding: str, causal: bool, heads: tuple[int, int], layout: str,
                    dtype: torch.dtype, seed: int, qkv_grad: bool = True) -> dict[str, float]:
    """Max abs errors of this rank's output, input gradients and sinks gradient (its share, and the group's sum)
    against the float64 oracle with sinks. `qkv_grad` False: only the sinks require grad."""
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    q = torch.randn(b, SEQ, heads[0], d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, SEQ, heads[1], d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, SEQ, heads[1], d, generator=gen, dtype=torch.float64)
    grad = torch.randn(b, SEQ, heads[0], d, generator=gen, dtype=torch.float64)
    # Sinks of either sign and one large (most of each row's mass on the sink), so the epilogue matters.
    sinks = torch.randn(heads[0], generator=gen, dtype=torch.float32) * 2
    sinks[0] = 4.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_()
    expected = _oracle_with_sinks(*leaves, sink_leaf, causal)
    expected.backward(grad)
    assert sink_leaf.grad is not None
    to = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.transpose(0, 1)}[layout]

    def shard(t: torch.Tensor) -> torch.Tensor:  # the caller's layout, sharded along its sequence dim
        return od.shard_sequence(to(t).contiguous(), group=group, sharding=sharding, layout=layout)

    # This rank's share of the sinks gradient: the oracle's with the output gradient of its own rows only.
    rows = torch.zeros(SEQ, dtype=torch.bool)
    rows[od.shard_sequence(torch.arange(SEQ), group=group, sharding=sharding, seq_dim=0)] = True
    share_leaf = sinks.clone().requires_grad_()
    _oracle_with_sinks(q, k, v, share_leaf, causal).backward(grad * rows.view(1, -1, 1, 1))
    assert share_leaf.grad is not None

    mine = [shard(t).to(dtype).requires_grad_(qkv_grad) for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_()
    out = od.context_parallel_attention(*mine, group=group, causal=causal, mode=mode, sharding=sharding,
                                        layout=layout, sinks=my_sinks)
    out.backward(shard(grad).to(dtype))
    whole = od.unshard_sequence(out.detach(), group=group, sharding=sharding, layout=layout)
    assert my_sinks.grad is not None
    total = my_sinks.grad.clone()
    dist.all_reduce(total, group=group)
    errors = {"out": (out.double() - shard(expected.detach())).abs().max().item(),
              "unsharded": (to(whole).double() - expected.detach()).abs().max().item(),
              # relative: the sinks and their gradients are float32, summed over batch x sequence rows
              "dsinks share": _relative(my_sinks.grad, share_leaf.grad),
              "dsinks summed": _relative(total, sink_leaf.grad)}
    for name, t, leaf in zip(("dq", "dk", "dv"), mine, leaves):
        if qkv_grad:
            assert t.grad is not None and leaf.grad is not None
            errors[name] = (t.grad.double() - shard(leaf.grad)).abs().max().item()
        else:
            errors[name] = float(t.grad is not None)
    return errors


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max().clamp(min=1.0)).item()


def context_parallel_sinks(rank: int, world: int) -> dict[str, Any]:
    _fresh()
    pair = dist.new_group([0, 1])
    alone = dist.new_group([0])
    results: dict[str, Any] = {}
    if rank == 0:
        results["1 rank"] = _cp_sink_errors(alone, "ring", "zigzag", True, (4, 2), "bshd", torch.float64, seed=31)
    for i, (mode, sharding, causal, heads, layout, dtype) in enumerate(CP_SINK_CASES):
        name = f"{mode}-{sharding}-{'causal' if causal else 'full'}-{heads[0]}:{heads[1]}-{layout}-{dtype}"
        results[f"3 ranks {name}"] = _cp_sink_errors(None, mode, sharding, causal, heads, layout, dtype, seed=40 + i)
        if rank < 2:
            results[f"2 ranks {name}"] = _cp_sink_errors(pair, mode, sharding, causal, heads, layout, dtype,
                                                         seed=40 + i)
    for mode in ("ring", "allgather"):  # only the sinks need a gradient: a local backward, no exchange
        results[f"sinks only {mode}"] = _cp_sink_errors(None, mode, "zigzag", True, (4, 2), "bshd", torch.float64,
                                                        seed=50, qkv_grad=False)
    return results


@contextlib.contextmanager
def _block_calls() -> Iterator[list[dict[str, Any]]]:
    """Records the (causal, alignment, query length, key length) of every block call context-parallel attention
    makes: forward through `opdispatch.attention`, backward through its block gradients."""
    from opdispatch.doors import _api
    from opdispatch.distributed import _context_parallel as cp

    calls: list[dict[str, Any]] = []
    attention, block_grads = _api.attention, cp._block_grads

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        calls.append({"pass": "forward", "causal": bool(kwargs.get("causal", False)),
                      "alignment": kwargs.get("causal_alignment", "top_left"), "q": q.shape[1], "k": k.shape[1]})
        return attention(q, k, v, **kwargs)

    def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> Any:
        calls.append({"pass": "backward", "causal": bool(args[3]), "alignment": "top_left", "q": q.shape[1],
                      "k": k.shape[1]})
        return block_grads(q, k, v, *args)

    _api.attention, cp._block_grads = forward, backward  # type: ignore[assignment]
    try:
        yield calls
    finally:
        _api.attention, cp._block_grads = attention, block_grads  # type: ignore[assignment]


def context_parallel(rank: int, world: int) -> dict[str, Any]:
    _fresh()
    pair = dist.new_group([0, 1])  # a 2-rank group inside the 3-rank world (every rank creates it)
    alone = dist.new_group([0])
    results: dict[str, Any] = {}
    if rank == 0:  # a group of one: the local call
        for mode in ("ring", "allgather"):
            results[f"1 rank {mode}"] = _cp_errors(alone, mode, "zigzag", True, (4, 2), "bshd", torch.float64, seed=5)
    blocks: dict[str, list[dict[str, Any]]] = {}
    for i, (mode, sharding, causal, heads, layout, dtype) in enumerate(CP_CASES):
        name = f"{mode}-{sharding}-{'causal' if causal else 'full'}-{heads[0]}:{heads[1]}-{layout}-{dtype}"
        with _block_calls() as calls:
            results[f"3 ranks {name}"] = _cp_errors(None, mode, sharding, causal, heads, layout, dtype, seed=i)
            if rank < 2:
                results[f"2 ranks {name}"] = _cp_errors(pair, mode, sharding, causal, heads, layout, dtype, seed=i)
        blocks[name] = calls
    results["block calls"] = blocks
    return results


def context_parallel_agreed(rank: int, world: int) -> dict[str, Any]:
    # Under agreement ranks compute different blocks; every rank decides every block class in one order (else
    # this deadlocks or raises). Pinned to the reference, which has no `backward` of its own: the ring's torch
    # block formula computes the gradients.
    _fresh({"OPDISPATCH_IMPL_ATTENTION": "reference.math"})
    od.consistent()
    out = {}
    for mode in ("ring", "allgather"):
        out[mode] = _cp_errors(None, mode, "zigzag", True, (4, 2), "bshd", torch.float64, seed=11)
    manager = opdispatch.get_manager()
    out["agreements"] = manager.agreement.agreements
    return out


def cp_errors(rank: int, world: int) -> dict[str, Any]:
    _fresh()
    odd = torch.zeros(1, 5, 2, 8)
    return {
        "odd_shard": _error(lambda: od.context_parallel_attention(odd, odd, odd, causal=True)),
        "indivisible": _error(lambda: od.shard_sequence(torch.zeros(1, 10, 2, 8))),
        "mode": _error(lambda: od.context_parallel_attention(odd, odd, odd, mode="tree")),
    }


def _cp_call(rank: int, differs: int, **change: Any) -> dict[str, Any]:
    """One context-parallel call on the 3-rank group, rank `differs` passing `change` (shards: "batch", "length",
    "heads", "head_dim", "dtype"; options as keyword arguments): each rank's error."""
    gen = torch.Generator().manual_seed(13)
    shape = {"batch": 2, "length": SEQ // 3, "heads": 4, "head_dim": 8}
    dtype = torch.float64
    options: dict[str, Any] = {"causal": True, "mode": "ring", "sharding": "zigzag"}
    mine = change if rank == differs else {}
    shape.update({key: value for key, value in mine.items() if key in shape})
    dtype = mine.get("dtype", dtype)
    options.update({key: value for key, value in mine.items()
                    if key in ("causal", "mode", "sharding", "scale", "sinks")})
    q = torch.randn(shape["batch"], shape["length"], shape["heads"], shape["head_dim"], generator=gen, dtype=dtype)
    kv = torch.randn(shape["batch"], shape["length"], 2, shape["head_dim"], generator=gen, dtype=dtype)
    with torch.set_grad_enabled(not mine.get("no_grad", False)):
        return _error(lambda: od.context_parallel_attention(q.requires_grad_(), kv, kv, **options))


CP_MISMATCHES = {  # name: (the rank that differs, what it changes)
    "shard length": (2, {"length": 6}), "heads": (1, {"heads": 2}), "head_dim": (0, {"head_dim": 16}),
    "dtype": (2, {"dtype": torch.float32}), "batch": (1, {"batch": 1}), "causal": (1, {"causal": False}),
    "scale": (0, {"scale": 0.5}), "sharding": (2, {"sharding": "contiguous"}), "mode": (1, {"mode": "allgather"}),
    "grad": (2, {"no_grad": True}), "rejected": (1, {"mode": "tree"}),
    "sinks": (2, {"sinks": torch.zeros(4)}),
}


def _backward_skipped(rank: int) -> dict[str, Any]:
    """Rank 0 runs the backward of a call; ranks 1 and 2 skip it and call again: rank 0's backward meets their
    next forward."""
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(2, SEQ // 3, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, SEQ // 3, 2, 8, generator=gen, dtype=torch.float64)

    def steps() -> None:
        out = od.context_parallel_attention(q, kv, kv, causal=True)
        if rank == 0:
            out.sum().backward()
        else:
            od.context_parallel_attention(q, kv, kv, causal=True)

    return _error(steps)


def cp_mismatch(rank: int, world: int) -> dict[str, Any]:
    """Every kind of disagreement between the ranks of one context-parallel call, then an agreed call that must
    still be right (the group is intact after each error)."""
    _fresh()
    from opdispatch.engine import _agreement as _distributed

    results: dict[str, Any] = {name: _cp_call(rank, differs, **change)
                               for name, (differs, change) in CP_MISMATCHES.items()}
    shard = torch.zeros(1, 6 if rank == 2 else 4, 2, 8)  # rank 2's shard is longer
    results["unshard"] = _error(lambda: od.unshard_sequence(shard))
    results["backward skipped"] = _backward_skipped(rank)
    results["after"] = _cp_errors(None, "ring", "zigzag", True, (4, 2), "bshd", torch.float64, seed=21)
    results["calls"] = _distributed._CALLS[dist.group.WORLD]
    return results


def cp_twice(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 calls once more than the others, who then call again with another signature (no gradient): the
    extra call pairs with their next one, which names the difference; with the same signature nothing could."""
    _fresh()
    first = _cp_call(rank, -1)
    extra = _cp_call(rank, -1) if rank == 0 else None
    later = _cp_call(rank, rank, no_grad=True) if rank else None
    return {"first": first, "extra": extra, "later": later}


def timeout(rank: int, world: int) -> dict[str, Any]:
    # Last: a rank deciding alone under agreement waits for the group's timeout, then raises.
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    _fresh()
    od.consistent(group=short)
    if rank != 0:
        return {"type": None, "seconds": 0.0}
    q, k, v = _inputs()
    start = time.monotonic()
    result = _error(lambda: opdispatch.attention(q, k, v, causal=True))
    return {**result, "seconds": time.monotonic() - start}


SCENARIOS = [agreed, env_mode, override, denied, pinned, unavailable, mismatch, local_calls, tuned, context_parallel,
             context_parallel_sinks, context_parallel_agreed, cp_errors, cp_mismatch, cp_twice, timeout]


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # A scenario that leaves a rank waiting fails after a minute instead of hanging the test run.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for scenario in SCENARIOS:
            try:
                results[scenario.__name__] = scenario(rank, world)
            except Exception:
                results[scenario.__name__] = {"crashed": traceback.format_exc()}
                print(f"rank {rank} {scenario.__name__}:\n{traceback.format_exc()}", file=sys.stderr)
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, default=str)
        dist.destroy_process_group()
