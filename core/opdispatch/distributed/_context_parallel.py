"""Context-parallel attention: one long sequence sharded across the ranks of a torch.distributed group.

Two modes, forward and backward, each local block computed by the implementation the policy picks on this
device (`opdispatch.attention(..., return_lse=True)`):

- ``ring``: K/V shards travel around the ring (``batch_isend_irecv``; the next shard is in flight while the
  current one is computed), partial results merged by their log-sum-exp in float32. The backward passes the
  accumulated dK/dV around the ring behind K/V, so each reaches its owner after one full turn; each block's
  gradients come from the chosen implementation's own ``backward(call, out, lse, grad_out)`` given the *merged*
  out and LSE (exact: FlashAttention's backward reads the softmax only through them), or, for an
  implementation without one, the same formula in torch.
- ``allgather``: K/V all-gathered, then the ring's kinds of block, merged the same way: the local shard against
  its own K/V (causal, equal lengths) and, not causal, against the gathered keys before its chunks — never a
  causal block over an unequal key prefix (bottom-right alignment), which cuDNN does not take. The backward is
  the ring's per-block one; dK/dV of the gathered keys are reduce-scattered to their owners. The diagonal needs
  no other rank's K/V: it is computed while the gather (forward) and the reduce-scatter (backward) travel.

Before any exchange, the ranks agree each call's signature (shapes, dtypes, options, mode, sharding, call
number) with one small all-gather, and raise the same error on every rank where they differ (`agree_call`).

Sharding: ``zigzag`` (the default; load-balanced for causal masks) splits the sequence into 2×world chunks and
rank r holds chunks r and 2×world−1−r; ``contiguous`` gives rank r the r-th of world equal pieces.
`shard_sequence`/`unshard_sequence` convert a full sequence to and from either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ops._attention import LAYOUT_DIMS, AttentionImpl, bshd_views, validate_attention
from ..engine._agreement import SignatureField, agree_call, collective_op

__all__ = ["MODES", "SHARDINGS", "context_parallel_attention", "shard_sequence", "unshard_sequence"]

MODES = ("ring", "allgather")
SHARDINGS = ("zigzag", "contiguous")
_SEQ_DIM = {layout: dims[1] for layout, dims in LAYOUT_DIMS.items()}


# -- sharding -------------------------------------------------------------------------------------------------

def _group_rank(group: Any, what: str) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialised. Fix: call "
                           "torch.distributed.init_process_group(...) first (or launch with torchrun), or use "
                           "opdispatch.attention on one device")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_choice(what: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{what}: {name}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def _chunks(sharding: str, rank: int, world: int) -> tuple[int, ...]:
    """The chunks rank `rank` holds, in order: of 2×world chunks (zigzag) or of world (contiguous)."""
    return (rank, 2 * world - 1 - rank) if sharding == "zigzag" else (rank,)


def _pieces(sharding: str, world: int) -> int:
    return 2 * world if sharding == "zigzag" else world


def shard_sequence(x: torch.Tensor, *, group: Any = None, sharding: str = "zigzag", layout: str = "bshd",
                   seq_dim: int | None = None) -> torch.Tensor:
    """This rank's shard of the full sequence `x` (every rank passes the same `x`): for ``zigzag``, chunks r and
    2×world−1−r of 2×world, concatenated; for ``contiguous`` the r-th of world pieces. The sequence dimension is
    the layout's (``bshd``: 1, ``bhsd``: 2, ``sbhd``: 0) unless `seq_dim` says."""
    what = "opdispatch.shard_sequence()"
    rank, world = _group_rank(group, what)
    dim = _seq_dim(what, layout, seq_dim, x)
    _check_choice(what, "sharding", sharding, SHARDINGS)
    pieces = _pieces(sharding, world)
    length = x.shape[dim]
    if length % pieces:
        raise ValueError(_divisible_error(what, length, sharding, world))
    return torch.cat(_shard_views(x, dim, sharding, rank, world), dim=dim)


def _shard_views(x: torch.Tensor, dim: int, sharding: str, rank: int, world: int) -> list[torch.Tensor]:
    """Views of the chunks of the full sequence `x` (along `dim`) that rank `rank`'s shard holds, in order."""
    chunk = x.shape[dim] // _pieces(sharding, world)
    return [x.narrow(dim, c * chunk, chunk) for c in _chunks(sharding, rank, world)]


