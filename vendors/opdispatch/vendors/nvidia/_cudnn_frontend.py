"""`nvidia.cudnn_frontend`: cuDNN's SDPA through NVIDIA's cuDNN frontend Python graph API (package `cudnn`, pip
distribution `nvidia-cudnn-frontend`, the opdispatch extra `[cudnn]`): bf16/fp16 forward and backward with additive
bias and ALiBi (option `half`), FP8 forward, and FP8 forward and backward for bf16/fp16 calls cast to FP8 inside
(option `fp8_dpa`, TransformerEngine's fp8_dpa).

Read from NVIDIA/cudnn-frontend at commit 3929da2ef4c1dba1bb8acb68727b9134f26f40c0 (python/pygraph/sdpa.cpp, the
bindings; test/python/sdpa/fp16.py, fp8.py, fp16_ref.py, the samples and their reference):

    graph = cudnn.pygraph(io_data_type=, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=)
    t = graph.tensor(uid=, dim=(b, h, s, d), stride=..., data_type=)   # any strides: bshd memory is
                                                                        # stride (s*h*d, d, h*d, 1)
    o, stats = graph.sdpa(q, k, v, generate_stats=, attn_scale=, diagonal_alignment=,
                          diagonal_band_left_bound=, diagonal_band_right_bound=, ...)
    o, stats, amax_s, amax_o = graph.sdpa_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s,
                                              scale_o, generate_stats=, attn_scale=, diagonal_alignment=,
                                              left_bound=, right_bound=, ...)
    o.set_uid(..).set_output(True).set_dim(..).set_stride(..).set_data_type(..)
    graph.validate(); graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support(); graph.build_plans()                    # cuDNN's first plan that builds
    graph.execute({uid: tensor}, workspace (uint8, graph.get_workspace_size()), handle=)
    # autotuning (python/pygraph/pygraph.cpp, python/cudnn/__init__.py; samples/cpp/misc/autotuning.cpp):
    graph.build_plans(cudnn.build_plan_policy.ALL)                # every plan; one that fails is skipped
    graph.get_execution_plan_count(); graph.get_workspace_size_plan_at_index(i)
    graph.execute_plan_at_index({uid: tensor}, workspace, i, handle=)  # RuntimeError for a plan not built
    # FP8 backward (test/python/sdpa/fp8.py's generate_graph_bwd; stats from a forward with generate_stats=True):
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = graph.sdpa_fp8_backward(
        q, k, v, o, dO, stats, descale_q, descale_k, descale_v, descale_o, descale_dO, descale_s, descale_dP,
        scale_s, scale_dQ, scale_dK, scale_dV, scale_dP, attn_scale=, diagonal_alignment=, left_bound=,
        right_bound=, use_deterministic_algorithm=, ...)

Conventions (fp16_ref.py): the band keeps key j of query i when i + o - left_bound < j <= i + o + right_bound,
o = s_kv - s_q for DiagonalAlignment BOTTOM_RIGHT and 0 for TOP_LEFT — so opdispatch's window (left, right)
is left_bound = left + 1 (as TransformerEngine passes it) and right_bound = right, causal is right_bound 0. The
descales of `sdpa_fp8` are one float32 per tensor, dims (1, 1, 1, 1). On Hopper cuDNN refuses FP8 SDPA with a
bf16/fp16 output ("only supported on Blackwell with cuDNN >= 9.13"): the graph's output is FP8 of the inputs'
kind with `scale_o` = fp8_max / max|v| (the output is a convex mix of v's rows, so it never exceeds max|v|), and
this adapter divides it back to `call.out_dtype`. The probabilities are FP8 with scale_s 256 (they lie in [0, 1]).

An FP8 output (`out_dtype` the inputs' FP8 kind, with the caller's `out_scale`, TransformerEngine's fp8_mha) is the
graph's own output with scale_o = out_scale: no v amax, no dequantization, no Triton launch; `out_amax` (any FP8
call) is bound as the graph's Amax_O, max|O| in real units.

Per FP8 call with a bf16/fp16 output, around the graph, three Triton launches
(vendors/opdispatch/vendors/nvidia/_cudnn_fp8_triton.py), no host read: max|v| as FP8 magnitude bits (one read of v in
memory order, one atomic max per program), scale_o from them and v_descale (one program), and the dequantization
o8 / scale_o -> out_dtype in one pass (read 1 byte, write 2 per element;
`(o.float() / s).to(dt)` took three passes and a float32 temporary: 19 bytes per element, most of the FP8 call's
time below 16k keys on an H100, benchmarks/results/fp8_attention-h100.log). The constant scalars (scale_s,
descale_s) are made once per device; the amax outputs cuDNN writes (read by nobody), the max|v| accumulator, scale_o
and the graph's workspace once per (device, stream): cuDNN runs on the current stream, so a buffer it writes is
never shared by two streams, and one lock per device makes each call's set_stream .. dequantize sequence atomic
among host threads. Inside CUDA-graph capture nothing new is cached (a buffer filled during capture holds its value
only once the graph is replayed): missing buffers are allocated for that call, as the capture's own memory.

Plans (option `autotune`, on by default): cuDNN's heuristics order its plans, and `build_plans()` keeps the first
that builds; with `autotune` a signature's first call builds them all, runs each on the call's own tensors (one
warm-up, then the mean of 3 runs timed by CUDA events on the current stream) and keeps the fastest, run by index at
every later call. The cost, once per signature: the other plans' builds (each about one graph build) and 4 runs of
each plan; a plan that did not build refuses execution and is skipped. The first call is never inside CUDA-graph
capture (a new signature there is refused), so the timing's host synchronization never meets a capture.

FP8 backward (option `fp8_dpa`, off by default): bf16/fp16 q/k/v are cast to e4m3 with current per-tensor
scaling inside the op (as TransformerEngine's fp8_dpa casts inside its module), the forward graph also writes the
softmax stats, and for inputs that require grad an autograd function keeps the FP8 q/k/v, the FP8 output with its
descale (1 / scale_o) and the stats; its backward casts dO to e4m3 (current scaling) and runs `sdpa_fp8_backward`.
On Hopper dQ/dK/dV come out FP8, and their scales (and dP's, an FP8 intermediate) must be set before the graph
runs: each signature keeps the last call's (delayed scaling, starting at 1), and after the graph the amaxes cuDNN
reports (real units) are compared on the device with them — one host read per backward: a gradient that would
clip, or that uses under 1/16 of FP8's range, reruns the graph with scale = fp8_max / (2 amax) (at most 3 runs,
else an error): never a clipped gradient returned. The gradients are dequantized to the inputs' dtype. That host
read keeps the backward out of CUDA-graph capture (refused with the reason). A gradient for FP8 *inputs* is never
offered: autograd casts a leaf's gradient to the leaf's dtype (FP8, unscaled), so the op refuses requires_grad on
FP8 q/k/v.

bf16/fp16 score terms (option `half`): an additive `attn_bias` is the graph's `bias` (4-D, batch and head dims 1 or
full, query and key dims full — a bias broadcast along them is expanded —, rounded to q's dtype as torch's SDPA rounds
it); ALiBi is cuDNN's `use_alibi_mask`, which adds (col - row) * slope with *fixed* slopes (get_alibi_slope in
cudnn_frontend_utils.h: 2**(-8 i / n), ALiBi's paper, written into the workspace — a graph takes no slopes), so each
ALiBi call's slopes are compared with those (one host read per call, refused inside CUDA-graph capture; others
raise, and the manager sends the call on). cuDNN takes ALiBi with right_bound 0 only (causal), and neither a bias nor
ALiBi with a bottom-right diagonal; FP8 takes no bias (sdpa_support_surface.h); a window or a bottom-right diagonal
over more queries than keys is refused at run time (the lengths are not in the decision class).

bf16/fp16 backward (calls that require grad, option `half`): the forward graph also writes the softmax stats; an
autograd function keeps q/k/v, the output, the stats and the graph's bias, and its backward runs
`sdpa_backward(q, k, v, o, dO, stats, attn_scale=, bias=, dBias=, use_alibi_mask=, diagonal_alignment=,
diagonal_band_left_bound=, diagonal_band_right_bound=)` (dO in O's strides, as cuDNN reads it). dBias has the graph
bias's dims (cuDNN reduces dS over the batch/head dims it broadcasts), then is summed over the query/key dims the
caller's bias broadcasts over, in its shape and dtype. Head dims: up to 256 on Hopper, 128 elsewhere; s_q = s_kv = 1
refused (cuDNN's backward node). Graphs are cached per signature (bias dims/strides, ALiBi, dBias included). The
bias, ALiBi and backward paths are contract-tested on CPU against the fake and on the H100
(tests/gpu/test_cudnn_frontend_gpu.py, benchmarks/results/h100-5a4994b/).

Packed varlen (thd, bf16/fp16, sm90+; option `half`), forward and backward, and a K/V cache, paged or dense
(seqused_k over a (batch, capacity, heads, dim) cache; forward only; option `kv_cache`, on by default, since its
graph holds for every fill): cuDNN's padding-mask graphs (`_Padded`; test/python/sdpa/fp16.py's ragged and paged
graphs, sdpa_support_surface.h, paged_cache_load.h):

    t.set_ragged_offset(offsets)   # int64 (b + 1, 1, 1, 1), in elements: cu_seqlens * token stride; the tensor's
                                   # dims (b, h, max_seqlen, d), strides (max_seqlen * ts, hs, ts, 1)
    graph.sdpa(..., use_padding_mask=True, seq_len_q=, seq_len_kv=,     # int32 (b, 1, 1, 1)
               paged_attention_k_table=, paged_attention_v_table=,      # int32 (b, 1, max_pages, 1)
               paged_attention_max_seq_len_kv=)                         # max_pages * page_size
    graph.sdpa_backward(..., use_padding_mask=True, seq_len_q=, seq_len_kv=, max_total_seq_len_q=,
                        max_total_seq_len_kv=)                          # token counts, rounded up to 64

thd's q/k/v/o/stats (and dO/dQ/dK/dV) are ragged; paged k/v are the pools as (num_pages, heads, page_size, dim)
views (a dense cache as it is), with seq_len_kv = seqused_k (bottom-right counts from the fill, as cuDNN's padded
diagonal does: per sequence, seq_len_kv - seq_len_q). The padding mask lifts cuDNN's "max_s_q <= max_s_kv" limits
on windows and bottom-right diagonals. Lengths, offsets and page tables are made on the device per call (no host
read). Not taken (refused with reasons): thd or a KV cache with FP8/fp8_dpa, ALiBi over thd or a KV cache, a
gradient through a KV cache (cuDNN's backward takes no page tables; a dense cache's is not built here), thd keys
with seqused_k and no block table, page sizes not a multiple of 32, thd below sm90. A thd backward copies q/k/v that
are not compact (sliced from one packed projection): cuDNN 9.19's ragged backward mis-addresses them. Verified on
the H100 (tests/gpu/test_cudnn_frontend_gpu.py; benchmarks/results/h100-ce56e4a/, h100-5a4994b/ and h100-kvfe/).

What cuDNN also has and this adapter does not take yet (declared unsupported, so never silently wrong): dropout, the
LSE as an output (`stats`: only kept for the backward). Graphs are built once per signature (shapes, strides,
dtypes, options, device) and never during CUDA-graph capture (building synchronizes): a first call inside capture
raises with the fix (warm up).
"""

