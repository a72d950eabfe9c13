"""`flash_attn_with_kvcache`'s checked append as one Triton kernel, for the bound path on a GPU (issue 31).

The device-side check written with torch ops (`_KvcacheBound._checked_on_device`, then the append) launches about
a dozen small kernels per decode step — clamps, comparisons, a reduction, the report's concatenation, a gather and
a `where` per cache so that an invalid call writes each slot's old value back, then an indexed store per cache —
and a decode step is host-bound: on an H100 host each launch costs more than the attention kernel's work
(benchmarks/results/h100-69e872f/kvcache_decode-paged0-h100.md: 405 µs per step against 181 for the raw kernel
with its `index_put_`). Here the same check and append are one launch, `verdict_append` (a program per appended
key and tile of heads × dim): every program checks every index exactly as `_kvcache_indices` checks it — lengths
within ``0..capacity - new``, ``cache_batch_idx`` rows in range and distinct, the block table's used entries naming
existing pages, the appended slots distinct — from the same inputs, so all programs reach the same verdict; program
(0, 0) alone writes the report row (verdict, then the lengths, rows and table as given: what `_Recheck` turns into
the reference path's message), the verdict as a bool, the lengths after the append and the rows or table clamped
into range (what the attention kernel reads); each program stores its key's tile only when the verdict is good —
all-or-nothing without reading the old values.

Where a block table has more than `SINGLE_MAX_TABLE` entries (every program would read all of it) the check and
the append are two launches: `verdict` (one program, the same check and writes) then `append` (which reads the
verdict's device word). Both paths give the same bits (tests/gpu/test_kv_index_checks_gpu.py).

Limits (the bound path keeps its torch-op check beyond them): at most `MAX_SLOTS` appended keys per call,
`MAX_PAIRS` sequences with ``cache_batch_idx`` or appended keys into pages (those checks compare every pair in one
program) and `MAX_TABLE` block-table entries. A kernel that fails to compile or launch hands its signature back
to the torch ops, with one warning (nothing is written before the kernel that appends runs).

After a signature's first call the kernels are launched through their compiled kernels' C launcher, skipping
`JITFunction.run`'s binder, specialization and cache key (~60 µs of host time per launch on the H100 host) and the
launcher's Python wrapper; the current device and stream are checked once per call (`stream_for`; the NaN kernel's
launch after the attention only checks again that the device is still current, `stream_again`), each device tensor
passed as its address (an int: the launcher then skips its ``data_ptr()`` call and the driver's
``cuPointerGetAttribute``, 14 driver calls per dense decode step; the report row stays a tensor, so the launcher
still checks that the device can address its pinned host memory):
`core.compat._triton_direct`, which says which Triton 3.6.0 internals that relies on and when it falls back.

Per call the host does little else: the verdict, lengths and clamped indices go to device buffers made once per
(stream, thread) and reused (`Scratch`; fresh, never kept, during CUDA graph capture); the report row is a ring row
of core.base._kv_checks (pinned host memory) that the verdict kernel writes directly — no device copy; and a
third kernel, `poison`, makes a bad call's output NaN in place (one launch, no allocation; autograd outputs keep
torch.where).

Triton is optional (the `flagos` extra, or the one torch's CUDA wheels bring): `available()` says whether this path
can run. ``OPDISPATCH_KV_APPEND=triton`` forces it on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import torch

from ._triton_direct import DirectKernel, stream_again

MODE_ENV = "OPDISPATCH_KV_APPEND"  # "triton": the kernels on CPU too (under TRITON_INTERPRET=1); "torch": never
MAX_SLOTS = 256  # appended keys per call (batch × new)
# The distinct-rows and distinct-slots checks compare every pair in one program's registers: at most 64 x 64
# (the sizes the GPU tests compiled and ran; 256 x 256 would spill every thread's registers).
MAX_PAIRS = 64
MAX_TABLE = 1 << 16  # block-table entries (batch × width)
# The check and append as one kernel (`verdict_append`) up to this many block-table entries: each of its programs
# reads the whole table to work the verdict out (beyond it, the two-kernel path: one program checks, once).
SINGLE_MAX_TABLE = 4096
_TILE = 1024  # heads × dim elements one append program copies


@functools.cache
def _triton() -> Any:
    try:
        import triton
        import triton.language  # noqa: F401  (the kernels' tl)
    except ImportError:
        return None
    return triton


def available(device: torch.device, batch: int, new: int, width: int, has_rows: bool) -> bool:
    """Whether the fused check and append can take a call on `device` appending `new` keys to each of `batch`
    sequences (`width`: the block table's, 0 for a dense cache; `has_rows`: a cache_batch_idx)."""
    mode = os.environ.get(MODE_ENV, "")
    if (mode == "torch" or new == 0 or batch * new > MAX_SLOTS or batch * max(width, 1) > MAX_TABLE
            or (has_rows and width) or (has_rows and batch > MAX_PAIRS) or (width and batch * new > MAX_PAIRS)):
        return False
    if device.type != "cuda" and mode != "triton":
        return False
    return _triton() is not None


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    """(verdict, append, poison, verdict_append): the Triton kernels, imported at first use (Triton is
    optional)."""
    from . import _kv_append_triton as kernels

    return kernels.verdict, kernels.append, kernels.poison, kernels.verdict_append


def _stream_handle(device: torch.device) -> int:
    """The current stream of `device` as an int (what Triton's launcher reads: ``driver.active.get_current_stream``
    is ``torch._C._cuda_getCurrentRawStream``); 0 elsewhere (CPU runs in program order)."""
    if device.type == "cuda":
        return int(torch._C._cuda_getCurrentRawStream(device.index))
    return 0


def _capturing(device: torch.device) -> bool:
    """Whether CUDA graph capture is under way on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream_object(device: torch.device) -> Any:
    """The current stream as a torch stream (what an event records on); None on CPU."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class VerdictQueued(RuntimeError):
    """The append kernel failed to launch after the verdict kernel was queued: the report it was given will be
    written (its caller defers it), and the caches were not touched."""


class Scratch:
    """One (stream, thread)'s device buffers of a signature, reused by each of its calls (in stream order a call's
    kernels finish reading them before the next call's verdict kernel writes them): `words` (int32: the verdict,
    the lengths after the append, then the rows or table clamped) and `bad` ((1,) bool); `stream` the torch
    stream their calls run on (None on CPU, or not kept); `kept` False for one call's own (CUDA graph capture)."""

    __slots__ = ("words", "bad", "verdict", "lens_out", "safe", "stream", "kept", "outputs", "pointers")

    def __init__(self, fused: FusedAppend, device: torch.device, stream: Any, kept: bool) -> None:
        batch = fused.batch
        safe = batch * fused.width if fused.paged else batch if fused.has_rows else 0
        self.words = torch.empty(1 + batch + safe, dtype=torch.int32, device=device)
        self.bad = torch.empty(1, dtype=torch.bool, device=device)
        self.verdict, self.lens_out = self.words[:1], self.words[1:1 + batch]
        self.safe = (self.words[1 + batch:].view(batch, fused.width) if fused.paged
                     else self.words[1 + batch:] if fused.has_rows else None)
        self.stream, self.kept = stream, kept
        # The kernels' output parameters (bad, verdict, lens_out, safe — the lengths where nothing is clamped), in
        # their declaration order: one tuple, not four attribute reads per call.
        self.outputs = (self.bad, self.verdict, self.lens_out, self.safe if self.safe is not None else self.lens_out)
        # Their device addresses, for the direct launches (`DirectKernel.launch_direct`): the buffers never move.
        self.pointers = tuple(t.data_ptr() for t in self.outputs)


SCRATCH_LIMIT = 64  # (stream, thread) pairs a signature keeps buffers for: streams and threads come and go


class FusedAppend:
    """The fused check and append of one bound signature: the launch constants worked out once, and
    ``__call__(lens, rows, table, k, v, k_cache, v_cache, report)`` -> the call's `Scratch` (its lengths after the
    append, the rows or table clamped, `bad`) once both kernels are queued, the report row (``report_width``
    int32 entries: a ring row of core.base._kv_checks, or a device tensor) written in stream order. A call has
    rows (``cache_batch_idx``) or a table, not both. ``poison(scratch, result)`` makes a bad call's result NaN."""

    __slots__ = ("batch", "new", "width", "page", "cache_rows", "max_len", "has_rows", "paged", "blocks",
                 "heads_dim", "dim", "report_width", "single", "verdict", "append", "verdict_append", "poisoner",
                 "poison_failed", "verdict_grid", "append_grid", "append_block", "scratches", "lock",
                 "report_on_host", "index", "sizes", "flags", "dense_table")

    def __init__(self, batch: int, new: int, width: int, page: int, cache_rows: int, capacity: int,
                 has_rows: bool, paged: bool, heads_k: int, dim: int, device: torch.device) -> None:
        self.batch, self.new, self.width, self.page, self.cache_rows = batch, new, width, page, cache_rows
        # The CUDA device the call's tensors are on (the kernels launch there); None on CPU (the interpreter).
        self.index = device.index if device.type == "cuda" else None
        self.max_len, self.has_rows, self.paged = capacity - new, has_rows, paged
        self.blocks = (_next_power_of_2(batch), _next_power_of_2(batch * new),
                       min(_next_power_of_2(max(width, 1)), max(16, 4096 // _next_power_of_2(batch))))
        self.heads_dim, self.dim = heads_k * dim, dim
        self.report_width = 1 + batch + (batch if has_rows else 0) + (batch * width if paged else 0)
        # The kernels, launched directly after their first call (core.compat._triton_direct): one set per bound
        # signature, made at its first call (Triton imported then, inside the caller's fallback).
        # One kernel (`verdict_append`) where its programs can each afford the whole check, else two.
        self.single = batch * width <= SINGLE_MAX_TABLE
        self.verdict: DirectKernel | None = None
        self.append: DirectKernel | None = None
        self.verdict_append: DirectKernel | None = None
        self.poisoner: DirectKernel | None = None
        self.poison_failed = False  # the NaN kernel failed to launch once: the caller's torch op from then on
        self.verdict_grid, self.append_grid = (1, 1, 1), (batch * new, -(-self.heads_dim // _TILE), 1)
        self.append_block = min(_TILE, _next_power_of_2(self.heads_dim))
        # The launch arguments that are fixed for this signature, as the runs of the parameter lists they fill
        # (built once: a call adds its tensors and strides around them).
        self.sizes = (batch, new, width, page, cache_rows, capacity - new)
        self.flags = (has_rows, paged, *self.blocks, -(-width // self.blocks[2]))
        self.dense_table = (0, 0)  # a call without a table: its strides
        # Buffers per (stream, thread): a call on another stream is not ordered after this one's readers, and two
        # threads on one stream could interleave their launches between a verdict and its append.
        self.scratches: dict[tuple[int, int], Scratch] = {}
        self.lock = threading.Lock()
        # Whether the verdict kernel writes its report straight into a report ring row (pinned host memory, which a
        # CUDA device addresses); the caller clears it where that launch fails, and passes a device row instead.
        self.report_on_host = True

    def scratch(self, device: torch.device, stream: int | None = None) -> Scratch:
        """The current (stream, thread)'s buffers (`stream`: the current stream's handle where the caller has it
        from `stream_for`), made at its first call; during CUDA graph capture fresh ones, never kept (a graph
        replays into its own memory: a kept buffer would be shared by eager calls and replays that no stream
        orders)."""
        key = (stream if stream is not None else _stream_handle(device), threading.get_ident())
        scratch = self.scratches.get(key)
        if scratch is not None:
            return scratch
        if _capturing(device):
            return Scratch(self, device, None, kept=False)
        scratch = Scratch(self, device, _stream_object(device), kept=True)
        with self.lock:
            if len(self.scratches) >= SCRATCH_LIMIT:  # the oldest goes (its queued readers keep their memory)
                self.scratches.pop(next(iter(self.scratches)))
            return self.scratches.setdefault(key, scratch)

    def __call__(self, lens: torch.Tensor, rows: torch.Tensor | None, table: torch.Tensor | None, k: torch.Tensor,
                 v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, report: torch.Tensor,
                 scratch: Scratch, stream: int | None) -> None:
        """Queue the check and append (`stream`: `stream_for(self.index)`, for the direct launches)."""
        # Every parameter in declaration order (constexprs too: what a direct launch passes); the key holds the
        # ints that may change between calls (the strides), all else is fixed for this signature.
        table_strides = table.stride() if table is not None else self.dense_table
        strides = (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride())
        key = (*table_strides, *strides)
        outputs, index = scratch.outputs, self.index
        # Each kernel launched directly where it can, its tensors as device addresses (`launch_direct`: the
        # launcher asks the driver about none of them but the report row, whose pinned host memory it checks a
        # device can address); else through `launch`, with the tensors.
        if self.single:
            kernel = self.verdict_append
            if kernel is None:
                kernel = self.verdict_append = DirectKernel(_kernels()[3])
            ptr = lens.data_ptr()
            if not kernel.launch_direct(self.append_grid, (
                    ptr, rows.data_ptr() if rows is not None else ptr, table.data_ptr() if table is not None else ptr,
                    report, *scratch.pointers, k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    *self.sizes, *table_strides, self.heads_dim, self.dim, *strides, *self.flags,
                    self.append_block), key, index, stream):
                kernel.launch(self.append_grid, (
                    lens, rows if rows is not None else lens, table if table is not None else lens, report, *outputs,
                    k, v, k_cache, v_cache, *self.sizes, *table_strides, self.heads_dim, self.dim, *strides,
                    *self.flags, self.append_block), key, index, stream)
            return
        if self.verdict is None or self.append is None:
            verdict, append, _, _ = _kernels()
            self.verdict, self.append = DirectKernel(verdict), DirectKernel(append)
        ptr = lens.data_ptr()
        if not self.verdict.launch_direct(self.verdict_grid, (
                ptr, rows.data_ptr() if rows is not None else ptr, table.data_ptr() if table is not None else ptr,
                report, *scratch.pointers, *self.sizes, *table_strides, *self.flags), table_strides, index, stream):
            self.verdict.launch(self.verdict_grid, (
                lens, rows if rows is not None else lens, table if table is not None else lens, report, *outputs,
                *self.sizes, *table_strides, *self.flags), table_strides, index, stream)
        tail = (self.new, self.heads_dim, self.dim, self.page, self.width, *strides, self.has_rows, self.paged,
                self.append_block)
        try:
            if not self.append.launch_direct(self.append_grid, (
                    k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *scratch.pointers[1:],
                    *tail), strides, index, stream):
                self.append.launch(self.append_grid, (k, v, k_cache, v_cache, *outputs[1:], *tail), strides, index,
                                   stream)
        except Exception as exc:
            raise VerdictQueued(f"{type(exc).__name__}: {exc}") from exc

    def poison(self, scratch: Scratch, result: Any, stream: int | None) -> bool:
        """`result` (the output, or the output and its LSE) NaN in place where the call's verdict is bad, as one
        launch (`stream`: what `stream_for` gave the call's check and append, checked again by `stream_again`);
        False (nothing launched) where it does not suit that — autograd holds it (an in-place write would
        break its backward), not contiguous or too large, or the kernel failed to launch (then never again) — and
        the caller poisons it itself."""
        out, lse = (result[0], result[1]) if type(result) is tuple and len(result) == 2 else (result, None)
        if (self.poison_failed or type(out) is not torch.Tensor or out.requires_grad or not out.is_contiguous()
                or (lse is not None and (type(lse) is not torch.Tensor or lse.requires_grad
                                         or not lse.is_floating_point() or not lse.is_contiguous()))):
            return False
        out_numel, lse_numel = out.numel(), lse.numel() if lse is not None else 0
        numel = max(out_numel, lse_numel)
        if numel >= 1 << 31:
            return False
        if numel == 0:
            return True  # nothing to make NaN
        try:
            poisoner = self.poisoner
            if poisoner is None:
                poisoner = self.poisoner = DirectKernel(_kernels()[2])
            grid, key = (-(-numel // _POISON_BLOCK), 1, 1), (out.dtype, lse.dtype if lse is not None else None)
            stream = stream_again(stream, self.index)
            sizes = (out_numel, lse_numel, lse is not None, _POISON_BLOCK)
            ptr = out.data_ptr()
            if not poisoner.launch_direct(grid, (ptr, lse.data_ptr() if lse is not None else ptr,
                                                 scratch.pointers[1], *sizes), key, self.index, stream):
                poisoner.launch(grid, (out, lse if lse is not None else out, scratch.verdict, *sizes), key,
                                self.index, stream)
        except Exception as exc:  # raised before anything was queued: the caller's torch op, from now on
            self.poison_failed = True
            _log.warning("flash_attn_with_kvcache: the NaN kernel for a bad call's output failed (%s: %s); "
                         "torch.where does it from now on", type(exc).__name__, exc)
            return False
        return True


_POISON_BLOCK = 1024
_log = logging.getLogger("opdispatch")