def unshard_sequence(x: torch.Tensor, *, group: Any = None, sharding: str = "zigzag", layout: str = "bshd",
                     seq_dim: int | None = None) -> torch.Tensor:
    """The full sequence from every rank's shard `x` (the inverse of `shard_sequence`; an all-gather, so every
    rank calls it). Differentiable: the gradient of each shard is its part of the full gradient."""
    what = "opdispatch.unshard_sequence()"
    rank, world = _group_rank(group, what)
    dim, rejected = None, None
    try:
        dim = _seq_dim(what, layout, seq_dim, x)
        _check_choice(what, "sharding", sharding, SHARDINGS)
        if sharding == "zigzag" and x.shape[dim] % 2:
            raise ValueError(f"{what}: a zigzag shard holds two equal chunks, so its length along dim {dim} must be "
                             f"even; got {x.shape[dim]}")
    except Exception as exc:
        rejected = exc
    if world > 1:  # shards of other shapes would abort a rank inside the all-gather: agreed first, as a call
        is_tensor = isinstance(x, torch.Tensor)
        agree_call(group, _UNSHARD, {
            "x.shape": tuple(x.shape) if is_tensor else None,
            "x.dtype": _dtype_text(x.dtype) if is_tensor else type(x).__name__,
            "device type": x.device.type if is_tensor else "", "dim": -1 if dim is None else dim,
            "sharding": sharding, "records a backward": is_tensor and torch.is_grad_enabled() and x.requires_grad,
        }, device=_agreement_device(group, x), rejected=rejected)
    if rejected is not None:
        raise rejected
    assert dim is not None
    return _natural(_gather(x, dim, group), dim, sharding, world)


def _natural(gathered: torch.Tensor, dim: int, sharding: str, world: int) -> torch.Tensor:
    """Rank-ordered shards (as an all-gather concatenates them) in sequence order."""
    if sharding == "contiguous":
        return gathered
    chunk = gathered.shape[dim] // (2 * world)
    where = {c: 2 * r + i for r in range(world) for i, c in enumerate(_chunks(sharding, r, world))}
    return torch.cat([gathered.narrow(dim, where[c] * chunk, chunk) for c in range(2 * world)], dim=dim)


def _seq_dim(what: str, layout: str, seq_dim: int | None, x: Any) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(x).__name__}")
    if seq_dim is not None:
        if not -x.dim() <= seq_dim < x.dim():
            raise ValueError(f"{what}: seq_dim={seq_dim} is out of range for a {x.dim()}-D tensor")
        return seq_dim % x.dim()
    _check_choice(what, "layout", layout, tuple(_SEQ_DIM))
    return _SEQ_DIM[layout]


