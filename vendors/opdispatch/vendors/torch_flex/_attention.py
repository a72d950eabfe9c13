"""`torch.flex`: torch's FlexAttention (`torch.nn.attention.flex_attention`), compiled, as the fused fallback for
the calls the vendor kernels cannot take (softcap or ALiBi with gradients, head dims that are not a multiple of 8,
large head dims, windows combined with other features, deterministic training, varlen with any of these).

Every feature is expressed the way FlexAttention wants it, so the whole call stays one fused Triton kernel:
- positions (causal, either alignment, windows, varlen documents) as a block mask from `create_block_mask`,
  whose fully masked tiles the kernel skips; dense masks are cached in a bounded LRU keyed on everything they
  depend on;
- softcap, ALiBi and an additive bias as a `score_mod`; a boolean `attn_mask` as a `mask_mod`;
- KV caches (`seqused_k`) as a block mask of each sequence's fill, built per call (it depends on the lengths'
  values), causal/window/ALiBi aligned at that fill; paged caches (`block_table`, pages of any size) by gathering
  the pages each block table names into a dense cache first (the plugins toolkit's `gathered_pages`, declined past
  its `PAGED_GATHER_MAX_BYTES`), then the same path. Packed (thd) queries over a cache use the varlen document
  tables with a per-token "key within its sequence's fill" table.
Numbers the mods read (alignment offset, window sides, softcap, per-token document tables) are captured as
tensors, never Python scalars: dynamo guards a captured Python number by value and would recompile for every new
window or softcap, while a captured tensor is guarded only by its metadata (checked on torch 2.13: new closures
with new tensor constants reuse the compiled graph; a new sequence length recompiles once, then shapes go dynamic).

Limits read from torch 2.13 (`torch/nn/attention/flex_attention.py`, `torch/_inductor/kernel/flex/*`), the same
checks as 2.11 where it matters here:
- q/k and v head dims >= 16 ("tl.dot does not support embedding size less than 16"); any size above that —
  non-powers of two are padded to the next power of two inside the kernel (`QK_HEAD_DIM_ROUNDED`,
  `SAFE_HEAD_DIM`), v may have its own head dim. Head dims above 256 fall to small untuned tiles
  (`get_flex_attn_fwd_configs`) and, rounded to 1024 for 576, may not fit shared memory: off unless the
  `max_head_dim` option raises the limit (tests/gpu/test_flex_gpu.py measures MLA 576/512).
- GQA through `enable_gqa` (q heads a multiple of kv heads); the decode kernel (seqlen_q < 128) is only picked
  for power-of-two ratios, other ratios run the main kernel.
- No dropout. No backward on the CPU (`_validate_device` refuses inputs that require grad there).
- LSE: the kernel keeps it in log2; the public API multiplies by ln 2 before returning it (`_finalize_outputs`,
  `stats_are_log2`; torch 2.5-2.8 did `lse * math.log(2)` in the same place), so what it returns — and what
  this adapter returns — is the natural log. A query whose block-mask row is empty gets output 0 and lse -inf.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import (bind_dense, gathered_pages, kernel_window, paged_as_dense, paged_gather_reason,
                                        uniform_cu_seqlens)

_MIN_HEAD_DIM = 16  # tl.dot's minimum K; flex raises NotImplementedError below it on every GPU backend
_MIN_TORCH = "2.5"  # flex_attention public, with enable_gqa, return_lse and backward
# The first torch whose flex this project ran with non-power-of-two head dims and a v head dim of its own (padded
# to QK/V_HEAD_DIM_ROUNDED, pytorch#133495). torch 2.6's flex refuses them ("NYI: Currently non power of 2
# embedding dimension are not supported", meta-pytorch/attention-gym#127); 2.7-2.10 are not verified here.
_ANY_HEAD_DIM_TORCH = "2.11"


def _torch_version(device: DeviceInfo) -> Version | None:
    """The torch version of `device`: its descriptor's, else the running torch's."""
    text = device.libraries.get("torch") or torch.__version__
    try:
        return Version(text.split("+")[0])
    except InvalidVersion:
        return None


def old_torch_reason(call: AttentionCall, device: DeviceInfo) -> str | None:
    """Why this device's torch is too old for the call's head dims (None when it is not)."""
    version = _torch_version(device)
    if version is None or version >= Version(_ANY_HEAD_DIM_TORCH):
        return None
    dims = {call.head_dim, call.head_dim_v}
    if all(d & (d - 1) == 0 for d in dims) and len(dims) == 1:
        return None
    return (f"torch {version} < {_ANY_HEAD_DIM_TORCH}: head_dim {call.head_dim}/{call.head_dim_v} (q·k/v) needs "
            f"flex's rounding of non-power-of-two or unequal head dims, verified from torch {_ANY_HEAD_DIM_TORCH} "
            "(torch 2.6 raises 'NYI: Currently non power of 2 embedding dimension are not supported')")


# Device types of vendor torch builds (all PrivateUse1) that flex_attention refuses before building any kernel,
# whatever the torch version or Triton build: its device check names no PrivateUse1 type (pytorch#148656 added hpu
# and left PrivateUse1 open). What each vendor publishes about it (read 2026-11):
_FLEX_REFUSED_DEVICE_TYPES = {
    "npu": ("Ascend's torch_npu does not lift it (Ascend/pytorch#147, open: 'torch_npu不支持flex_attention'); "
            "training there runs on ascend.fusion_attention (torch_npu.npu_fusion_attention)"),
    "mlu": "torch_mlu publishes no flex support; training there goes to cambricon.sdpa (torch_mlu's fused SDPA)",
    "musa": "torch_musa publishes no flex support; training there goes to mthreads.sdpa (torch_musa's fused SDPA)",
}


class FlexOptions(BaseModel):
    """Policy knobs of `torch.flex` (`ops.attention.options."torch.flex"` in the policy YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compile: bool = Field(
        default=True, description="run torch.compile(flex_attention) (the fused kernel). False runs flex eagerly: "
                                  "it materialises the score matrix, for tests and debugging only")
    cpu: bool = Field(
        default=False, description="take calls on the CPU too. Off by default: cpu.flash is faster there, and "
                                   "flex has no backward on the CPU")
    max_head_dim: int = Field(
        default=256, ge=_MIN_HEAD_DIM,
        description="largest q/k or v head dim taken; flex's tuned tiles stop at 256 (MLA's 576/512 needs more)")
    kernel_options: dict[str, Any] | None = Field(
        default=None, description="passed to flex_attention as kernel_options (tile sizes, stages, "
                                  "FORCE_USE_FLEX_ATTENTION to skip the split-KV decoding kernel); None: torch's "
                                  "own choice")
    block_mask_cache: int = Field(
        default=64, ge=0, description="how many positional block masks (per shape, window, alignment, device) "
                                      "to keep; 0 rebuilds them every call")


class _AcceleratorRequirement(Requirement):
    """A library only the compiled GPU kernel needs (Triton); the CPU path runs without it."""

    def unmet_reason(self, device: DeviceInfo) -> str | None:
        if device.type == "cpu":
            return None
        return super().unmet_reason(device)


@functools.cache
def _flex_api() -> Any:
    from torch.nn.attention import flex_attention as module

    return module


def _flex_entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """The function this adapter compiles. dynamo caches graphs per code object, shared by every torch.compile
    of it: compiling flex_attention itself would share graphs with a caller's own torch.compile(flex_attention),
    compiled under the caller's config (donated buffers on, see `retainable`). This code object is ours alone.
    The module is read as an attribute chain, not through `_flex_api` (dynamo warns on every trace of a cached
    function); `_compiled_flex` imports it first."""
    return torch.nn.attention.flex_attention.flex_attention(q, k, v, **kwargs)


def _flex_entry_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """`_flex_entry` for (batch, seq, heads, dim) tensors, the layout's transposes inside the compiled graph: a bound
    bshd call then pays no permute per tensor on the host (four per call were part of torch.flex's host time beyond
    torch's own compiled flex on an H100, benchmarks/results/flex_variants-h100.md). Its own code object: dynamo's
    graphs and recompile limit are counted per code object."""
    flex = torch.nn.attention.flex_attention.flex_attention
    return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs).transpose(1, 2)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """torch.compile(flex_attention), created once per process: that is how torch turns it into one fused kernel.
    dynamo then keeps one graph per variant of mods and flags (and goes dynamic over sequence lengths)."""
    _flex_api()  # imports torch.nn.attention.flex_attention, which _flex_entry reads as an attribute
    return torch.compile(_flex_entry)