from __future__ import annotations

import atexit
import functools
import math
import threading
import weakref
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import FP8_DTYPES, FP8_OUT_DTYPES

CUDNN_FRONTEND = Requirement(module="cudnn", distribution="nvidia-cudnn-frontend", key="cudnn_frontend",
                             verify_distribution=True,
                             install_hint="pip install 'opdispatch[cudnn]' (the nvidia-cudnn-frontend wheel)")

_SCALE_S = 256.0  # the FP8 probabilities' scale: P in [0, 1] maps into e4m3's and e5m2's range exactly
_AUTOTUNE_REPS = 3  # timed runs per plan after its warm-up run
_PAGE_SIZE_MULTIPLE = 32  # the paged cache's page sizes claimed (caps.page_size_multiple)
_FP8_HEAD_DIMS = frozenset({64, 128})  # FP8 SDPA's head dims claimed (cuDNN's check_support is the last word)
_UID = {"q": 1, "k": 2, "v": 3, "o": 4, "descale_q": 5, "descale_k": 6, "descale_v": 7, "descale_s": 8,
        "scale_s": 9, "scale_o": 10, "amax_s": 11, "amax_o": 12, "stats": 13, "bias": 14}
# bf16/fp16 backward (sdpa_backward, test/python/sdpa/fp16.py's backward graph)
_HALF_BWD_UID = {name: uid for uid, name in enumerate(
    ("q", "k", "v", "o", "dO", "stats", "bias", "dQ", "dK", "dV", "dBias"), start=1)}
_BACKWARD_HEAD_DIM_MAX = {9: 256}  # sdpa_backward's head dims by SM major (scaled_dot_product_flash_attention.h:
# Hopper d_qk, d_v <= 256; elsewhere <= 128, Blackwell's 192/128 aside — not claimed here)
_ALIBI_SLOPE_RTOL = 1e-6  # the call's slopes against cuDNN's fixed ones: a float32 ulp or two (powf vs torch.pow)
_BWD_UID = {name: uid for uid, name in enumerate((
    "q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
    "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP", "dQ", "dK", "dV", "amax_dQ", "amax_dK",
    "amax_dV", "amax_dP"), start=1)}
_DPA_KIND = torch.float8_e4m3fn  # fp8_dpa: q/k/v and dO cast to e4m3 (TransformerEngine's HYBRID keeps e5m2 for
# gradients; cuDNN's FP8 backward takes one kind for its inputs)
# The FP8 gradients' scales (dQ, dK, dV and the intermediate dP) must be chosen before the backward runs: each
# signature keeps the last call's (delayed scaling); after the graph, the amaxes cuDNN reports are checked on the
# device against them (one host read): a gradient that would clip, or use less than 2**-_GRAD_RANGE_BITS of FP8's
# range, reruns the graph with scale = fp8_max / (2 amax) — at most _GRAD_ATTEMPTS runs, else an error.
_GRAD_RANGE_BITS, _GRAD_ATTEMPTS = 4, 3


def _cudnn_type(cudnn: Any, dtype: torch.dtype) -> Any:
    names = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}
    names.update({d: ("FP8_E4M3" if "e4m3" in str(d) else "FP8_E5M2") for d in FP8_DTYPES})
    return getattr(cudnn.data_type, names[dtype])


def _bounds(call: AttentionCall) -> tuple[int | None, int | None]:
    """opdispatch's causal/window as cuDNN's (left_bound, right_bound), None unbounded."""
    left, right = call.window if call.window is not None else (-1, -1)
    if call.causal:
        right = 0
    return (None if left < 0 else left + 1), (None if right < 0 else right)


@functools.cache
def _cudnn_alibi_slopes(heads: int) -> tuple[float, ...]:
    """cuDNN's ALiBi slopes for `heads` query heads (cudnn_frontend_utils.h, get_alibi_slope, written into the
    graph's workspace: a graph takes no slopes of its own): n = the largest power of 2 <= heads, slopes
    2**(-8 i / n) for i = 1..n, then 2**(-8 (2 j + 1) / (2 n)) for the remaining heads — float32 arithmetic."""
    n = 1 << int(math.log2(heads))
    exponents = [float(i + 1) for i in range(n)] + [(i + 1) * 0.5 for i in range(0, 2 * (heads - n), 2)]
    values = torch.tensor(exponents, dtype=torch.float32) * -8.0 / float(n)
    return tuple(float(x) for x in torch.pow(2.0, values))


def _check_alibi_slopes(call: AttentionCall) -> None:
    """cuDNN's ALiBi has fixed slopes (`_cudnn_alibi_slopes`): a call whose slopes differ is refused at run time
    (its values are data, read by no selection) — one host read of the (heads,) or (batch, heads) slopes per call,
    so never inside CUDA-graph capture."""
    slopes = call.alibi_slopes
    assert slopes is not None
    if slopes.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("nvidia.cudnn_frontend: an ALiBi call reads its slopes on the host (cuDNN's ALiBi has "
                           f"fixed slopes, checked per call) and cannot run inside CUDA-graph capture "
                           f"({call.describe()}); capture another implementation, or pass the slopes as attn_bias")
    want = torch.tensor(_cudnn_alibi_slopes(call.heads_q), dtype=torch.float32, device=slopes.device)
    if not bool(torch.allclose(slopes.detach(), want.expand_as(slopes), rtol=_ALIBI_SLOPE_RTOL, atol=0.0)):
        raise ValueError(f"nvidia.cudnn_frontend: cuDNN's ALiBi uses the standard slopes for {call.heads_q} heads "
                         f"({[round(x, 6) for x in _cudnn_alibi_slopes(call.heads_q)]}: 2**(-8 i / n), ALiBi's "
                         f"paper), the call's are {slopes.detach().cpu().tolist()}; pass other slopes as an "
                         "additive attn_bias, or use another implementation")


def _check_lengths(call: AttentionCall) -> None:
    """cuDNN refuses a diagonal band over more queries than keys (sdpa_support_surface.h: "Bottom right causal mask
    does not support max_s_q > max_s_kv", "Sliding window attention is only supported with max_s_q <= max_s_kv"):
    the lengths are no part of the decision class, so such a call is refused here, before any graph is built (the
    manager sends it to the next implementation)."""
    if call.seqlen_q <= call.seqlen_k or call.varlen or call.kv_cache:  # the padding mask lifts it
        return
    left, right = _bounds(call)
    if left is not None or (right is not None and call.causal_alignment == "bottom_right"):
        raise ValueError(f"nvidia.cudnn_frontend: cuDNN takes a sliding window, or a bottom-right diagonal, only "
                         f"with seqlen_q <= seqlen_k; the call has seqlen_q={call.seqlen_q} > "
                         f"seqlen_k={call.seqlen_k} ({call.describe()}); use another implementation")


# thd (ragged) and paged calls: the per-sequence lengths, the ragged offsets and the page tables
# (test/python/sdpa/fp16.py's ragged and paged graphs)
_PADDED_UID = {name: uid for uid, name in enumerate(
    ("seq_len_q", "seq_len_kv", "off_q", "off_k", "off_v", "off_o", "off_stats", "off_dO", "off_dQ", "off_dK",
     "off_dV", "page_table_k", "page_table_v"), start=40)}