def _divisible_error(what: str, length: int, sharding: str, world: int) -> str:
    pieces = _pieces(sharding, world)
    how = (f"2 x world = {pieces} chunks (zigzag: rank r holds chunks r and {pieces - 1}-r)" if sharding == "zigzag"
           else f"world = {pieces} pieces")
    return (f"{what}: a sequence of length {length} cannot be split into {how}: the length must be divisible by "
            f"{pieces}. Fix: pad the sequence to a multiple of {pieces} (with keys the padding queries may see "
            "masked out by causality, or cut after), or use another group size")


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` in rank order; the backward reduce-scatters (sums each rank's gradients of the
    gathered tensor and keeps this rank's part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts, work = _start_gather(x, group)
        work.wait()
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _agree_backward(ctx.group, grad, _UNSHARD_BACKWARD)
        mine, work = _start_reduce_scatter(grad, ctx.dim, ctx.group)
        work.wait()
        return mine(), None, None


def _start_gather(x: torch.Tensor, group: Any) -> tuple[list[torch.Tensor], Any]:
    """Start gathering every rank's `x` (in rank order): the parts, filled once the returned work is waited on."""
    import torch.distributed as dist

    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    return parts, dist.all_gather(parts, x.contiguous(), group=group, async_op=True)


def _start_reduce_scatter(grad: torch.Tensor, dim: int, group: Any) -> tuple[Callable[[], torch.Tensor], Any]:
    """Start summing every rank's `grad` (rank-ordered parts along `dim`) and keeping this rank's part: a function
    returning that part once the returned work is waited on."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = [p.contiguous() for p in grad.chunk(world, dim=dim)]
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: a sum everywhere, then our part
        total = torch.stack(parts)
        return (lambda: total[rank]), dist.all_reduce(total, group=group, async_op=True)
    mine = torch.empty_like(parts[rank])
    return (lambda: mine), dist.reduce_scatter(mine, parts, group=group, async_op=True)


# -- the op ---------------------------------------------------------------------------------------------------

# Eager only: collectives and per-block decisions inside a traced graph would run once per trace, not per call.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                               causal: bool = False, mode: str = "ring", sharding: str = "zigzag",
                               layout: str = "bshd", scale: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of `group` (None: the default group): q, k, v are this
    rank's shards (`shard_sequence`), the result is this rank's shard of the output. Every rank of the group
    calls it with shards of the same shapes.

    ``mode``: ``ring`` (K/V passed around the ring, overlapped with compute) or ``allgather`` (K/V gathered, then
    the ring's kinds of block, fewer and larger). ``sharding``: ``zigzag`` (load-balanced for causal; the sequence
    length must be divisible by 2×world) or ``contiguous``. ``causal`` is over the full sequence (query i sees
    keys j <= i).
    Layouts ``bshd``, ``bhsd``, ``sbhd``; k/v may have fewer heads (GQA). Each local block runs on the
    implementation the policy picks (`opdispatch.attention`); gradients flow to q, k and v.

    ``sinks``: one float32 logit per query head (as `opdispatch.attention(..., sinks=)`), the same on every rank.
    The sink enters each row's softmax once, not once per block: the blocks run without it, and the shared sink
    epilogue (`opdispatch.ops._sinks.apply_sinks`) is applied to the merged (out, LSE). The backward's blocks read
    that final out and LSE (FlashAttention's backward with the sink as one more key of zero value, so exact), and
    the sink's gradient is this rank's queries' share: sinks is a replicated parameter, so its gradients summed
    over the group (as data/context-parallel training all-reduces replicated parameters) are the unsharded call's.

    Before any exchange the ranks agree the call (`opdispatch.engine._agreement.agree_call`: one all-gather of a
    fixed-size int64 record per call): q/k/v shard shapes and dtypes, device type, layout, causal, the effective
    scale, mode, sharding, whether a backward is recorded, and the call's number in the group. Ranks that differ
    raise the same AgreementError on every rank, naming each field and each rank's value; a rank whose own checks
    reject its call raises its own error and the others an AgreementError naming it. The backward agrees too (the
    gradient's shape and dtype), so a rank that runs it while the others skip it is named, not left waiting. A
    rank calling once more than the others is named only where its extra call differs from the others' next one
    (see `agree_call`).
    """
    what = "opdispatch.context_parallel_attention()"
    rank, world = _group_rank(group, what)
    if world == 1:  # the whole sequence is here (zigzag's two chunks are in order): one local call
        _check_call(what, q, k, v, causal, mode, sharding, layout, world)
        from ..doors._api import attention

        out1: torch.Tensor = attention(q, k, v, causal=causal, layout=layout, scale=scale, sinks=sinks)
        return out1
    # The ranks agree the call before any exchange: shards of other shapes would abort a rank inside the
    # collective, other options would give every rank a wrong result. A call this rank's own checks reject takes
    # part all the same (the others then raise too, instead of waiting), and its own error is raised here.
    call, rejected = None, None
    try:
        _check_call(what, q, k, v, causal, mode, sharding, layout, world)
        # Validated as one unsharded call would be (dtypes, heads, head dims, scale), with its error messages.
        to_bshd = bshd_views(layout)[0]
        call = validate_attention(to_bshd(q), to_bshd(k), to_bshd(v), causal=causal, scale=scale, sinks=sinks)
    except Exception as exc:
        rejected = exc
    agree_call(group, _CALL, _signature(q, k, v, causal, mode, sharding, layout,
                                        scale if call is None else call.scale, sinks=sinks),
               device=_agreement_device(group, q), rejected=rejected)
    if rejected is not None:
        raise rejected
    assert call is not None
    # Work in bshd views; the result goes back to the caller's layout.
    to_bshd, from_bshd = bshd_views(layout)
    q4, k4, v4 = to_bshd(q), to_bshd(k), to_bshd(v)
    if mode == "ring":
        out: torch.Tensor = _RingAttention.apply(  # type: ignore[no-untyped-call]
            q4, k4, v4, group, causal, sharding == "zigzag", call.scale, call.sinks)
    else:
        out = _allgather_attention(q4, k4, v4, group, rank, world, causal, sharding, call.scale, call.sinks)
    return out if layout == "bshd" else from_bshd(out).contiguous()


def _check_call(what: str, q: Any, k: Any, v: Any, causal: Any, mode: Any, sharding: Any, layout: Any,
                world: int) -> None:
    """This rank's own checks of a call (before the ranks agree it)."""
    _check_choice(what, "mode", mode, MODES)
    _check_choice(what, "sharding", sharding, SHARDINGS)
    _check_choice(what, "layout", layout, tuple(_SEQ_DIM))
    if not isinstance(causal, bool):
        raise TypeError(f"{what}: causal must be True or False, got {causal!r} ({type(causal).__name__})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"{t.dim()}-D tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {name} must be a 4-D {layout} tensor, got {got}")
    dim = _SEQ_DIM[layout]
    q_len, k_len = q.shape[dim], k.shape[dim]
    if q_len != k_len or v.shape[dim] != k_len:
        raise ValueError(f"{what}: q, k and v must be shards of one sequence (self-attention), of equal length "
                         f"along the sequence dim {dim} of layout {layout!r}; got {q_len}, {k_len}, {v.shape[dim]}")
    if sharding == "zigzag" and q_len % 2:
        raise ValueError(_divisible_error(what, q_len * world, sharding, world)
                         + f" (this rank's shard has {q_len}, an odd number)")


_SAME_SHARDS = ("give every rank its shard of one sequence (`shard_sequence`): equal batch, shard length, heads and "
                "head_dim on every rank (pad the sequence to a multiple of 2 x world for zigzag, of world for "
                "contiguous)")
_SAME_DTYPE = "cast q, k and v to one dtype on every rank"
_RECORDS = SignatureField("records a backward", "bool", "enable gradients on every rank or on none (grad mode on "
                          "and an input that requires grad): the backward exchanges too, so every rank must run it")
# What the ranks agree before any exchange (`_distributed.agree_call`); a new option of the op joins it here.
_CALL = collective_op("opdispatch.context_parallel_attention()", (
    SignatureField("q.shape", "shape", _SAME_SHARDS), SignatureField("k.shape", "shape", _SAME_SHARDS),
    SignatureField("v.shape", "shape", _SAME_SHARDS), SignatureField("q.dtype", "text", _SAME_DTYPE),
    SignatureField("k.dtype", "text", _SAME_DTYPE), SignatureField("v.dtype", "text", _SAME_DTYPE),
    SignatureField("device type", "text", "put every rank's shards on one type of device"),
    SignatureField("layout", "text", "pass the same layout on every rank"),
    SignatureField("causal", "bool", "pass the same causal on every rank"),
    SignatureField("scale", "float", "pass the same scale on every rank (None: 1/sqrt(head_dim))"),
    SignatureField("mode", "text", "pass the same mode on every rank"),
    SignatureField("sharding", "text", "pass the same sharding on every rank"), _RECORDS,
    SignatureField("sinks", "bool", "pass sinks (the same replicated parameter) on every rank or on none"),
))
# The backward exchanges as well: a rank that skips it (or runs another) is named before it does.
_SAME_GRAD = "give every rank's output a gradient of its shape and dtype"
_BACKWARD = collective_op("opdispatch.context_parallel_attention() backward", (
    SignatureField("grad_out.shape", "shape", _SAME_GRAD), SignatureField("grad_out.dtype", "text", _SAME_GRAD),
))
_UNSHARD = collective_op("opdispatch.unshard_sequence()", (
    SignatureField("x.shape", "shape", "pass every rank's shard of one sequence: equal shapes on every rank"),
    SignatureField("x.dtype", "text", "pass shards of one dtype on every rank"),
    SignatureField("device type", "text", "put every rank's shard on one type of device"),
    SignatureField("dim", "int", "pass the same layout (or seq_dim) on every rank"),
    SignatureField("sharding", "text", "pass the same sharding on every rank"), _RECORDS,
))
_UNSHARD_BACKWARD = collective_op("opdispatch.unshard_sequence() backward", _BACKWARD[1])


def _signature(q: Any, k: Any, v: Any, causal: Any, mode: Any, sharding: Any, layout: Any,
               scale: Any, *, sinks: Any = None) -> dict[str, Any]:
    """This rank's values of `_CALL`'s fields (a rejected call's too, as far as they can be read)."""
    tensors = {"q": q, "k": k, "v": v}
    values: dict[str, Any] = {}
    for name, t in tensors.items():
        is_tensor = isinstance(t, torch.Tensor)
        values[f"{name}.shape"] = tuple(t.shape) if is_tensor else None
        values[f"{name}.dtype"] = _dtype_text(t.dtype) if is_tensor else type(t).__name__
    values["device type"] = q.device.type if isinstance(q, torch.Tensor) else ""
    records = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                              for t in tensors.values())
    values.update({"layout": layout, "causal": bool(causal), "mode": mode, "sharding": sharding,
                   "scale": scale if isinstance(scale, (int, float)) else None, "records a backward": records,
                   "sinks": sinks is not None})
    return values


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _agree_backward(group: Any, grad: torch.Tensor, op: tuple[str, tuple[SignatureField, ...]]) -> None:
    """Agree a backward across `group` before it exchanges: every rank is at this backward, with a gradient of
    one shape and dtype."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:  # a group of one computed locally and exchanges nothing
        return
    agree_call(group, op, {"grad_out.shape": tuple(grad.shape), "grad_out.dtype": _dtype_text(grad.dtype)},
               device=_agreement_device(group, grad))


def _agreement_device(group: Any, q: Any) -> torch.device:
    """Where the agreement's collective runs: the CPU for gloo, this rank's accelerator otherwise (NCCL takes
    device tensors only)."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    if isinstance(q, torch.Tensor) and q.device.type != "cpu":
        return q.device
    accelerator: Any = getattr(torch, "accelerator", None)  # torch >= 2.6
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is None:
        return torch.device("cpu")
    return torch.device(current.type, accelerator.current_device_index())


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    gathered: torch.Tensor = _GatherSequence.apply(x, dim, group)  # type: ignore[no-untyped-call]
    return gathered


def _allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, rank: int, world: int,
                         causal: bool, sharding: str, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = _AllGatherAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, group, rank, world, causal, sharding, scale, sinks)
    return out


def _rank_order(x: torch.Tensor, dim: int, sharding: str, world: int) -> torch.Tensor:
    """The inverse of `_natural`: a full sequence as the rank-ordered shards an all-gather concatenates."""
    if sharding == "contiguous":
        return x
    return torch.cat([view for r in range(world) for view in _shard_views(x, dim, sharding, r, world)], dim=dim)


# A block: (query rows of the local shard, key rows of the gathered sequence or None for this rank's own K/V
# shard, causal).
_Block = tuple[slice, slice | None, bool]


def _allgather_blocks(rank: int, world: int, length: int, causal: bool, sharding: str) -> list[_Block]:
    """The blocks rank `rank` computes in allgather mode, each causal with equal lengths or not causal: the kinds
    cuDNN takes (bottom-right causal over an unequal key prefix is not one of them, and goes to a slower kernel).

    Causal: the diagonal is the local shard against its own K/V, causal (its chunks are in sequence order, so
    this is each chunk's own triangle plus, for zigzag, the second chunk seeing all of the first); then the keys
    before each chunk, not causal. For zigzag (chunks r < 2W−1−r) both chunks see keys [0, r·chunk) — one call
    for the two — and the second chunk alone sees (r+1)·chunk up to its own start."""
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    chunks = _chunks(sharding, rank, world)
    chunk = length // len(chunks)
    blocks: list[_Block] = [(every, None, True)]
    first = chunks[0]
    if first > 0:
        blocks.append((every, slice(0, first * chunk), False))
    if len(chunks) == 2 and chunks[1] > first + 1:
        blocks.append((slice(chunk, None), slice((first + 1) * chunk, chunks[1] * chunk), False))
    return blocks


class _AllGatherAttention(torch.autograd.Function):
    """Attention of the local queries over this rank's K/V shard (the diagonal) and the gathered keys before it,
    merged by LSE; the backward is the ring's: each block's gradients from the merged out and LSE. The diagonal
    needs no other rank's keys: it runs while the all-gather (forward) and the reduce-scatter of dK/dV (backward)
    are in flight."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, rank: int, world: int,
                causal: bool, sharding: str, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        length = q.shape[1]
        if _agreeing():  # every rank decides every rank's blocks, in one order (see `_settle`); decisions read
            # shapes only, so placeholders of the gathered keys' shape let the diagonal overlap the gather below
            full = (k.shape[0], length * world, *k.shape[2:])
            _settle(_allgather_settle(q, k, v, k.new_empty(full), v.new_empty(full[:3] + v.shape[3:]), world,
                                      causal, sharding), scale, return_lse=True)
        (k_parts, k_work), (v_parts, v_work) = _start_gather(k, group), _start_gather(v, group)
        blocks = _allgather_blocks(rank, world, length, causal, sharding)
        out, lse = _accumulators(q, v)
        for rows, key_rows, block_causal in blocks:
            if key_rows is None:
                _attend(out, lse, q, rows, k, v, block_causal, scale)
        _wait([k_work, v_work])
        keys = _natural(torch.cat(k_parts, dim=1), 1, sharding, world)
        values = _natural(torch.cat(v_parts, dim=1), 1, sharding, world)
        for rows, key_rows, block_causal in blocks:
            if key_rows is not None:
                _attend(out, lse, q, rows, keys[:, key_rows], values[:, key_rows], block_causal, scale)
        out, lse = _with_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, keys, values, result, lse, sinks)
        ctx.group, ctx.world, ctx.causal, ctx.sharding, ctx.scale = group, world, causal, sharding, scale
        ctx.blocks = blocks
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, keys, values, out, lse, sinks = ctx.saved_tensors
        dsinks = _sinks_gradient(ctx, out, lse, grad_out, sinks, 9)
        if not any(ctx.needs_input_grad[:3]):  # the sink's gradient alone: local, nothing to exchange
            return None, None, None, None, None, None, None, None, None, dsinks
        _agree_backward(ctx.group, grad_out, _BACKWARD)
        grad_out = grad_out.contiguous()
        if _agreeing():
            with torch.enable_grad():
                lq, lk, lv, lkeys, lvalues = (t.detach().requires_grad_() for t in (q, k, v, keys, values))
                _settle(_allgather_settle(lq, lk, lv, lkeys, lvalues, ctx.world, ctx.causal, ctx.sharding),
                        ctx.scale, return_lse=True)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkeys, dvalues = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (keys, values))
        for rows, key_rows, block_causal in ctx.blocks:  # the gathered keys' blocks first: their sum travels
            if key_rows is not None:
                g = _block_backward(q, keys[:, key_rows], values[:, key_rows], out, lse, grad_out, rows,
                                    block_causal, ctx.scale)
                dq[:, rows] += g[0]
                dkeys[:, key_rows] += g[1]
                dvalues[:, key_rows] += g[2]
        # Summed in the inputs' dtype, as autograd through the gather did.
        dk_mine, dk_work = _start_reduce_scatter(_rank_order(dkeys.to(k.dtype), 1, ctx.sharding, ctx.world), 1,
                                                 ctx.group)
        dv_mine, dv_work = _start_reduce_scatter(_rank_order(dvalues.to(v.dtype), 1, ctx.sharding, ctx.world), 1,
                                                 ctx.group)
        dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
        for rows, key_rows, block_causal in ctx.blocks:
            if key_rows is None:
                g = _block_backward(q, k, v, out, lse, grad_out, rows, block_causal, ctx.scale)
                dq[:, rows] += g[0]
                dk += g[1]
                dv += g[2]
        _wait([dk_work, dv_work])
        dk += dk_mine()
        dv += dv_mine()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, dsinks


def _allgather_settle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, world: int, causal: bool,
                      sharding: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """Every block any rank computes, rank by rank (the shards have one shape on every rank, so these calls are
    those ranks' own)."""
    return [(q[:, rows], k if key_rows is None else keys[:, key_rows], v if key_rows is None else values[:, key_rows],
             block_causal)
            for r in range(world) for rows, key_rows, block_causal in _allgather_blocks(r, world, q.shape[1], causal,
                                                                                       sharding)]


def _agreeing() -> bool:
    from ..engine._current import get_manager

    return get_manager().agreement is not None


def _settle(blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]], scale: float,
            return_lse: bool = False) -> None:
    """Decide the block calls in this order on every rank. Under group agreement (opdispatch.distributed) a new
    decision is collective, but ranks compute different blocks (rank 0 of a causal ring never sees an earlier
    shard): each rank deciding all the blocks any rank computes, in one order, keeps the collectives aligned.
    Cache hits after the first step."""
    from ..engine._current import get_manager
    from opdispatch.policies._overrides import MODULE

    manager = get_manager()
    for q, k, v, causal in blocks:
        call = validate_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                                  module=MODULE.get())
        manager.resolve("attention", call)


# -- ring -----------------------------------------------------------------------------------------------------

def _ring_blocks(rank: int, world: int, step: int, length: int, causal: bool,
                 zigzag: bool) -> tuple[slice, slice, bool] | None:
    """(query rows, key rows, causal) of the block this rank computes at `step`, holding the K/V shard of rank
    (rank − step) mod world; None when its queries see none of those keys."""
    every = slice(None)
    if not causal:
        return every, every, False
    src = (rank - step) % world
    if src == rank:  # the diagonal: causal within this rank's shard (its chunks are in sequence order)
        return every, every, True
    if zigzag:
        half = length // 2
        # An earlier rank's chunk src precedes both of ours and its chunk 2W-1-src follows both: every query sees
        # the first half. A later rank's chunks both lie between ours: only our second chunk sees them.
        return (every, slice(0, half), False) if src < rank else (slice(half, None), every, False)
    return (every, every, False) if src < rank else None


def _block_kinds(length: int, causal: bool, zigzag: bool) -> list[tuple[slice, slice, bool]]:
    """Every (query rows, key rows, causal) any rank computes, in one order (for `_settle`)."""
    if not causal:
        return [(slice(None), slice(None), False)]
    kinds = [(slice(None), slice(None), True), (slice(None), slice(None), False)]
    if zigzag:
        kinds = [kinds[0], (slice(None), slice(0, length // 2), False), (slice(length // 2, None), slice(None), False)]
    return kinds


class _Ring:
    """The ring's neighbours in `group` and one exchange step: send to the next rank, receive from the previous
    one (P2P ops take global ranks)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def start(self, tensors: list[torch.Tensor], tag: int) -> tuple[list[torch.Tensor], list[Any]]:
        import torch.distributed as dist

        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        return received, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running (out, lse) at `rows`, in place: softmax over the union of
    their keys, each side weighted by exp(its lse − the joint lse)."""
    old = lse[:, :, rows]
    joint = torch.logaddexp(old, block_lse.to(lse.dtype))
    unseen = torch.isneginf(joint)  # no key yet on either side: weights 0, not exp(-inf - -inf) = nan
    w_old = torch.where(unseen, 0.0, torch.exp(old - joint)).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(unseen, 0.0, torch.exp(block_lse.to(lse.dtype) - joint)).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * w_old + block_out.to(out.dtype) * w_new
    lse[:, :, rows] = joint


def _accumulators(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) of the local queries before any block: no key seen (float32 at least)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _attend(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, rows: slice, k: torch.Tensor, v: torch.Tensor,
            causal: bool, scale: float) -> None:
    """One block's forward (queries `rows` over k/v) on the implementation the policy picks, folded into the
    running (out, lse)."""
    from ..doors._api import attention

    block_out, block_lse = attention(q[:, rows], k, v, causal=causal, scale=scale, return_lse=True)
    _merge(out, lse, rows, block_out, block_lse)


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, rows: slice, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq of `rows`, dk, dv) of the block `_attend` computed, from the merged out and LSE."""
    return _block_grads(q[:, rows], k, v, out[:, rows].contiguous(), lse[:, :, rows].contiguous(),
                        grad_out[:, rows].contiguous(), causal, scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                zigzag: bool, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        ring = _Ring(group)
        length = q.shape[1]
        if _agreeing():
            _settle([(q[:, qr], k[:, kr], v[:, kr], c) for qr, kr, c in _block_kinds(length, causal, zigzag)],
                     scale, return_lse=True)
        out, lse = _accumulators(q, v)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for step in range(ring.world):
            pending = ring.start([k_cur, v_cur], tag=1) if step + 1 < ring.world else None
            block = _ring_blocks(ring.rank, ring.world, step, length, causal, zigzag)
            if block is not None:
                rows, keys, diagonal = block
                _attend(out, lse, q, rows, k_cur[:, keys], v_cur[:, keys], diagonal, scale)
            if pending is not None:
                _wait(pending[1])
                k_cur, v_cur = pending[0]
        out, lse = _with_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.group, ctx.causal, ctx.zigzag, ctx.scale = group, causal, zigzag, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dsinks = _sinks_gradient(ctx, out, lse, grad_out, sinks, 7)
        if not any(ctx.needs_input_grad[:3]):  # the sink's gradient alone: local, nothing to exchange
            return None, None, None, None, None, None, None, dsinks
        _agree_backward(ctx.group, grad_out, _BACKWARD)
        ring = _Ring(ctx.group)
        length, causal, zigzag, scale = q.shape[1], ctx.causal, ctx.zigzag, ctx.scale
        grad_out = grad_out.contiguous()
        if _agreeing():
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                _settle([(leaves[0][:, qr], leaves[1][:, kr], leaves[2][:, kr], c)
                         for qr, kr, c in _block_kinds(length, causal, zigzag)], scale, return_lse=True)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        dkv: list[torch.Tensor] | None = None
        dkv_pending: tuple[list[torch.Tensor], list[Any]] | None = None
        for step in range(ring.world):
            pending = ring.start([k_cur, v_cur], tag=1) if step + 1 < ring.world else None
            block = _ring_blocks(ring.rank, ring.world, step, length, causal, zigzag)
            dk_step = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_step = torch.zeros(v.shape, dtype=acc, device=v.device)
            if block is not None:
                rows, keys, diagonal = block
                g = _block_backward(q, k_cur[:, keys], v_cur[:, keys], out, lse, grad_out, rows, diagonal, scale)
                dq[:, rows] += g[0]
                dk_step[:, keys] += g[1]
                dv_step[:, keys] += g[2]
            # The gradients of the K/V shard held now travel with it, one hop behind: after the last step they
            # reach their owner.
            if dkv_pending is not None:
                _wait(dkv_pending[1])
                dk_step += dkv_pending[0][0]
                dv_step += dkv_pending[0][1]
            dkv = [dk_step, dv_step]
            dkv_pending = ring.start(dkv, tag=2)
            if pending is not None:
                _wait(pending[1])
                k_cur, v_cur = pending[0]
        assert dkv_pending is not None
        _wait(dkv_pending[1])
        dk, dv = dkv_pending[0]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks


def _with_sinks(out: torch.Tensor, lse: torch.Tensor,
                sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out, LSE) over every key, with the sinks' virtual key entered once (the shared epilogue); as
    they are without sinks. The backward reads these: each block's probabilities exp(s − lse) are then those of
    the softmax with the sink, and FlashAttention's D = rowsum(dO · out) is that softmax's too."""
    if sinks is None:
        return out, lse
    from ..ops._sinks import apply_sinks

    return apply_sinks(out, lse, sinks, "bshd")


def _sinks_gradient(ctx: Any, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                    sinks: torch.Tensor | None, index: int) -> torch.Tensor | None:
    """This rank's share of the sinks' gradient (`index`: sinks' place among the Function's inputs), from the
    final out and LSE: the sink is a key of zero value with probability exp(sink − lse), so its score's gradient
    is −exp(sink − lse)·rowsum(dO · out), summed over this rank's queries (batch and rows), per head."""
    if sinks is None or not ctx.needs_input_grad[index]:
        return None
    acc = lse.dtype
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (batch, heads, rows), as the LSE
    share = torch.exp(sinks.to(acc).unsqueeze(-1) - lse)
    return -(share * delta).sum((0, 2)).to(sinks.dtype)


def _block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the merged out and LSE of its queries (FlashAttention's backward: it reads
    the softmax only through them, so each block's share is exact). The chosen implementation's own `backward`
    where it has one; the same formula in torch otherwise."""
    from ..engine._current import get_manager
    from opdispatch.policies._overrides import MODULE

    manager = get_manager()
    with torch.enable_grad():  # decided as a training call: an implementation with a backward
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        call = validate_attention(*leaves, causal=causal, scale=scale, return_lse=True, module=MODULE.get())
        chosen = manager.resolve("attention", call).chosen
    assert isinstance(chosen, AttentionImpl)
    impl = chosen
    with torch.no_grad():
        plain = validate_attention(q, k, v, causal=causal, scale=scale, return_lse=True, module=MODULE.get())
        grads = impl.backward(impl.conform(plain), out, lse, grad_out)
        if grads is not None:
            return grads
        return _torch_block_grads(q, k, v, out, lse, grad_out, causal, scale)


def _torch_block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       grad_out: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block backward in torch (bshd, GQA by repeating K/V heads), for implementations without `backward`."""
    acc = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.to(acc).transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    do, o = grad_out.to(acc).transpose(1, 2), out.to(acc).transpose(1, 2)
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vh.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale
    b, h, s, _ = dk.shape
    dk = dk.view(b, h // groups, groups, s, -1).sum(2)
    dv = dv.view(b, h // groups, groups, s, -1).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