@functools.cache
def _compiled_flex_bshd() -> tuple[Callable[..., Any], Any, Callable[..., Any]]:
    """The bshd entry as `_call_compiled` takes it: (compiled, its code object, the same function uncompiled)."""
    _flex_api()
    return torch.compile(_flex_entry_bshd), _flex_entry_bshd.__code__, _flex_entry_bshd


# dynamo keeps at most `recompile_limit` (8) graphs per function and runs anything beyond them eagerly — for
# flex, the unfused path that materialises the scores. One graph per variant (mods, GQA, LSE, grad, dtype) can
# pass 8 in a process that sees many kinds of calls, so calls into the compiled flex raise the limit to this.
# Past it, dynamo is told to raise instead of falling back silently, so the fall back to the unfused path (O(S^2)
# memory) is logged once with the fix.
_RECOMPILE_LIMIT = 64
_warned_unfused = False


@functools.cache
def _dynamo_names() -> tuple[str, str | None, type[BaseException] | None]:
    """(limit setting, fail-on-limit setting, its exception) under this torch's names: recompile_limit and
    fail_on_recompile_limit_hit where they exist (2.11, 2.13; older: cache_size_limit, fail_on_cache_limit_hit,
    or no fail switch at all — then the limit is only raised)."""
    config, exc = torch._dynamo.config, torch._dynamo.exc
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    for name, error in (("fail_on_recompile_limit_hit", "FailOnRecompileLimitHit"),
                        ("fail_on_cache_limit_hit", "FailOnCacheLimitHit")):
        if hasattr(config, name) and hasattr(exc, error):
            return limit, name, getattr(exc, error)
    return limit, None, None


_limit_read = [-1, 0]  # [graphs held when dynamo's limit was last read, that limit]


def _call_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any],
                   entry: tuple[Callable[..., Any], Any, Callable[..., Any]] | None = None) -> Any:
    """The compiled flex on (batch, heads, seq, dim) tensors, or through `entry` — (compiled, code, uncompiled),
    as `_compiled_flex_bshd` gives — on its layout."""
    limit_name, fail_name, fail_error = _dynamo_names()
    config = torch._dynamo.config
    graphs = _graphs_compiled() if entry is None else _graphs_compiled(entry[1])
    if graphs != _limit_read[0]:  # reading torch's config costs ~1 µs: once per new graph count, not per call
        _limit_read[:] = graphs, getattr(config, limit_name)
    compiled = _compiled_flex() if entry is None else entry[0]
    if graphs < _limit_read[1] - 1:
        # Room for another graph under the user's own limit: this call cannot reach it, whatever it compiles, so
        # neither the raised limit nor the fail switch matters (no config scope: its writes cost host time).
        return compiled(q, k, v, **kwargs)
    settings = {limit_name: max(getattr(config, limit_name), _RECOMPILE_LIMIT)}
    if fail_name:
        settings[fail_name] = True
    with _config_scope(config, settings):
        try:
            return compiled(q, k, v, **kwargs)
        except Exception as exc:
            if fail_error is None or not isinstance(exc, fail_error):
                raise
            _warn_unfused(getattr(config, limit_name))
            return (_flex_api().flex_attention if entry is None else entry[2])(q, k, v, **kwargs)