class _Padded:
    """A thd or paged call as cuDNN's padding-mask graph (test/python/sdpa/fp16.py): `use_padding_mask` with
    seq_len_q / seq_len_kv, int32 (batch, 1, 1, 1) — the differences of cu_seqlens for thd, the queries' count
    for dense queries, seqused_k over a paged cache. A packed (tokens, heads, dim) tensor (thd's q/o, and k/v unless
    paged) is a graph tensor of dims (batch, heads, max_seqlen, dim) with the strides of its packing — (max_seqlen *
    token stride, head stride, token stride, 1) — and a ragged offset per sequence, in elements: cu_seqlens * token
    stride, int64 (batch + 1, 1, 1, 1). A paged cache: k/v are the page pools as (num_pages, heads, page_size, dim)
    views and the block table is `paged_attention_k_table`/`_v_table` of dims (batch, 1, max_pages, 1) int32, with
    `paged_attention_max_seq_len_kv` the table's capacity (paged_cache_load.h: the table holds ceil(s_kv / page
    size) pages). All made on the device from the call's tensors: no host read."""

    def __init__(self, call: AttentionCall) -> None:
        self.batch, self.max_q, self.max_k = call.batch, call.seqlen_q, call.seqlen_k  # (dense cache: its capacity)
        self.ragged_q = call.varlen
        self.table = call.block_table
        self.ragged_k = call.varlen and self.table is None
        device = call.q.device
        if self.ragged_q:
            assert call.cu_seqlens_q is not None
            self.cu_q = call.cu_seqlens_q.long()
            self.seq_len_q = (self.cu_q[1:] - self.cu_q[:-1]).int().view(-1, 1, 1, 1)
        else:
            self.seq_len_q = torch.full((self.batch, 1, 1, 1), self.max_q, dtype=torch.int32, device=device)
        if call.seqused_k is not None:  # a KV cache: a dense one's first seqused_k rows, or a paged one's
            self.seq_len_kv = call.seqused_k.int().view(-1, 1, 1, 1)
            if self.table is not None:
                self.max_k = self.table.shape[1] * call.page_size  # the table's capacity
                # Entries past a sequence's fill may hold anything (-1 padding, stale ids); whether cuDNN's paged
                # load reads them is not documented, so they name page 0 (on the device: column c is used iff
                # c * page size < seqused_k). The used entries are the caller's, as every paged kernel takes them.
                first_keys = torch.arange(0, self.max_k, call.page_size, device=device, dtype=torch.int32)
                self.table = torch.where(first_keys < call.seqused_k.view(-1, 1), self.table, 0).int()
        else:
            assert call.cu_seqlens_k is not None
            self.cu_k = call.cu_seqlens_k.long()
            self.seq_len_kv = self.seq_len_q if call.cu_seqlens_k is call.cu_seqlens_q else \
                (self.cu_k[1:] - self.cu_k[:-1]).int().view(-1, 1, 1, 1)
        self._offsets: dict[tuple[str, int], torch.Tensor] = {}

    def key(self) -> tuple[Any, ...]:
        table = None if self.table is None else (tuple(self.table.shape), self.table.stride())
        return (self.ragged_q, self.ragged_k, self.batch, self.max_q, self.max_k, table)

    def ragged(self, side: str) -> bool:
        return self.ragged_q if side == "q" else self.ragged_k

    def dims(self, t: torch.Tensor, side: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(dims, strides) of `t` in the graph: a packed (tokens, heads, dim) tensor of a ragged side as cuDNN's
        ragged tensor, any other as it is (side "q" or "k")."""
        if not self.ragged(side):
            return tuple(t.shape), t.stride()
        s = self.max_q if side == "q" else self.max_k
        return (self.batch, t.shape[1], s, t.shape[2]), (s * t.stride(0), t.stride(1), t.stride(0), t.stride(2))

    def offsets(self, t: torch.Tensor, side: str) -> torch.Tensor:
        """cu_seqlens * t's token stride (elements), int64 (batch + 1, 1, 1, 1); one per (side, stride)."""
        key = (side, t.stride(0))
        if key not in self._offsets:
            cu = self.cu_q if side == "q" else self.cu_k
            self._offsets[key] = (cu * t.stride(0)).view(-1, 1, 1, 1)
        return self._offsets[key]

    def tensor(self, cudnn: Any, graph: Any, uid: int, name: str, like: torch.Tensor, side: str,
               data_type: Any) -> Any:
        """The graph tensor `name` (uid) of `like`, with its ragged offset (uid _PADDED_UID["off_" + name]) on a
        ragged side."""
        dim, stride = self.dims(like, side)
        node = graph.tensor(uid=uid, dim=dim, stride=stride, data_type=data_type)
        if self.ragged(side):
            node.set_ragged_offset(self.offset_tensor(cudnn, graph, name))
        return node

    def offset_tensor(self, cudnn: Any, graph: Any, name: str) -> Any:
        return graph.tensor(uid=_PADDED_UID["off_" + name], dim=(self.batch + 1, 1, 1, 1), stride=(1, 1, 1, 1),
                            data_type=cudnn.data_type.INT64)

    def table_view(self) -> torch.Tensor:
        assert self.table is not None
        return self.table[:, None, :, None]  # (batch, 1, max_pages, 1), the block table's own strides

    def padding(self, cudnn: Any, graph: Any) -> dict[str, Any]:
        """sdpa's keywords: use_padding_mask and the two length tensors; the page tables of a paged cache."""
        lengths = {name: graph.tensor(uid=_PADDED_UID[name], dim=(self.batch, 1, 1, 1), stride=(1, 1, 1, 1),
                                      data_type=cudnn.data_type.INT32) for name in ("seq_len_q", "seq_len_kv")}
        kwargs: dict[str, Any] = {"use_padding_mask": True, **lengths}
        if self.table is not None:
            table = self.table_view()
            kwargs.update({f"paged_attention_{n}_table": graph.tensor(
                uid=_PADDED_UID[f"page_table_{n}"], dim=tuple(table.shape), stride=table.stride(),
                data_type=cudnn.data_type.INT32) for n in ("k", "v")})
            kwargs["paged_attention_max_seq_len_kv"] = self.max_k
        return kwargs

    def fill(self, pack: dict[int, torch.Tensor], tensors: dict[str, tuple[torch.Tensor, str]]) -> None:
        """This call's lengths, page tables and each named tensor's offsets (on a ragged side) into `pack` (the
        tensors themselves are the caller's)."""
        pack[_PADDED_UID["seq_len_q"]], pack[_PADDED_UID["seq_len_kv"]] = self.seq_len_q, self.seq_len_kv
        if self.table is not None:
            pack[_PADDED_UID["page_table_k"]] = pack[_PADDED_UID["page_table_v"]] = self.table_view()
        for name, (t, side) in tensors.items():
            if self.ragged(side):
                pack[_PADDED_UID["off_" + name]] = self.offsets(t, side)


def _graph_bias(call: AttentionCall) -> torch.Tensor | None:
    """The call's attn_bias as the graph's bias (detached): 4-D in q's dtype (cuDNN's bias is the graph's io type,
    as torch's SDPA rounds a bias to q's dtype), batch and head dims 1 or full, the query and key dims full
    (a bias broadcast along them is expanded), contiguous."""
    bias = call.attn_bias
    if bias is None:
        return None
    bias = bias.detach()
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    full = bias.expand(bias.shape[0], bias.shape[1], call.seqlen_q, call.seqlen_k)
    return full.to(call.dtype).contiguous()


def _user_bias_grad(d_bias: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """dBias as the graph wrote it ((1 | b, 1 | h, s_q, s_k): cuDNN sums the batch and head dims the bias
    broadcasts over) summed over the query/key dims the caller's bias broadcasts over, in its shape and dtype."""
    shape4 = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    dims = [i for i in (2, 3) if shape4[i] == 1 and d_bias.shape[i] != 1]
    grad = d_bias.float().sum(dim=dims, keepdim=True) if dims else d_bias
    return grad.reshape(bias.shape).to(bias.dtype)


@functools.cache
def _triton_kernels() -> Any:
    """The Triton kernels beside this module, _cudnn_fp8_triton (imported at first use: Triton is optional), or None
    without Triton."""
    try:
        from . import _cudnn_fp8_triton as kernels
    except ImportError:
        return None
    return kernels


_FP8_FORMAT = {  # kind: (largest finite magnitude's bits, mantissa bits, exponent bias)
    "e4m3": (0x7E, 3, 7), "e5m2": (0x7B, 2, 15)}
_DEQUANT_BLOCK = 4096
# v_amax_bits: an 8 KB tile per loop step (32 bytes a thread at 8 warps: 16-byte loads along d), about 4 programs
# per SM, each folding up to 8 tiles in registers with one atomic at the end (v of 8x8x4096x128 e4m3: 512 programs
# of 8 tiles, where a program per 64 rows made 4096 programs and 4096 atomics on one word).
_AMAX_TILE, _AMAX_PROGRAMS_PER_SM, _AMAX_MAX_STEPS = 8192, 4, 8


class _Plan:
    """A built graph and how to run it: `index` the plan autotuning chose (run with `execute_plan_at_index`), or
    None for cuDNN's own candidate (`execute`); `workspace_size` that plan's."""

    __slots__ = ("graph", "index", "workspace_size")

    def __init__(self, graph: Any, index: int | None, workspace_size: int) -> None:
        self.graph, self.index, self.workspace_size = graph, index, workspace_size

    def execute(self, pack: dict[int, torch.Tensor], workspace: torch.Tensor, handle: Any) -> None:
        if self.index is None:
            self.graph.execute(pack, workspace, handle=handle)
        else:
            self.graph.execute_plan_at_index(pack, workspace, self.index, handle=handle)


def _time_plan(launch: Any, device: torch.device) -> float:
    """Mean milliseconds of `launch()` over _AUTOTUNE_REPS runs on the current stream (CUDA events; the caller
    made the warm-up run)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_AUTOTUNE_REPS):
        launch()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / _AUTOTUNE_REPS


def _fastest_plan(cudnn: Any, graph: Any, pack: dict[int, torch.Tensor], handle: Any, device: torch.device,
                  signature: str) -> _Plan:
    """Run every plan `build_plans(ALL)` built on the call's tensors and keep the fastest (a plan that did not
    build refuses execution: skipped). Leaves `pack`'s outputs written by the last plan run; the caller runs the
    chosen plan after."""
    times: dict[int, float] = {}
    refused: list[str] = []
    for index in range(graph.get_execution_plan_count()):
        workspace = torch.empty(graph.get_workspace_size_plan_at_index(index), dtype=torch.uint8, device=device)

        def launch(index: int = index, workspace: torch.Tensor = workspace) -> None:
            graph.execute_plan_at_index(pack, workspace, index, handle=handle)

        try:
            launch()  # warm-up; raises for a plan that did not build ("Plan index i did not build.")
        except (RuntimeError, cudnn.cudnnGraphNotSupportedError) as error:
            refused.append(f"plan {index}: {error}")
            continue
        times[index] = _time_plan(launch, device)
    if not times:
        raise RuntimeError(f"nvidia.cudnn_frontend: no built cuDNN plan ran for {signature}: {'; '.join(refused)}. "
                           "Turn autotuning off (ops.attention.options.'nvidia.cudnn_frontend': {autotune: false}) "
                           "to run cuDNN's first plan")
    best = min(times, key=lambda i: (times[i], i))
    return _Plan(graph, best, graph.get_workspace_size_plan_at_index(best))


class _Scratch:
    """The FP8 call's buffers on one (device, stream): what cuDNN and the Triton kernels write, reused call after
    call in stream order; `workspaces` by graph signature."""

    __slots__ = ("amax_s", "amax_o", "v_bits", "scale_o", "workspaces")

    def __init__(self, device: torch.device) -> None:
        scalar: dict[str, Any] = dict(dtype=torch.float32, device=device)
        self.amax_s = torch.empty((1, 1, 1, 1), **scalar)
        self.amax_o = torch.empty((1, 1, 1, 1), **scalar)
        self.scale_o = torch.empty((1, 1, 1, 1), **scalar)
        self.v_bits = torch.zeros(1, dtype=torch.int32, device=device)  # zeroed again by each `output_scale`
        self.workspaces: dict[Any, torch.Tensor] = {}


class _Graphs:
    """Built graphs by signature, one cuDNN handle and lock per device, the constant scalars per device and the
    scratch buffers per (device, stream); thread-safe, bounded. Emptied at interpreter exit (`_release_at_exit`)."""

    def __init__(self, limit: int = 256) -> None:
        _LIVE_GRAPHS.add(self)
        self.lock = threading.Lock()
        self.graphs: dict[Any, _Plan] = {}
        self.handles: dict[int, tuple[Any, threading.Lock]] = {}
        self.constants: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch: dict[tuple[int, int], _Scratch] = {}
        self.grad_scales: dict[Any, torch.Tensor] = {}  # FP8 backward: the last scales of dQ, dK, dV, dP
        self.limit = limit

    def clear(self) -> None:
        with self.lock:
            self.graphs.clear()
            self.handles.clear()
            self.grad_scales.clear()

    def handle(self, cudnn: Any, device: torch.device) -> tuple[Any, threading.Lock]:
        index = device.index if device.index is not None else 0
        with self.lock:
            if index not in self.handles:
                self.handles[index] = (cudnn.create_handle(), threading.Lock())
            return self.handles[index]

    def fp8_buffers(self, device: torch.device, stream: int, capturing: bool
                    ) -> tuple[dict[str, torch.Tensor], _Scratch]:
        """(scale_s and descale_s, the scratch of `stream`); fresh and uncached during CUDA-graph capture when
        not made before it."""
        index = device.index if device.index is not None else 0
        with self.lock:
            constants, scratch = self.constants.get(index), self.scratch.get((index, stream))
        if constants is None:
            scalar: dict[str, Any] = dict(dtype=torch.float32, device=device)
            constants = {"scale_s": torch.full((1, 1, 1, 1), _SCALE_S, **scalar),
                         "descale_s": torch.full((1, 1, 1, 1), 1.0 / _SCALE_S, **scalar)}
            if not capturing:
                with self.lock:
                    constants = self.constants.setdefault(index, constants)
        if scratch is None:
            scratch = _Scratch(device)
            if not capturing:
                with self.lock:
                    if len(self.scratch) >= self.limit:  # streams come and go: bounded like the graphs
                        self.scratch.pop(next(iter(self.scratch)))
                    scratch = self.scratch.setdefault((index, stream), scratch)
        return constants, scratch


# The frontend's objects (graphs, their tensors, handles) are nanobind instances: any still held when the
# interpreter shuts down is reported as a leak ("nanobind: leaked 57 instances!" after every process that built a
# graph, H100 at 4898005). The caches are dropped before that.
_LIVE_GRAPHS: weakref.WeakSet[_Graphs] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    for graphs in list(_LIVE_GRAPHS):
        graphs.clear()


class CudnnFrontendOptions(BaseModel):
    """Policy knobs of `nvidia.cudnn_frontend` (`ops.attention.options."nvidia.cudnn_frontend"` in the policy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    half: bool = Field(
        default=False,
        description="take bf16/fp16 calls too, forward and backward, with bias and ALiBi (FP8 calls always). Off by "
                    "default: cuDNN builds a graph per new "
                    "shape — 0.07-1.0 s each on an H100 (benchmarks/results/policy-proof-window-h100/"
                    "policy_proof.json, first_call_s) — which a workload of changing lengths pays at every new "
                    "length; at repeated shapes it is the fastest windowed forward there (14-61% over torch's FA2, "
                    "same file). Turn on for fixed-shape inference")
    fp8_dpa: bool = Field(
        default=False,
        description="compute bf16/fp16 calls in FP8, as TransformerEngine's fp8_dpa does: q/k/v cast to e4m3 with "
                    "current per-tensor scaling inside the op, the output in the call's dtype, and for inputs that "
                    "require grad an FP8 backward (sdpa_fp8_backward) returning dq/dk/dv in the inputs' dtype. "
                    "FP8's error (a few % of the output's max) replaces bf16's: opt in per workload")
    kv_cache: bool = Field(
        default=True,
        description="take bf16/fp16 KV-cache calls (seqused_k over a dense cache of a fixed capacity, or a paged "
                    "cache) even with `half` off: their padding-mask graph is keyed by the batch and the cache's "
                    "capacity (dense) or pools and block table (paged), not by the fill, so a decode loop builds "
                    "one graph, not one per length (each first call of a new batch size still builds one: "
                    "benchmarks/results/h100-kvfe/kv_cache-h100.md, first call)")
    autotune: bool = Field(
        default=True,
        description="at a signature's first call (never inside CUDA-graph capture: a new signature there is "
                    "refused anyway) build every plan cuDNN's heuristics list (build_plan_policy.ALL) instead of "
                    "the first, time each on the call's own tensors with CUDA events (1 warm-up and "
                    f"{_AUTOTUNE_REPS} timed runs) and run the fastest at every later call of the signature. "
                    "Costs the other plans' builds and a few runs of each once per signature; off: cuDNN's first "
                    "plan")


class CudnnFrontendAttention(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "cudnn_frontend"
    priority: ClassVar[int] = 38  # below nvidia.cudnn (torch's binding of the same kernels, no Python per call)
    description: ClassVar[str] = ("cuDNN SDPA through the cuDNN frontend's Python graph API (nvidia-cudnn-frontend):"
                                  " bf16/fp16 forward and backward (bias, ALiBi, thd), paged K/V forward, FP8 forward"
                                  " and fp8_dpa training")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    min_capability: ClassVar[tuple[int, int] | None] = (8, 0)
    requires = (CUDNN_FRONTEND,)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}) | FP8_DTYPES, head_dim_min=8, head_dim_max=256,
        head_dim_multiple=8, head_dim_v_differs=True, layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), causal=True,
        backward=True,  # bf16/fp16's sdpa_backward, FP8's for fp8_dpa calls (limits: extra_reasons)
        causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True,
        # bf16/fp16 only (cuDNN: "SDPA FP8 does not support bias"); ALiBi causal with cuDNN's fixed slopes, neither
        # with a bottom-right diagonal (extra_reasons, and a run-time check of the slopes)
        attn_bias=True, bias_grad=True, alibi=True,
        # forward only, bf16/fp16 (extra_reasons); cuDNN's published tests page by 32, 64 and 128 keys
        # (test/python/test_mhas.py) and its frontend checks no page size: check_support is the last word
        paged_kv=True, page_size_multiple=_PAGE_SIZE_MULTIPLE, kv_cache=True,
        fp8_out_dtypes=frozenset(FP8_OUT_DTYPES) | FP8_DTYPES, fp8_descale_per_head=False, fp8_out_amax=True,
        # Not measured: cuDNN picks plans per shape; neither determinism is claimed.
        deterministic_forward=False,
    )

    options_model: ClassVar[type[BaseModel]] = CudnnFrontendOptions

    def __init__(self) -> None:
        super().__init__()
        self._graphs = _Graphs()

    # selection_key reads whether each length is 1 (sdpa_backward refuses s_q = s_kv = 1): opdispatch.engine._classes.
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {"seqlen_q": (2,), "seqlen_k": (2,)}

    def selection_key(self, call: AttentionCall) -> Any:
        return (call.seqlen_q == 1, call.seqlen_k == 1)  # besides what the class key holds, extra_reasons reads these

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = self._score_term_reasons(call) + self._thd_reasons(call, device) + self._kv_cache_reasons(call)
        if not call.fp8 and not self.options.fp8_dpa:
            if not self.options.half and not (call.kv_cache and self.options.kv_cache):
                if call.kv_cache:
                    return ["bf16/fp16 KV-cache calls are off: this policy sets the option kv_cache: false (and half "
                            "is off); enable with ops.attention.options.'nvidia.cudnn_frontend': {kv_cache: true}"]
                return ["bf16/fp16 calls are off by default: cuDNN builds a graph per new shape (0.07-1.0 s on an "
                        "H100), paid at every new length; enable with ops.attention.options."
                        "'nvidia.cudnn_frontend': {half: true} for fixed-shape inference (KV-cache calls, whose "
                        "graph holds for every fill, are taken without it)"]
            if call.requires_grad:
                reasons += self._half_backward_reasons(call, device)
            return reasons
        if call.attn_bias is not None or call.alibi_slopes is not None:
            reasons.append("cuDNN's FP8 SDPA takes no attn_bias (\"SDPA FP8 does not support bias\") and ALiBi is "
                           "not built for it here: compute this call in bf16/fp16")
        if call.fp8_out and call.out_dtype != call.dtype:
            reasons.append(f"cuDNN's FP8 SDPA writes its FP8 output in the inputs' kind ({call.dtype}), not "
                           f"{call.out_dtype}: pass out_dtype={call.dtype}")
        if _triton_kernels() is None and not call.fp8_out:
            reasons.append("FP8 calls need Triton (the output's scale and dequantization kernels around the cuDNN "
                           "graph): pip install triton (torch's CUDA wheels bring it)")
        if device.capability is not None and device.capability < (9, 0):
            reasons.append(f"cuDNN FP8 SDPA needs Hopper or newer (sm90+), device is sm{device.capability[0]}"
                           f"{device.capability[1]}")
        if (call.causal_alignment == "bottom_right" and _bounds(call)[1] is not None and device.capability is not None
                and device.capability < (10, 0)):
            reasons.append("cuDNN's FP8 SDPA takes a bottom-right diagonal on Blackwell (sm100+) only "
                           "(sdpa_support_surface.h), device is "
                           f"sm{device.capability[0]}{device.capability[1]}")
        if call.head_dim not in _FP8_HEAD_DIMS or call.head_dim_v != call.head_dim:
            reasons.append(f"cuDNN FP8 SDPA is claimed for head_dim = head_dim_v in {sorted(_FP8_HEAD_DIMS)}, "
                           f"not {call.head_dim}/{call.head_dim_v}")
        return reasons

    @staticmethod
    def _score_term_reasons(call: AttentionCall) -> list[str]:
        """cuDNN's limits on the bias and ALiBi (sdpa_support_surface.h, scaled_dot_product_flash_attention.h)."""
        reasons = []
        left, right = _bounds(call)
        bottom_right = call.causal_alignment == "bottom_right" and right is not None  # cuDNN's "bottom right" mask
        if call.alibi_slopes is not None:
            if right != 0:
                reasons.append("cuDNN's ALiBi needs causal masking (\"When alibi mask is used, "
                               "diagonal_band_right_bound needs to be set to 0\"): pass causal=True, or the ALiBi "
                               "as an additive attn_bias")
            if call.alibi_slopes.requires_grad and call.requires_grad:
                reasons.append("no gradient for alibi_slopes: cuDNN's ALiBi slopes are fixed constants")
        if bottom_right and (call.attn_bias is not None or call.alibi_slopes is not None):
            reasons.append("cuDNN takes a bottom-right diagonal (causal_alignment='bottom_right' with "
                           "seqlen_q != seqlen_k) only without bias and ALiBi (\"Bottom right causal mask is only "
                           "supported with is_bias=False, is_alibi=False\")")
        return reasons

    def _thd_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        """thd runs as cuDNN's ragged graphs, bf16/fp16 only (sdpa_support_surface.h)."""
        if not call.varlen:
            return []
        reasons = []
        if call.fp8 or self.options.fp8_dpa:
            reasons.append("packed varlen (thd) is built here for bf16/fp16 only, not FP8 (fp8 calls or the fp8_dpa "
                           "option): use a dense layout, or compute this call in bf16/fp16")
        if call.alibi_slopes is not None:
            reasons.append("ALiBi with packed varlen (thd) is not built here (cuDNN's ALiBi distances with ragged "
                           "sequences are not verified): use a dense layout or another implementation")
        if device.capability is not None and device.capability < (9, 0):
            reasons.append("cuDNN's ragged (thd) SDPA is claimed on Hopper or newer (sm90+: \"THD (ragged offset) is "
                           "only supported in Hopper and above\" before cuDNN 9.18.1, and the ragged backward's "
                           f"packed LSE is refused on sm8x), device is sm{device.capability[0]}{device.capability[1]}")
        return reasons

    def _kv_cache_reasons(self, call: AttentionCall) -> list[str]:
        """A K/V cache (seqused_k: paged, or dense rows of a capacity) runs as cuDNN's padding-mask forward graph
        (the paged one with page tables), bf16/fp16 only."""
        if not call.kv_cache:
            return []
        reasons = []
        kind = "a paged K/V cache" if call.paged else "a K/V cache (seqused_k)"
        if call.fp8 or self.options.fp8_dpa:
            reasons.append(f"{kind} is built here for bf16/fp16 only, not FP8 (fp8 calls or the fp8_dpa "
                           "option): compute this call in bf16/fp16 or use another implementation")
        if call.requires_grad:
            why = ("cuDNN's sdpa_backward takes no page tables: test/python/sdpa/fp16.py, \"paged attention not "
                   "allowed in backward pass\"" if call.paged else "its backward is not built here")
            reasons.append(f"{kind} is forward only here ({why}); run it under torch.no_grad() or use another "
                           "implementation")
        if call.varlen and not call.paged:
            reasons.append("packed varlen (thd) keys with seqused_k and no block_table are not built here (only "
                           "dense or paged caches): pass a dense (batch, capacity, heads, dim) cache or a paged one")
        return reasons

    @staticmethod
    def _half_backward_reasons(call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        major = device.capability[0] if device.capability is not None else None
        top = _BACKWARD_HEAD_DIM_MAX.get(major, 128) if major is not None else 256
        if max(call.head_dim, call.head_dim_v) > top:
            reasons.append(f"cuDNN's bf16/fp16 backward takes head dims up to {top} on sm{major}x, not "
                           f"{call.head_dim}/{call.head_dim_v}")
        if call.seqlen_q == 1 and call.seqlen_k == 1:
            reasons.append("cuDNN's bf16/fp16 backward refuses seqlen_q = seqlen_k = 1 (\"s_q = s_kv = 1 is not "
                           "supported\")")
        return reasons

    def run(self, call: AttentionCall) -> torch.Tensor:
        import cudnn  # type: ignore[import-not-found]  # the optional nvidia-cudnn-frontend wheel

        if call.fp8:
            assert call.q_descale is not None and call.k_descale is not None and call.v_descale is not None
            return self._forward(cudnn, call, call.q, call.k, call.v, (call.q_descale, call.k_descale,
                                 call.v_descale), call.out_dtype, with_stats=False, out_scale=call.out_scale,
                                 out_amax=call.out_amax)[0]
        if not self.options.fp8_dpa:
            if call.alibi_slopes is not None:
                _check_alibi_slopes(call)
            if call.requires_grad:
                half: torch.Tensor = _HalfDotProductAttention.apply(call.q, call.k, call.v, call.attn_bias, self,
                                                                    call)
                return half
            return self._forward(cudnn, call, call.q, call.k, call.v, None, call.out_dtype, with_stats=False,
                                 bias=_graph_bias(call))[0]
        if call.requires_grad:
            result: torch.Tensor = _Fp8DotProductAttention.apply(call.q, call.k, call.v, self, call)
            return result
        (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, _DPA_KIND) for t in (call.q, call.k, call.v))
        return self._forward(cudnn, call, q8, k8, v8, (qd, kd, vd), call.dtype, with_stats=False)[0]

    def _forward(self, cudnn: Any, call: AttentionCall, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                 descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, out_dtype: torch.dtype,
                 with_stats: bool, out_scale: torch.Tensor | None = None, out_amax: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention of q/k/v in the call's layout (FP8 with `descales`, or bf16/fp16): (the output in
        `out_dtype`, the graph's own output — FP8 for FP8 —, its descale for FP8, the softmax stats (b, h, s_q, 1)
        float32 when `with_stats`). FP8 only: `out_scale` (the caller's, for an FP8 `out_dtype`) is the graph's
        scale_o — no v amax, no dequantization: the graph's output is the result —, and `out_amax` receives
        cuDNN's Amax_O (max|output| in real units). bf16/fp16 only: `bias` the graph's (`_graph_bias`), and the
        call's ALiBi as cuDNN's (slopes checked by the caller)."""
        padded = _Padded(call) if call.varlen or call.kv_cache else None
        q = q_in if call.varlen else call.bhsd(q_in)
        if call.paged:  # the page pools (num_pages, page_size, heads_kv, dim) as cuDNN's (num_pages, heads, size, dim)
            k, v = k_in.permute(0, 2, 1, 3), v_in.permute(0, 2, 1, 3)
        else:
            k, v = (k_in, v_in) if call.varlen else (call.bhsd(k_in), call.bhsd(v_in))
        _check_lengths(call)
        fp8 = descales is not None
        out = torch.empty((*q_in.shape[:-1], call.head_dim_v), dtype=q.dtype if fp8 else out_dtype,
                          device=q.device)
        o = out if call.varlen else call.bhsd(out)
        # (b, h, s_q, 1), or thd's (tokens, h, 1)
        stats = torch.empty((*q.shape[:-1], 1), dtype=torch.float32, device=q.device) if with_stats else None
        # (thd: the token count is no part of a forward graph — its dims are (batch, heads, max_seqlen, dim))
        key = (_shape_key(q, padded, "q"), q.stride(), _shape_key(k, padded, "k"), k.stride(),
               _shape_key(v, padded, "k"),
               v.stride(), o.stride(), q.dtype, call.scale, call.causal, call.causal_alignment, call.window,
               q.device, with_stats, None if bias is None else (tuple(bias.shape), bias.stride()),
               call.alibi_slopes is not None, None if padded is None else padded.key())
        handle, device_lock = self._graphs.handle(cudnn, q.device)
        cuda = q.device.type == "cuda"  # (the contract tests run this adapter on CPU behind a fake `cudnn`)
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        stream = torch.cuda.current_stream(q.device).cuda_stream if cuda else 0
        plan = self._graphs.graphs.get(key)
        graph: Any = None
        if plan is None:
            if capturing:
                raise RuntimeError("nvidia.cudnn_frontend: a call of a new signature inside CUDA-graph capture "
                                   f"({call.describe()}); building its cuDNN graph synchronizes. Run one call of "
                                   "this signature before capturing (warm-up)")
            graph = self._build(cudnn, call, q, k, v, o, stats, bias, handle, padded)
            if not self.options.autotune:
                plan = self._remember(key, _Plan(graph, None, graph.get_workspace_size()))
        pack = {_UID["q"]: q, _UID["k"]: k, _UID["v"]: v, _UID["o"]: o}
        if bias is not None:
            pack[_UID["bias"]] = bias
        if stats is not None:
            pack[_UID["stats"]] = stats
        if padded is not None:
            padded.fill(pack, {"q": (q, "q"), "k": (k, "k"), "v": (v, "k"), "o": (o, "q"),
                               **({"stats": (stats, "q")} if stats is not None else {})})
        scratch = None
        if descales is not None:
            constants, scratch = self._graphs.fp8_buffers(q.device, stream, capturing)
            pack.update({
                _UID["descale_q"]: descales[0].reshape(1, 1, 1, 1),
                _UID["descale_k"]: descales[1].reshape(1, 1, 1, 1),
                _UID["descale_v"]: descales[2].reshape(1, 1, 1, 1),
                _UID["scale_s"]: constants["scale_s"], _UID["descale_s"]: constants["descale_s"],
                _UID["scale_o"]: scratch.scale_o if out_scale is None else out_scale.reshape(1, 1, 1, 1),
                _UID["amax_s"]: scratch.amax_s,
                _UID["amax_o"]: scratch.amax_o if out_amax is None else out_amax.view(1, 1, 1, 1)})
        with device_lock:  # one handle per device: its stream, and the scratch's use, belong to one call at a time
            cudnn.set_stream(handle=handle, stream=stream)
            if scratch is not None and out_scale is None:
                assert descales is not None
                _output_scale(v, descales[2], scratch)
            if plan is None:  # the signature's first call, autotuning: after the scale, on the real tensors
                plan = self._remember(key, _fastest_plan(cudnn, graph, pack, handle, q.device, call.describe()))
            workspace = scratch.workspaces.get(key) if scratch is not None else None
            if workspace is None:
                workspace = torch.empty(plan.workspace_size, dtype=torch.uint8, device=q.device)
                if scratch is not None and not capturing:
                    scratch.workspaces[key] = workspace
            plan.execute(pack, workspace, handle)
            if scratch is None or out_scale is not None:  # bf16/fp16, or the caller's FP8 output
                return out, out, None, stats
            result = torch.empty(out.shape, dtype=out_dtype, device=out.device)
            _dequantize(out, scratch.scale_o, result)
            # (scale_o is the stream's scratch, rewritten by the next call: the backward keeps its own descale)
            descale_o = 1.0 / scratch.scale_o if with_stats else None
        return result, out, descale_o, stats

    def _backward(self, cudnn: Any, call: AttentionCall, saved: _Saved, grad_out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv in the inputs' dtype from the FP8 forward's `saved` and the output's gradient (cast to FP8
        with current scaling), through cuDNN's FP8 backward graph; the gradients' scales as `_GRAD_RANGE_BITS`
        says."""
        kind = saved.q8.dtype
        fp8_max = float(torch.finfo(kind).max)
        d_o8, d_o_descale = _quantize(grad_out, kind)
        q, k, v, o, d_o = (call.bhsd(t) for t in (saved.q8, saved.k8, saved.v8, saved.o8, d_o8))
        grads8 = [torch.empty(t.shape, dtype=kind, device=t.device) for t in (saved.q8, saved.k8, saved.v8)]
        dq, dk, dv = (call.bhsd(t) for t in grads8)
        key = ("backward", tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), o.stride(),
               d_o.stride(), dq.stride(), dk.stride(), dv.stride(), kind, call.scale, call.causal,
               call.causal_alignment, call.window, q.device)
        cuda = q.device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("nvidia.cudnn_frontend: the FP8 backward checks its gradients' scales on the host "
                               f"(one read per call) and cannot run inside CUDA-graph capture ({saved.describe}); "
                               "capture the forward only, or compute this call in bf16")
        handle, device_lock = self._graphs.handle(cudnn, q.device)
        stream = torch.cuda.current_stream(q.device).cuda_stream if cuda else 0
        constants, _ = self._graphs.fp8_buffers(q.device, stream, capturing=False)
        plan = self._graphs.graphs.get(key)
        graph: Any = None
        if plan is None:
            graph = self._build_backward(cudnn, call, q, k, v, o, d_o, saved.stats, dq, dk, dv, handle)
            if not self.options.autotune:
                plan = self._remember(key, _Plan(graph, None, graph.get_workspace_size()))
        with self._graphs.lock:
            last = self._graphs.grad_scales.get(key)
        scales = last.clone() if last is not None else torch.ones(4, dtype=torch.float32, device=q.device)
        amax = torch.zeros(4, dtype=torch.float32, device=q.device)  # dQ, dK, dV, dP in real units
        descales = saved.descales
        for _attempt in range(_GRAD_ATTEMPTS):
            pack = {_BWD_UID["q"]: q, _BWD_UID["k"]: k, _BWD_UID["v"]: v, _BWD_UID["o"]: o, _BWD_UID["dO"]: d_o,
                    _BWD_UID["stats"]: saved.stats, _BWD_UID["dQ"]: dq, _BWD_UID["dK"]: dk, _BWD_UID["dV"]: dv,
                    _BWD_UID["descale_q"]: descales[0].reshape(1, 1, 1, 1),
                    _BWD_UID["descale_k"]: descales[1].reshape(1, 1, 1, 1),
                    _BWD_UID["descale_v"]: descales[2].reshape(1, 1, 1, 1),
                    _BWD_UID["descale_o"]: saved.descale_o.reshape(1, 1, 1, 1),
                    _BWD_UID["descale_dO"]: d_o_descale.reshape(1, 1, 1, 1),
                    _BWD_UID["scale_s"]: constants["scale_s"], _BWD_UID["descale_s"]: constants["descale_s"],
                    _BWD_UID["descale_dP"]: (1.0 / scales[3:4]).reshape(1, 1, 1, 1)}
            for i, name in enumerate(("dQ", "dK", "dV", "dP")):
                pack[_BWD_UID[f"scale_{name}"]] = scales[i:i + 1].reshape(1, 1, 1, 1)
                pack[_BWD_UID[f"amax_{name}"]] = amax[i:i + 1].reshape(1, 1, 1, 1)
            with device_lock:
                cudnn.set_stream(handle=handle, stream=stream)
                if plan is None:
                    plan = self._remember(key, _fastest_plan(cudnn, graph, pack, handle, q.device, saved.describe))
                workspace = torch.empty(plan.workspace_size, dtype=torch.uint8, device=q.device)
                plan.execute(pack, workspace, handle)
            used = amax * scales
            fits = (used <= fp8_max) & ((used >= fp8_max * 2.0 ** -_GRAD_RANGE_BITS) | (amax == 0))
            if bool(fits.all()):  # the one host read of the backward
                break
            scales = torch.where(amax > 0, fp8_max / (2 * amax), torch.ones_like(amax))
        else:
            raise RuntimeError(f"nvidia.cudnn_frontend: the FP8 backward's gradients did not fit FP8's range in "
                               f"{_GRAD_ATTEMPTS} runs ({saved.describe}; amax of dQ, dK, dV, dP: "
                               f"{amax.tolist()}, scales {scales.tolist()}); compute this call in bf16 (drop the "
                               "fp8_dpa option)")
        with self._graphs.lock:
            if len(self._graphs.grad_scales) >= self._graphs.limit and key not in self._graphs.grad_scales:
                self._graphs.grad_scales.pop(next(iter(self._graphs.grad_scales)))
            self._graphs.grad_scales[key] = scales
        results = []
        for i, grad8 in enumerate(grads8):
            grad = torch.empty(grad8.shape, dtype=saved.dtype, device=grad8.device)
            _dequantize(grad8, scales[i:i + 1], grad)
            results.append(grad)
        return results[0], results[1], results[2]

    def _half_backward(self, cudnn: Any, call: AttentionCall, saved: tuple[torch.Tensor, ...],
                       bias: torch.Tensor | None, grad_out: torch.Tensor, bias_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """dq, dk, dv (the call's layout and dtype) and, with `bias_grad`, the graph bias's gradient (its shape)
        through cuDNN's bf16/fp16 `sdpa_backward` from the forward's q, k, v, output and stats (`saved`)."""
        q_in, k_in, v_in, out, stats = saved
        if call.varlen:
            # cuDNN 9.19's ragged backward mis-addresses q/k/v whose token stride is not their own heads x dim (sliced
            # from one packed projection): dq wrong past the first sequence, dk NaN, while the forward is right
            # (benchmarks/results/h100-ce56e4a/cudnn_thd_probe-h100.md); compact copies are what it gets right
            q_in, k_in, v_in = (t if t.is_contiguous() else t.contiguous() for t in (q_in, k_in, v_in))
        # cuDNN's backward reads dO with O's strides: an autograd gradient of other strides is copied into O's
        d_o_in = grad_out
        if grad_out.stride() != out.stride() or grad_out.dtype != out.dtype:
            d_o_in = torch.empty_like(out)
            d_o_in.copy_(grad_out)
        grads_in = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q_in, k_in, v_in)]
        padded = _Padded(call) if call.varlen else None  # (paged calls have no backward: extra_reasons)
        q, k, v, o, d_o, dq, dk, dv = ((q_in, k_in, v_in, out, d_o_in, *grads_in) if padded is not None else
                                       (call.bhsd(t) for t in (q_in, k_in, v_in, out, d_o_in, *grads_in)))
        d_bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if bias is not None and bias_grad \
            else None
        # thd: the backward's workspace is sized by the token counts (max_total_seq_len_q/kv), rounded up to 64
        # as test/python/sdpa/fp16.py rounds them, so a graph serves every count up to it
        totals = None if padded is None else (_round_up(q.shape[0], 64), _round_up(k.shape[0], 64))
        key = ("half_backward", _shape_key(q, padded, "q"), q.stride(), _shape_key(k, padded, "k"), k.stride(),
               _shape_key(v, padded, "k"), v.stride(), o.stride(), d_o.stride(), dq.stride(), dk.stride(), dv.stride(),
               q.dtype, call.scale, call.causal, call.causal_alignment, call.window, q.device,
               call.alibi_slopes is not None, None if bias is None else (tuple(bias.shape), bias.stride()),
               d_bias is not None, None if padded is None else padded.key(), totals)
        cuda = q.device.type == "cuda"
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        stream = torch.cuda.current_stream(q.device).cuda_stream if cuda else 0
        handle, device_lock = self._graphs.handle(cudnn, q.device)
        plan = self._graphs.graphs.get(key)
        graph: Any = None
        if plan is None:
            if capturing:
                raise RuntimeError("nvidia.cudnn_frontend: a backward of a new signature inside CUDA-graph capture "
                                   f"({call.describe()}); building its cuDNN graph synchronizes. Run one backward of "
                                   "this signature before capturing (warm-up)")
            graph = self._build_half_backward(cudnn, call, q, k, v, o, d_o, stats, bias, dq, dk, dv, d_bias,
                                              handle, padded, totals)
            if not self.options.autotune:
                plan = self._remember(key, _Plan(graph, None, graph.get_workspace_size()))
        pack = {_HALF_BWD_UID["q"]: q, _HALF_BWD_UID["k"]: k, _HALF_BWD_UID["v"]: v, _HALF_BWD_UID["o"]: o,
                _HALF_BWD_UID["dO"]: d_o, _HALF_BWD_UID["stats"]: stats, _HALF_BWD_UID["dQ"]: dq,
                _HALF_BWD_UID["dK"]: dk, _HALF_BWD_UID["dV"]: dv}
        if bias is not None:
            pack[_HALF_BWD_UID["bias"]] = bias
        if d_bias is not None:
            pack[_HALF_BWD_UID["dBias"]] = d_bias
        if padded is not None:
            padded.fill(pack, {"q": (q, "q"), "k": (k, "k"), "v": (v, "k"), "o": (o, "q"), "stats": (stats, "q"),
                               "dO": (d_o, "q"), "dQ": (dq, "q"), "dK": (dk, "k"), "dV": (dv, "k")})
        with device_lock:
            cudnn.set_stream(handle=handle, stream=stream)
            if plan is None:
                plan = self._remember(key, _fastest_plan(cudnn, graph, pack, handle, q.device, call.describe()))
            workspace = torch.empty(plan.workspace_size, dtype=torch.uint8, device=q.device)
            plan.execute(pack, workspace, handle)
        return grads_in[0], grads_in[1], grads_in[2], d_bias

    def _build_half_backward(self, cudnn: Any, call: AttentionCall, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, o: torch.Tensor, d_o: torch.Tensor, stats: torch.Tensor,
                             bias: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                             d_bias: torch.Tensor | None, handle: Any, padded: _Padded | None = None,
                             totals: tuple[int, int] | None = None) -> Any:
        """cuDNN's bf16/fp16 SDPA backward (test/python/sdpa/fp16.py's backward graph): the forward's bounds,
        bias and ALiBi; dBias (the bias's dims: cuDNN reduces the batch and head dims it broadcasts over); thd: every
        tensor padded, the padding mask, and the token counts' bound `totals` as max_total_seq_len_q/kv."""
        io = _cudnn_type(cudnn, q.dtype)
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        inputs = {n: _graph_tensor(cudnn, graph, _HALF_BWD_UID[n], n, t, side,
                                   cudnn.data_type.FLOAT if n == "stats" else io, padded)
                  for n, t, side in (("q", q, "q"), ("k", k, "k"), ("v", v, "k"), ("o", o, "q"), ("dO", d_o, "q"),
                                     ("stats", stats, "q"))}
        t_bias = t_dbias = None
        if bias is not None:
            t_bias = graph.tensor(uid=_HALF_BWD_UID["bias"], dim=tuple(bias.shape), stride=bias.stride(),
                                  data_type=io)
        if d_bias is not None:
            t_dbias = graph.tensor(uid=_HALF_BWD_UID["dBias"], dim=tuple(d_bias.shape), stride=d_bias.stride(),
                                   data_type=io)
        left, right = _bounds(call)
        align = (cudnn.diagonal_alignment.BOTTOM_RIGHT if call.causal_alignment == "bottom_right"
                 else cudnn.diagonal_alignment.TOP_LEFT)
        padding: dict[str, Any] = {}
        if padded is not None:
            assert totals is not None
            padding = {**padded.padding(cudnn, graph), "max_total_seq_len_q": totals[0],
                       "max_total_seq_len_kv": totals[1]}
        t_dq, t_dk, t_dv = graph.sdpa_backward(
            **inputs, attn_scale=call.scale, bias=t_bias, dBias=t_dbias,
            use_alibi_mask=call.alibi_slopes is not None, diagonal_alignment=align, diagonal_band_left_bound=left,
            diagonal_band_right_bound=right, **padding)
        for name, t, like, side in (("dQ", t_dq, dq, "q"), ("dK", t_dk, dk, "k"), ("dV", t_dv, dv, "k")):
            _set_output(cudnn, graph, t, _HALF_BWD_UID[name], name, like, side, io, padded)
        return self._build_plans(cudnn, graph)

    def _remember(self, key: Any, plan: _Plan) -> _Plan:
        with self._graphs.lock:
            if len(self._graphs.graphs) >= self._graphs.limit:
                self._graphs.graphs.pop(next(iter(self._graphs.graphs)))
            self._graphs.graphs[key] = plan
        return plan

    def _build_plans(self, cudnn: Any, graph: Any) -> Any:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        if self.options.autotune:
            graph.build_plans(cudnn.build_plan_policy.ALL)  # every plan: `_fastest_plan` times them
        else:
            graph.build_plans()
        return graph

    def _build(self, cudnn: Any, call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               o: torch.Tensor, stats: torch.Tensor | None, bias: torch.Tensor | None, handle: Any,
               padded: _Padded | None = None) -> Any:
        io = _cudnn_type(cudnn, q.dtype)
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        tq, tk, tv = (_graph_tensor(cudnn, graph, _UID[n], n, t, side, io, padded)
                      for n, t, side in (("q", q, "q"), ("k", k, "k"), ("v", v, "k")))
        left, right = _bounds(call)
        align = (cudnn.diagonal_alignment.BOTTOM_RIGHT if call.causal_alignment == "bottom_right"
                 else cudnn.diagonal_alignment.TOP_LEFT)
        if q.dtype in FP8_DTYPES:
            scalars = {n: _scalar(cudnn, graph, _UID[n])
                       for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
            to, t_stats, amax_s, amax_o = graph.sdpa_fp8(
                q=tq, k=tk, v=tv, **scalars, generate_stats=stats is not None, attn_scale=call.scale,
                diagonal_alignment=align, left_bound=left, right_bound=right)
            for name, t in (("amax_s", amax_s), ("amax_o", amax_o)):
                _scalar_output(cudnn, t, _UID[name])
        else:
            t_bias = None if bias is None else graph.tensor(uid=_UID["bias"], dim=tuple(bias.shape),
                                                            stride=bias.stride(), data_type=io)
            padding = padded.padding(cudnn, graph) if padded is not None else {}
            to, t_stats = graph.sdpa(q=tq, k=tk, v=tv, generate_stats=stats is not None, attn_scale=call.scale,
                                     bias=t_bias, use_alibi_mask=call.alibi_slopes is not None,
                                     diagonal_alignment=align, diagonal_band_left_bound=left,
                                     diagonal_band_right_bound=right, **padding)
        _set_output(cudnn, graph, to, _UID["o"], "o", o, "q", io, padded)
        if stats is not None:
            _set_output(cudnn, graph, t_stats, _UID["stats"], "stats", stats, "q", cudnn.data_type.FLOAT, padded)
        return self._build_plans(cudnn, graph)

    def _build_backward(self, cudnn: Any, call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, d_o: torch.Tensor, stats: torch.Tensor, dq: torch.Tensor,
                        dk: torch.Tensor, dv: torch.Tensor, handle: Any) -> Any:
        """cuDNN's FP8 SDPA backward (test/python/sdpa/fp8.py's graph): every tensor FP8 of one kind but the
        stats, the scales and the amaxes (float32); dQ/dK/dV FP8 with their scales (Hopper has no bf16 output)."""
        io = _cudnn_type(cudnn, q.dtype)
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        inputs = {n: graph.tensor(uid=_BWD_UID[n], dim=tuple(t.shape), stride=t.stride(),
                                  data_type=cudnn.data_type.FLOAT if n == "stats" else io)
                  for n, t in (("q", q), ("k", k), ("v", v), ("o", o), ("dO", d_o), ("stats", stats))}
        scalars = {n: _scalar(cudnn, graph, _BWD_UID[n])
                   for n in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
                             "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")}
        left, right = _bounds(call)
        align = (cudnn.diagonal_alignment.BOTTOM_RIGHT if call.causal_alignment == "bottom_right"
                 else cudnn.diagonal_alignment.TOP_LEFT)
        t_dq, t_dk, t_dv, *amaxes = graph.sdpa_fp8_backward(
            **inputs, **scalars, attn_scale=call.scale, diagonal_alignment=align, left_bound=left,
            right_bound=right)
        for name, t, like in (("dQ", t_dq, dq), ("dK", t_dk, dk), ("dV", t_dv, dv)):
            t.set_uid(_BWD_UID[name]).set_output(True).set_dim(tuple(like.shape)).set_stride(like.stride()) \
                .set_data_type(io)
        for name, t in zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), amaxes, strict=True):
            _scalar_output(cudnn, t, _BWD_UID[name])
        return self._build_plans(cudnn, graph)