def _graphs_compiled(code: Any = None) -> int:
    """How many graphs dynamo holds for a compiled flex entry (its cache entries on the entry's code; default
    `_flex_entry`'s)."""
    entries = _cache_entry_reader()
    return 1 << 30 if entries is None else len(entries(_flex_entry.__code__ if code is None else code))


@functools.cache
def _cache_entry_reader() -> Callable[[Any], list[Any]] | None:
    """dynamo's list of cache entries of a code object: the C function itself where this torch exposes it (its
    Python wrapper doubles the cost), else the wrapper, else None (then the limit counts as near: the scope is
    always entered)."""
    reader = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    reader = getattr(reader, "_debug_get_cache_entry_list", None)
    if reader is not None:
        return reader  # type: ignore[no-any-return]
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return _debug_get_cache_entry_list  # type: ignore[no-any-return]


@contextlib.contextmanager
def _config_scope(module: Any, settings: dict[str, Any]) -> Iterator[None]:
    """torch config `settings` for the scope, restored after it: what ``module.patch`` does, without its cost (it
    defines a class per use; two such scopes on every call were most of torch.flex's host time beyond torch's
    own compiled flex, benchmarks/results/flex_variants-h100.md). Only settings that differ are written."""
    changed = [(name, getattr(module, name)) for name, value in settings.items() if getattr(module, name) != value]
    for name, _ in changed:
        setattr(module, name, settings[name])
    try:
        yield
    finally:
        for name, prior in reversed(changed):
            setattr(module, name, prior)


def _no_donated_buffers() -> Any:
    """AOTAutograd config scope with donated buffers off (torch 2.13, torch/_functorch/_aot_autograd)."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "donated_buffer"):  # a torch without donated buffers: nothing to turn off
        return contextlib.nullcontext()
    return _config_scope(functorch_config, {"donated_buffer": False})


class _RetainableGraph(torch.autograd.Function):
    """Runs ``fn`` on detached leaves with its own autograd graph, and backprops through that graph on request.

    Why (issue 27): AOTAutograd compiles a backward with *donated buffers* (saved activations it overwrites in
    place) when ``torch._functorch.config.donated_buffer`` is on while the forward graph is compiled, and its
    runtime (`_backward_impl` in runtime_wrappers.py) refuses any ``retain_graph=True`` backward when the global
    flag is on at backward time and ``bw_donated_idxs != []`` — which holds both for a donating graph and for one
    compiled without donation (idxs None). The outer autograd engine calls that backward directly, outside any
    scope of ours, so the compiled graph is kept inside this Function: its forward runs (and compiles) ``fn``
    with donation off, and its backward runs ``torch.autograd.grad`` over the inner graph with donation off
    again (the backward graph may compile lazily there), forwarding the outer task's ``retain_graph``. A graph
    compiled without donation keeps its saved tensors intact, so it may be backpropagated any number of times.
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], *tensors: torch.Tensor) -> Any:
        leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        with torch.enable_grad(), _no_donated_buffers():
            result = fn(*leaves)
        single = isinstance(result, torch.Tensor)
        outputs = (result,) if single else tuple(result)
        ctx.leaves, ctx.outputs = leaves, outputs
        ctx.set_materialize_grads(False)  # an output without a gradient (an unused LSE) costs nothing
        # Detached results share storage and version counter with the inner outputs: an in-place change of a
        # returned tensor still fails the inner backward's saved-tensor check, as it would without this wrapper.
        returned = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*(r for r, o in zip(returned, outputs) if not o.requires_grad))
        return returned[0] if single else returned

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ctx.outputs is None:
            raise RuntimeError("torch.flex: backward through this graph a second time, but the earlier backward "
                               "freed it; pass retain_graph=True to every backward but the last")
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, leaf in enumerate(ctx.leaves) if leaf.requires_grad and ctx.needs_input_grad[1 + i]]
        result: list[torch.Tensor | None] = [None] * (1 + len(ctx.leaves))
        if pairs and wanted:
            with _no_donated_buffers():
                got = torch.autograd.grad([o for o, _ in pairs], [ctx.leaves[i] for i in wanted],
                                          [g for _, g in pairs], retain_graph=keep_graph,
                                          create_graph=torch.is_grad_enabled(), allow_unused=True)
            for i, g in zip(wanted, got):
                result[1 + i] = g
        if not keep_graph:
            ctx.leaves = ctx.outputs = None  # the inner graph freed its saved tensors; drop the rest now
        return tuple(result)


def retainable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (tensors -> a tensor or a tuple of tensors, typically calling a ``torch.compile``d function),
    compiled and backpropagated without donated buffers, so ``backward(retain_graph=True)`` works any number of
    times (see `_RetainableGraph`). Without a gradient to track it calls ``fn`` as it is; under an outer
    ``torch.compile`` trace it calls ``fn`` directly: the outer graph is compiled, and donates, by its own config.
    """

    @functools.wraps(fn)
    def call(*tensors: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and not torch.compiler.is_compiling():
            return _RetainableGraph.apply(fn, *tensors)
        return fn(*tensors)  # no gradient (an inference graph donates nothing: no scope to pay), or traced

    return call


def _warn_unfused(limit: int) -> None:
    global _warned_unfused
    if not _warned_unfused:
        _warned_unfused = True
        logging.getLogger("opdispatch").warning(
            "torch.flex: the compiled flex_attention reached dynamo's recompile limit (%d graphs in this process); "
            "calls of new variants now run flex unfused, which materialises the (seqlen_q x seqlen_k) scores. Fix: "
            "raise torch._dynamo.config.recompile_limit, or torch._dynamo.reset() between workloads.", limit)


def _aux_request() -> Any:
    """`return_aux=AuxRequest(lse=True)` where torch has it (return_lse is deprecated there), else None."""
    request = getattr(_flex_api(), "AuxRequest", None)
    return None if request is None else request(lse=True)


# -- positional masks -----------------------------------------------------------------------------------------

class _Positions:
    """The positional pattern of one call, as tensors the mods capture.

    Dense calls: query i sits at aligned position i + offset, key j at j. Dense KV caches: the offset is per
    sequence (`batch_offset`, from its fill `used`). Varlen calls: per-token tables of the document, the aligned
    position within the document (i - start_q + offset_doc) and the key position within its document
    (j - start_k); over a KV cache also `kvalid`, whether a key lies within its sequence's fill.
    """

    __slots__ = ("offset", "left", "right", "doc_q", "doc_k", "qpos", "kpos", "mask_mod", "block_mask",
                 "batch_offset", "used", "kvalid")

    def __init__(self) -> None:
        # Set by the builders: dense calls fill offset/left/right, varlen calls also the per-token tables.
        self.offset: torch.Tensor | None = None
        self.left: torch.Tensor | None = None
        self.right: torch.Tensor | None = None
        self.doc_q: torch.Tensor | None = None
        self.doc_k: torch.Tensor | None = None
        self.qpos: torch.Tensor | None = None
        self.kpos: torch.Tensor | None = None
        self.mask_mod: Callable[..., Any] | None = None
        self.block_mask: Any = None
        self.batch_offset: torch.Tensor | None = None
        self.used: torch.Tensor | None = None
        self.kvalid: torch.Tensor | None = None

    def distance(self, b: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        """j - (i + o): negative for keys before the aligned diagonal."""
        if self.qpos is not None:
            return self.kpos[ki] - self.qpos[qi]
        if self.batch_offset is not None:
            return ki - qi - self.batch_offset[b]
        return ki - qi - self.offset


def _positional_mask_mod(pos: _Positions, causal: bool, has_left: bool, has_right: bool,
                         varlen: bool) -> Callable[..., Any] | None:
    """mask_mod for causal / window / document: True where query qi may see key ki."""
    if not (causal or has_left or has_right or varlen):
        return None
    if not varlen:
        return _dense_mask_mod(pos.offset, pos.left, pos.right, causal, has_left, has_right)

    kvalid = pos.kvalid

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        rel = pos.distance(b, qi, ki)
        clauses = []
        if varlen:
            clauses.append(pos.doc_q[qi] == pos.doc_k[ki])
        if kvalid is not None:
            clauses.append(kvalid[ki])
        if causal:
            clauses.append(rel <= 0)
        if has_left:
            clauses.append(rel >= -pos.left)
        if has_right:
            clauses.append(rel <= pos.right)
        keep = clauses[0]
        for clause in clauses[1:]:
            keep = keep & clause
        return keep

    return mask_mod


def _dense_mask_mod(offset: torch.Tensor, left: torch.Tensor, right: torch.Tensor, causal: bool, has_left: bool,
                    has_right: bool) -> Callable[..., Any]:
    """The dense positional mask over the scalars themselves, not a `_Positions` object: dynamo guards every
    captured object's type and attributes on each call, host time the per-call timing counted (window 1024 on an
    H100: 0.315 vs 0.275 ms back to back against torch's own flex with captured tensors,
    benchmarks/results/flex_variants-h100.md). A right bound of 0 under causal adds nothing: it is left out."""
    has_right = has_right and not causal

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        rel = ki - qi - offset
        keep = rel <= 0 if causal else None
        if has_left:
            keep = rel >= -left if keep is None else keep & (rel >= -left)
        if has_right:
            keep = rel <= right if keep is None else keep & (rel <= right)
        return keep

    return mask_mod


def _kv_mask_mod(used: torch.Tensor, batch_offset: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                 causal: bool, has_left: bool, has_right: bool) -> Callable[..., Any]:
    """The positional mask of a dense KV cache: key j of sequence b exists when j < used[b]; causal/window are
    aligned by that sequence's own offset."""
    has_right = has_right and not causal

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        keep = ki < used[b]
        if causal or has_left or has_right:
            rel = ki - qi - batch_offset[b]
            if causal:
                keep = keep & (rel <= 0)
            if has_left:
                keep = keep & (rel >= -left)
            if has_right:
                keep = keep & (rel <= right)
        return keep

    return mask_mod


def _int_scalar(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int32, device=device)