def _shape_key(t: torch.Tensor, padded: _Padded | None, side: str) -> tuple[int, ...]:
    """A tensor's shape in a graph key: a packed one's without its token count (the graph's dims hold
    max_seqlen)."""
    return tuple(t.shape[1:]) if padded is not None and padded.ragged(side) else tuple(t.shape)


def _graph_tensor(cudnn: Any, graph: Any, uid: int, name: str, t: torch.Tensor, side: str, data_type: Any,
                  padded: _Padded | None) -> Any:
    """An input of the graph: `t`'s dims and strides, or for thd its ragged tensor (side "q" or "k")."""
    if padded is None:
        return graph.tensor(uid=uid, dim=tuple(t.shape), stride=t.stride(), data_type=data_type)
    return padded.tensor(cudnn, graph, uid, name, t, side, data_type)


def _set_output(cudnn: Any, graph: Any, node: Any, uid: int, name: str, like: torch.Tensor, side: str,
                data_type: Any, padded: _Padded | None) -> None:
    """An output of the graph written into `like` (thd: as its ragged tensor)."""
    dim, stride = (tuple(like.shape), like.stride()) if padded is None else padded.dims(like, side)
    node.set_uid(uid).set_output(True).set_dim(dim).set_stride(stride).set_data_type(data_type)
    if padded is not None and padded.ragged(side):
        node.set_ragged_offset(padded.offset_tensor(cudnn, graph, name))