class _BlockMaskCache:
    """A bounded LRU of dense positional patterns: one `create_block_mask` per (causal, window, alignment
    offset, sq, sk, device), with batch and heads None (the pattern does not depend on them)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], _Positions] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[Any, ...], build: Callable[[], _Positions], limit: int) -> _Positions:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        value = build()
        if limit > 0:
            with self._lock:
                self._entries[key] = value
                while len(self._entries) > limit:
                    self._entries.popitem(last=False)
        return value


# -- score mods ---------------------------------------------------------------------------------------------

def _broadcast_index(t: torch.Tensor, target: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """Read a (b, h, sq, sk)-broadcastable tensor at (b, h, qi, ki) without expanding it: size-1 dims read 0."""
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
    full = tuple(size != 1 or want == 1 for size, want in zip(t4.shape, target))
    fb, fh, fq, fk = full

    def read(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return t4[b if fb else 0, h if fh else 0, qi if fq else 0, ki if fk else 0]

    return read


@functools.lru_cache(maxsize=64)
def _softcap_tensors(softcap: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """softcap and 1/softcap as device scalars, made once per (value, device): a tensor per call was a host-to-device
    copy per call, and the kernel multiplies by the reciprocal — a division per score cost 5% of the softcap
    forward on an H100 (benchmarks/results/flex_variants-h100.md). Tensors, not Python floats: dynamo would guard
    a captured float by value and compile again for every new softcap."""
    return (torch.tensor(softcap, dtype=torch.float32, device=device),
            torch.tensor(1.0 / softcap, dtype=torch.float32, device=device))


def _score_mod(call: AttentionCall, pos: _Positions, q_bhsd_shape: tuple[int, ...], sk: int,
               attn_bias: torch.Tensor | None) -> Callable[..., Any] | None:
    """softcap · tanh(s / softcap), then -slope · |i + o - j|, then the additive bias — reference.math's order.
    ``attn_bias`` is the call's bias, or the leaf standing for it inside `retainable`."""
    device = call.q.device
    softcap, inverse = _softcap_tensors(call.softcap, device) if call.softcap > 0 else (None, None)
    slopes = call.alibi_slopes
    per_batch_slopes = slopes is not None and slopes.dim() == 2
    if slopes is not None:
        # Slopes are constants of the model; flex would otherwise accumulate their gradient with atomics.
        slopes = slopes.detach()
    varlen = call.varlen
    bias = None
    if attn_bias is not None:
        b, h, sq = q_bhsd_shape[0], q_bhsd_shape[1], q_bhsd_shape[2]
        bias = _broadcast_index(attn_bias, (b, h, sq, sk))
    if softcap is None and slopes is None and bias is None:
        return None

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor,
                  ki: torch.Tensor) -> torch.Tensor:
        if softcap is not None:
            score = softcap * torch.tanh(score * inverse)
        if slopes is not None:
            if per_batch_slopes:
                slope = slopes[pos.doc_q[qi] if varlen else b, h]
            else:
                slope = slopes[h]
            score = score - slope * pos.distance(b, qi, ki).abs().to(torch.float32)
        if bias is not None:
            score = score + bias(b, h, qi, ki)
        return score

    return score_mod


# -- the implementation ------------------------------------------------------------------------------------

class TorchFlexAttention(AttentionImpl):
    vendor: ClassVar[str] = "torch"
    name: ClassVar[str] = "flex"
    priority: ClassVar[int] = -50  # a fallback: after every fused vendor kernel, before the pure-torch oracle
    description: ClassVar[str] = ("torch.compile(flex_attention): fused Triton fallback for softcap, ALiBi, odd head "
                                  "dims, windows with features, deterministic training, varlen (block masks)")
    # Triton builds of torch: CUDA (NVIDIA, and ROCm builds, which also use device type "cuda") and Intel XPU
    # (flex's Triton templates run there too; not measured by this project). The CPU is opt-in (options.cpu).
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda", "xpu", "cpu"})
    options_model: ClassVar[type[BaseModel]] = FlexOptions
    # What flex needs, not a blanket version: torch >= 2.5 has the public `torch.nn.attention.flex_attention` with
    # score_mod/block_mask, enable_gqa (pytorch#131559), return_lse, a Triton backward, and the autograd binding
    # `retainable` reads (`_get_current_graph_task_keep_graph`, pytorch#131038); return_aux (2.9+) and dynamo's
    # recompile-limit names are looked up with fallbacks. Head dims that are not a power of two, or a v head dim
    # of its own, are refused per call below torch 2.11 (see `old_torch_reason`). And a Triton backend for the
    # device type: the triton requirement below, and device_types.
    requires = (
        Requirement("torch", "torch", _MIN_TORCH, key="torch",
                    install_hint=f"pip install 'torch>={_MIN_TORCH}' (flex_attention with GQA and backward)"),
        _AcceleratorRequirement("triton", "triton", None, key="triton",
                                install_hint="install the triton build that matches torch (CUDA/ROCm/XPU wheels "
                                             "of torch bring it)"),
    )
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        # fp32 runs the same kernel (TF32 dots where torch allows them); fp64 is not a Triton flex dtype.
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dim_min=_MIN_HEAD_DIM, head_dim_max=None, head_dim_v_differs=True,
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}),
        causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True, softcap=True,
        alibi=True, dropout=False, attn_mask=True, attn_bias=True, bias_grad=True, lse=True, backward=True,
        # Deterministic by the kernels' structure (torch 2.13 templates in torch/_inductor/kernel/flex/templates):
        # forward — one program per (query tile, head) loops over its key tiles in a fixed order; the decode
        # kernel splits the keys into a count fixed by (batch, kv heads, seqlen_k, SM count) and combines the
        # splits in a fixed order; no atomics. Backward — dQ programs loop over key tiles, dK/dV programs loop
        # over query tiles and over the GQA group's query heads inside one program; plain stores, no atomics.
        # The one atomic path is the gradient of a captured tensor (attn_bias with grad: a Scatter with
        # atomic_add), declined for deterministic calls in extra_reasons.
        deterministic_forward=True, deterministic_backward=True,
        causal=True,
        # KV caches: each sequence's fill as a block mask (ALiBi distances from that fill too); paged caches of
        # any page size by gathering their pages into a dense cache first (bounded: extra_reasons). Backward as
        # for any call: autograd through the mods, and through the gather into the page pools.
        kv_cache=True, paged_kv=True, kv_cache_alibi=True,
    )

    def device_reasons(self, device: DeviceInfo) -> list[str]:
        if device.type in _FLEX_REFUSED_DEVICE_TYPES:
            # Stated as what flex needs rather than "wrong device type": the vendor's torch build is not the gate.
            return [f"torch's flex_attention refuses {device.type!r} tensors: its _validate_device accepts cuda and "
                    "cpu (torch 2.5), then also hpu, xpu and mps (2.13), never a PrivateUse1 device type "
                    "(torch/nn/attention/flex_attention.py); "
                    f"{_FLEX_REFUSED_DEVICE_TYPES[device.type]}"]
        return super().device_reasons(device)

    def __init__(self) -> None:
        self._masks = _BlockMaskCache()
        self._regular_kernel: set[tuple[Any, ...]] = set()  # shape families the decoding kernel cannot compile

    # -- selection --------------------------------------------------------------------------------------------
    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        opts = self.options
        reasons = []
        if device.type == "cpu":
            if not opts.cpu:
                reasons.append("off on the CPU (cpu.flash is faster there); enable with "
                               "ops.attention.options.'torch.flex': {cpu: true}")
            elif call.requires_grad:
                reasons.append("no backward on the CPU: torch's flex_attention refuses CPU inputs that require grad")
        if call.head_dim_v < _MIN_HEAD_DIM:
            reasons.append(f"v head_dim {call.head_dim_v} below {_MIN_HEAD_DIM}: flex's Triton kernel needs q/k and v "
                           f"head dims >= {_MIN_HEAD_DIM} (tl.dot)")
        largest = max(call.head_dim, call.head_dim_v)
        if largest > opts.max_head_dim:
            reasons.append(f"head_dim {call.head_dim}/{call.head_dim_v} (q·k/v) above max_head_dim="
                           f"{opts.max_head_dim}: flex tunes its tiles up to 256 only; raise "
                           "ops.attention.options.'torch.flex'.max_head_dim after checking the shape on this device "
                           "(tests/gpu/test_flex_gpu.py)")
        too_old = old_torch_reason(call, device)
        if too_old:
            reasons.append(too_old)
        if (call.deterministic and call.requires_grad and call.attn_bias is not None
                and call.attn_bias.requires_grad):
            reasons.append("deterministic=True with a gradient for attn_bias: flex accumulates the gradient of a "
                           "captured tensor with atomic adds")
        if call.paged:
            too_large = paged_gather_reason(call, "torch.flex (flex_attention takes no block table)")
            if too_large:
                reasons.append(too_large)
        return reasons

    # Of a dense call without a KV cache or bias, selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        # extra_reasons reads the device, the options (both part of every decision key), head dims, flags,
        # whether attn_bias requires grad and, for a paged call, whether its gather passes the bound (sizes).
        return (call.attn_bias is not None and call.attn_bias.requires_grad,
                call.paged and paged_gather_reason(call, "") is not None)

    # -- running ---------------------------------------------------------------------------------------------
    def bind(self, call: AttentionCall) -> Callable[..., Any]:
        """Dense calls whose mods read nothing from the call's tensors (causal, windows, softcap) bind the
        compiled kernel with its block mask, score_mod and arguments made once: run() makes them per call, host
        time that per-call timing counts (benchmarks/results/flex_variants-h100.md). Bound per signature: the
        block mask is built for the call's lengths. Masks, biases, ALiBi slopes, varlen and caches carry values
        that change per call, and the eager path is for tests: those re-enter run()."""
        if (call.varlen or call.kv_cache or call.attn_mask is not None or call.attn_bias is not None
                or call.alibi_slopes is not None or call.sinks is not None or call.return_lse
                or call.dropout_p > 0 or not self.options.compile):
            return super().bind(call)
        q_shape = (call.batch, call.heads_q, call.seqlen_q, call.head_dim)
        pos = self._dense_positions(call, call.seqlen_q, call.seqlen_k)
        kwargs = dict(self._flex_kwargs(call, pos.block_mask),
                      score_mod=_score_mod(call, pos, q_shape, call.seqlen_k, None))
        run_compiled = self._run_compiled
        family = (call.heads_q, call.heads_kv, call.head_dim, call.head_dim_v, call.dtype, call.q.device.type)
        bshd = call.layout == "bshd"  # its transposes inside the compiled graph (`_flex_entry_bshd`)
        entry = _compiled_flex_bshd() if bshd else (_compiled_flex(), _flex_entry.__code__, None)
        compiled, code, reader, regular = entry[0], entry[1], _cache_entry_reader(), self._regular_kernel

        def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            # The common call in one frame: the graph count as last seen (so dynamo's limit as last read applies),
            # room under it, and no shape family moved to the regular kernel. Anything else: `_run_compiled`.
            if reader is not None and not regular:
                graphs = len(reader(code))
                if graphs == _limit_read[0] and graphs < _limit_read[1] - 1:
                    return compiled(q, k, v, **kwargs)
            return run_compiled(q, k, v, kwargs, family, entry if bshd else None)

        return retainable(flex) if bshd else bind_dense(call, retainable(flex))

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if call.dropout_p > 0:
            raise ValueError(f"torch.flex: dropout_p={call.dropout_p:g} is not supported (flex_attention has no "
                             "dropout); use dropout_p=0 or another implementation")
        if call.paged and not call.varlen:
            # The pages each block table names, gathered into a dense cache (a copy, differentiable into the
            # pools): flex_attention takes no block table. Then the dense KV-cache path.
            call = paged_as_dense(call)
        if call.varlen:
            # (total, heads, dim) -> (1, heads, total, dim): views; packed sequences are one batch row with a
            # document mask.
            keys, values, cu_k = call.k, call.v, None
            if call.paged:  # packed queries over pages: sequence b's keys are row b of the gathered cache
                gathered = gathered_pages(call)
                capacity = gathered[0].shape[1]
                keys, values = (t.flatten(0, 1) for t in gathered)
                cu_k = uniform_cu_seqlens(call.batch, capacity, keys.device)
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (call.q, keys, values))
            pos = self._varlen_positions(call, cu_k, k.shape[2])
        elif call.kv_cache:
            q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
            pos = self._kv_positions(call, q.shape[2], k.shape[2])
        else:
            q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
            pos = self._dense_positions(call, q.shape[2], k.shape[2])
        block_mask = pos.block_mask
        if call.attn_mask is not None:
            block_mask = self._data_block_mask(call, pos, tuple(q.shape), k.shape[2])
        kwargs = self._flex_kwargs(call, block_mask)
        aux = _aux_request() if call.return_lse else None
        if aux is not None:
            kwargs["return_aux"] = aux
        elif call.return_lse:
            kwargs["return_lse"] = True
        q_shape, sk = tuple(q.shape), k.shape[2]

        def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *bias: torch.Tensor) -> Any:
            score_mod = _score_mod(call, pos, q_shape, sk, bias[0] if bias else call.attn_bias)
            if self.options.compile:
                result = self._run_compiled(q, k, v, dict(kwargs, score_mod=score_mod))
            else:
                result = _flex_api().flex_attention(q, k, v, score_mod=score_mod, **kwargs)
            if not call.return_lse:
                return result
            return result[0], (result[1].lse if aux is not None else result[1])

        # A bias with a gradient is an input of the graph, like q/k/v; any other captured tensor is a constant.
        bias_leaf = (call.attn_bias,) if call.attn_bias is not None and call.attn_bias.requires_grad else ()
        # The compiled graph is kept behind `retainable` so that backward(retain_graph=True) works (issue 27);
        # the eager path has no compiled backward and needs none.
        result = (retainable(flex) if self.options.compile else flex)(q, k, v, *bias_leaf)
        if not call.return_lse:
            return self._layout_out(call, result)
        out, lse = result
        return self._layout_out(call, out), (lse[0] if call.varlen else lse)

    def _flex_kwargs(self, call: AttentionCall, block_mask: Any) -> dict[str, Any]:
        """flex_attention's arguments every call passes (run() and the bound functions alike)."""
        kwargs: dict[str, Any] = dict(block_mask=block_mask, scale=call.scale, enable_gqa=call.heads_q != call.heads_kv)
        if self.options.kernel_options:
            kwargs["kernel_options"] = dict(self.options.kernel_options)
        return kwargs

    def _run_compiled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any],
                      family: tuple[Any, ...] | None = None, entry: Any = None) -> Any:
        """The compiled kernel (through `entry` for a layout of its own, see `_call_compiled`; `family`: the
        call's, when the tensors are not bhsd); where torch's split-KV decoding kernel (short queries) has no valid
        tile configuration — measured on an H100, torch 2.11: GQA 8/2, d128, 100 queries over 333 keys fails
        with inductor's NoValidChoicesError — run flex's regular kernel instead, and remember that shape family."""
        if self._regular_kernel and "kernel_options" not in kwargs and (
                family or self._family(q, k, v)) in self._regular_kernel:
            kwargs = dict(kwargs, kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
        try:
            return _call_compiled(q, k, v, kwargs, entry)
        except Exception as exc:
            if "NoValidChoicesError" not in f"{type(exc).__name__}: {exc}" or "kernel_options" in kwargs:
                raise
            self._regular_kernel.add(family or self._family(q, k, v))
            return _call_compiled(q, k, v, dict(kwargs, kernel_options={"FORCE_USE_FLEX_ATTENTION": True}), entry)

    @staticmethod
    def _family(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
        """(heads q/kv, head dims q/v, dtype, device type) of bhsd tensors: what `bind` states for a call."""
        return (q.shape[1], k.shape[1], q.shape[3], v.shape[3], q.dtype, q.device.type)

    @staticmethod
    def _layout_out(call: AttentionCall, out: torch.Tensor) -> torch.Tensor:
        if call.varlen:
            return out[0].transpose(0, 1)
        return call.from_bhsd(out)

    def _create_block_mask(self, mask_mod: Callable[..., Any], b: int | None, h: int | None, sq: int, sk: int,
                           device: torch.device) -> Any:
        # Compiled mask creation evaluates mask_mod fused, tile by tile; eager creation materialises a
        # (b, h, sq, sk) boolean first (fine for tests, not for 32k x 32k).
        return _flex_api().create_block_mask(mask_mod, b, h, sq, sk, device=device,
                                             _compile=self.options.compile)

    def _dense_positions(self, call: AttentionCall, sq: int, sk: int) -> _Positions:
        offset = sk - sq if call.causal_alignment == "bottom_right" else 0
        left, right = kernel_window(call)
        key = (call.causal, left, right, offset, sq, sk, call.q.device)

        def build() -> _Positions:
            pos = _Positions()
            device = call.q.device
            pos.offset = _int_scalar(offset, device)
            pos.left, pos.right = _int_scalar(left, device), _int_scalar(right, device)
            pos.mask_mod = _positional_mask_mod(pos, call.causal, left >= 0, right >= 0, varlen=False)
            if pos.mask_mod is not None:
                pos.block_mask = self._create_block_mask(pos.mask_mod, None, None, sq, sk, device)
            return pos

        if not (call.causal or call.window is not None or call.alibi_slopes is not None):
            return _Positions()  # nothing positional: no mask, no offset needed
        return self._masks.get(key, build, self.options.block_mask_cache)

    def _kv_positions(self, call: AttentionCall, sq: int, sk: int) -> _Positions:
        """A dense KV cache's pattern: each sequence's fill `seqused_k[b]`, causal/window aligned there
        (bottom-right: offset fill - seqlen_q) or at its start (top-left). Built per call, with the batch in the
        block mask: it depends on the lengths' values, which change every decode step."""
        assert call.seqused_k is not None
        device = call.q.device
        pos = _Positions()
        pos.used = call.seqused_k.to(torch.int32)
        pos.batch_offset = (pos.used - sq if call.causal_alignment == "bottom_right"
                            else torch.zeros_like(pos.used))
        left, right = kernel_window(call)
        pos.left, pos.right = _int_scalar(left, device), _int_scalar(right, device)
        pos.mask_mod = _kv_mask_mod(pos.used, pos.batch_offset, pos.left, pos.right, call.causal, left >= 0,
                                    right >= 0)
        pos.block_mask = self._create_block_mask(pos.mask_mod, call.batch, None, sq, sk, device)
        return pos

    def _varlen_positions(self, call: AttentionCall, cu_seqlens_k: torch.Tensor | None = None,
                          total_k: int | None = None) -> _Positions:
        """Document tables from cu_seqlens, rebuilt on every call: they depend on the values of cu_seqlens (which
        a caller may rewrite in place), so no cache key can stand for them. Cost per call: a few O(total tokens)
        kernels for the tables, then create_block_mask, which evaluates the mask on every (query, key) pair —
        O(total_q · total_k) work, fused and without that memory when compiled — and writes
        O(total_q · total_k / 128²) block indices. The attention kernel then visits only the tiles that touch a
        document's own keys. Over a KV cache each document's keys are its first seqused_k of its span (the
        call's cu_seqlens_k, or `cu_seqlens_k` given here for gathered pages) and alignment counts from there."""
        cu_k_given = call.cu_seqlens_k if cu_seqlens_k is None else cu_seqlens_k
        assert call.cu_seqlens_q is not None and cu_k_given is not None
        device = call.q.device
        cu_q = call.cu_seqlens_q.to(torch.int64)
        cu_k = cu_k_given.to(torch.int64)
        total_q, total_k = call.q.shape[0], call.k.shape[0] if total_k is None else total_k
        pos = _Positions()
        tok_q = torch.arange(total_q, device=device)
        tok_k = torch.arange(total_k, device=device)
        # The document of a token: how many sequence ends lie at or before it (empty sequences own no token).
        doc_q = torch.searchsorted(cu_q[1:], tok_q, right=True)
        doc_k = torch.searchsorted(cu_k[1:], tok_k, right=True)
        used = None if call.seqused_k is None else call.seqused_k.to(torch.int64)
        if call.causal_alignment == "bottom_right":
            offset = (cu_k[1:] - cu_k[:-1] if used is None else used) - (cu_q[1:] - cu_q[:-1])
        else:
            offset = torch.zeros_like(cu_q[1:])
        pos.doc_q, pos.doc_k = doc_q.to(torch.int32), doc_k.to(torch.int32)
        pos.qpos = (tok_q - cu_q[doc_q] + offset[doc_q]).to(torch.int32)
        kpos = tok_k - cu_k[doc_k]
        pos.kpos = kpos.to(torch.int32)
        if used is not None:
            pos.kvalid = kpos < used[doc_k]
        left, right = kernel_window(call)
        pos.left, pos.right = _int_scalar(left, device), _int_scalar(right, device)
        pos.mask_mod = _positional_mask_mod(pos, call.causal, left >= 0, right >= 0, varlen=True)
        pos.block_mask = self._create_block_mask(pos.mask_mod, None, None, total_q, total_k, device)
        return pos

    def _data_block_mask(self, call: AttentionCall, pos: _Positions, q_shape: tuple[int, ...], sk: int) -> Any:
        """A boolean attn_mask (and the positional pattern, if any) as one block mask, built per call: it
        depends on the mask's values. Batch and head dims stay None where the mask broadcasts over them."""
        mask = call.attn_mask
        assert mask is not None
        b, h, sq = q_shape[0], q_shape[1], q_shape[2]
        read = _broadcast_index(mask, (b, h, sq, sk))
        positional = pos.mask_mod
        if positional is None:
            def mask_mod(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
                return read(bi, hi, qi, ki)
        else:
            def mask_mod(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
                return read(bi, hi, qi, ki) & positional(bi, hi, qi, ki)
        m4_shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        mb = b if m4_shape[0] != 1 else None
        mh = h if m4_shape[1] != 1 else None
        return self._create_block_mask(mask_mod, mb, mh, sq, sk, call.q.device)

    def describe_capabilities(self) -> dict[str, Any]:
        out = super().describe_capabilities()
        out["options"] = self.options.model_dump()
        return out