class _Saved:
    """What the FP8 backward needs from the forward: the FP8 q/k/v and output in the call's layout, their
    descales, the softmax stats, the inputs' dtype and the call's description (for errors)."""

    __slots__ = ("q8", "k8", "v8", "o8", "descales", "descale_o", "stats", "dtype", "describe")

    def __init__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o8: torch.Tensor,
                 descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor], descale_o: torch.Tensor,
                 stats: torch.Tensor, dtype: torch.dtype, describe: str) -> None:
        self.q8, self.k8, self.v8, self.o8, self.descales = q8, k8, v8, o8, descales
        self.descale_o, self.stats, self.dtype, self.describe = descale_o, stats, dtype, describe


class _HalfDotProductAttention(torch.autograd.Function):
    """bf16/fp16 q/k/v (and an attn_bias) that require grad: the forward graph also writes the softmax stats, kept
    with q/k/v, the output and the graph's bias for cuDNN's `sdpa_backward`; the bias's gradient (dBias) comes
    back in the caller's bias shape and dtype."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None,
                impl: CudnnFrontendAttention, call: AttentionCall) -> torch.Tensor:
        import cudnn

        bias = _graph_bias(call)
        out, _, _, stats = impl._forward(cudnn, call, q, k, v, None, call.out_dtype, with_stats=True, bias=bias)
        assert stats is not None
        ctx.impl, ctx.call = impl, call.stripped()
        ctx.user_bias = None if attn_bias is None else attn_bias.detach()  # shape and dtype of its gradient
        ctx.save_for_backward(q.detach(), k.detach(), v.detach(), out, stats, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        import cudnn

        q, k, v, out, stats, bias = ctx.saved_tensors
        bias_grad = ctx.user_bias is not None and ctx.needs_input_grad[3]
        call = ctx.call.with_tensors(q, k, v)
        dq, dk, dv, d_bias = ctx.impl._half_backward(cudnn, call, (q, k, v, out, stats), bias, grad_out, bias_grad)
        user_bias_grad = _user_bias_grad(d_bias, ctx.user_bias) if d_bias is not None else None
        return dq, dk, dv, user_bias_grad, None, None


class _Fp8DotProductAttention(torch.autograd.Function):
    """fp8_dpa with inputs that require grad: bf16/fp16 q/k/v cast to FP8 inside (current scaling), FP8 forward
    with stats, FP8 backward; the gradients come back in the inputs' dtype. (An FP8 *input* is never given a
    gradient: autograd casts a leaf's gradient to the leaf's dtype — FP8 with no scale —, so the op refuses
    requires_grad on FP8 q/k/v.)"""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: CudnnFrontendAttention,
                call: AttentionCall) -> torch.Tensor:
        import cudnn

        (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, _DPA_KIND) for t in (q, k, v))
        out, o8, descale_o, stats = impl._forward(cudnn, call, q8, k8, v8, (qd, kd, vd), q.dtype, with_stats=True)
        assert descale_o is not None and stats is not None
        ctx.impl, ctx.call = impl, call.stripped()  # (never the caller's tensors)
        ctx.saved = _Saved(q8, k8, v8, o8, (qd, kd, vd), descale_o, stats, q.dtype, call.describe())
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        import cudnn

        saved, ctx.saved = ctx.saved, None  # freed once used (a second backward needs retain_graph: refused)
        if saved is None:
            raise RuntimeError("nvidia.cudnn_frontend: a second backward through an fp8_dpa attention call; its FP8 "
                               "tensors are freed after the first (retain_graph is not supported here)")
        dq, dk, dv = ctx.impl._backward(cudnn, ctx.call, saved, grad_out)
        return dq, dk, dv, None, None


def _scalar(cudnn: Any, graph: Any, uid: int) -> Any:
    return graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)


def _scalar_output(cudnn: Any, t: Any, uid: int) -> None:
    t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(cudnn.data_type.FLOAT)


def _quantize(t: torch.Tensor, kind: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t cast to FP8 `kind` with current per-tensor scaling, its float32 descale): real = fp8 * descale, the
    largest |t| at FP8's largest finite; an all-zero t gets descale 1."""
    fp8_max = torch.finfo(kind).max
    amax = t.detach().abs().amax().float()
    descale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    # (clamped: amax / descale may round a hair above fp8_max, which the cast would turn into NaN; contiguous: an
    # expanded gradient, stride 0, is no tensor a graph can take)
    return (t.detach().float() / descale).clamp(-fp8_max, fp8_max).to(kind).contiguous(), descale


def _output_scale(v: torch.Tensor, v_descale: torch.Tensor, scratch: _Scratch) -> None:
    """scratch.scale_o = fp8_max / max|v| in real units (the output is a convex mix of v's rows, so it never
    exceeds max|v|) for FP8 `v` (b, h, s, d), any strides: two Triton launches on the current stream, no host
    read."""
    kernels = _triton_kernels()
    max_finite_bits, mantissa_bits, bias = _FP8_FORMAT["e4m3" if "e4m3" in str(v.dtype) else "e5m2"]
    # max|v| does not depend on the order of rows: walk the row dims by decreasing stride, so that consecutive rows
    # are neighbours in memory for every layout (bshd's (b, h, s) is walked as (b, s, h)).
    order = sorted(range(3), key=lambda i: -v.stride()[i])
    rows_view = v.permute(*order, 3)
    n0, n1, n2, d = rows_view.shape
    rows = n0 * n1 * n2
    block_d = _next_power_of_2(d)
    block_r = max(1, _AMAX_TILE // block_d)
    tiles = _cdiv(rows, block_r)
    # tiles per program: a power of two up to _AMAX_MAX_STEPS (a constexpr, so at most 4 compiled variants)
    steps = min(_AMAX_MAX_STEPS, _next_power_of_2(_cdiv(tiles, _AMAX_PROGRAMS_PER_SM * _multiprocessors(v.device))))
    kernels.v_amax_bits[(max(1, _cdiv(tiles, steps)),)](
        rows_view.view(torch.uint8), scratch.v_bits, rows, n1, n2, d, *rows_view.stride(),
        MAX_FINITE_BITS=max_finite_bits, BLOCK_R=block_r, BLOCK_D=block_d, STEPS=steps, num_warps=8)
    kernels.output_scale[(1,)](scratch.v_bits, v_descale.reshape(1), scratch.scale_o,
                               FP8_MAX=float(torch.finfo(v.dtype).max), MANTISSA_BITS=mantissa_bits,
                               EXPONENT_BIAS=bias)


def _dequantize(o8: torch.Tensor, scale_o: torch.Tensor, out: torch.Tensor) -> None:
    """out = o8 / scale_o in out's dtype, one pass (both contiguous, same shape)."""
    n = o8.numel()
    _triton_kernels().dequantize[(max(1, _cdiv(n, _DEQUANT_BLOCK)),)](o8, scale_o, out, n,
                                                                            BLOCK=_DEQUANT_BLOCK)


@functools.cache
def _multiprocessors_of(device_type: str, index: int) -> int:
    if device_type != "cuda":
        return 1  # Triton's interpreter (the CPU tests): a few programs, each looping over several tiles
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _multiprocessors(device: torch.device) -> int:
    return _multiprocessors_of(device.type, device.index if device.index is not None else 0)


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, _cdiv(n, multiple) * multiple)


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
