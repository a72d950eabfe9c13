"""Fake NVIDIA cuDNN frontend Python module `cudnn` (NVIDIA/cudnn-frontend python/pygraph/sdpa.cpp at commit
3929da2ef4c1dba1bb8acb68727b9134f26f40c0): `pygraph` with `tensor`, `sdpa` and `sdpa_fp8` taking the published
keywords (an unknown keyword is a TypeError), the build steps, and `execute`, which reads each variant-pack tensor
through the dims and strides the graph declared (`torch.as_strided`: a wrong stride convention reads the wrong
elements) and computes in float64: FP8 inputs times their descales, the band of fp16_ref.py (key j of query i kept
when i + o - left_bound < j <= i + o + right_bound, o = s_kv - s_q bottom-right), GQA by head // (h_q / h_k), the
output times scale_o for FP8 (saturated to FP8's largest finite, as the kernels' satfinite conversion), rounded to
the output's declared dtype and written through its dims and strides; amax_s and amax_o are max|P| and max|O| in
real units, before scale_s / scale_o (test/python/sdpa/fp8_ref.py's o_amax).
`sdpa_fp8_backward` (python/pygraph/sdpa.cpp, test/python/sdpa/fp8.py's backward graph) computes dQ/dK/dV in float64
from the forward's stats (its log-sum-exp), writes them times their scales as saturating FP8 and their amaxes in real
units. `sdpa` takes `bias` (added after the scale, read through its dims and strides) and `use_alibi_mask`
((col - row) * cuDNN's fixed slopes, get_alibi_slope); `sdpa_backward` (python/pygraph/sdpa.cpp's keywords) computes
dQ/dK/dV and dBias (dS summed over dBias's unit batch/head dims) in float64 from the stats; `validate` raises
cudnnGraphNotSupportedError where cuDNN's support checks refuse what this fake computes (ALiBi without right_bound 0,
bias/ALiBi with a bottom-right diagonal, a band over s_q > s_kv, a backward of s_q = s_kv = 1). Every built graph
is recorded in `graphs` (its tensors and options) and every execution in `executions`
(with the plan index that ran)."""

from __future__ import annotations

import enum
import math
import types
from typing import Any

import torch

graphs: list[Any] = []
executions: list[dict] = []


class data_type(enum.Enum):  # noqa: N801 - the binding's name
    HALF = "half"
    BFLOAT16 = "bfloat16"
    FLOAT = "float"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT32 = "int32"
    INT64 = "int64"


_TORCH = {data_type.HALF: torch.float16, data_type.BFLOAT16: torch.bfloat16, data_type.FLOAT: torch.float32,
          data_type.FP8_E4M3: torch.float8_e4m3fn, data_type.FP8_E5M2: torch.float8_e5m2,
          data_type.INT32: torch.int32, data_type.INT64: torch.int64}


class heur_mode(enum.Enum):  # noqa: N801
    A = "a"
    B = "b"
    FALLBACK = "fallback"


class diagonal_alignment(enum.Enum):  # noqa: N801
    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


class build_plan_policy(enum.Enum):  # noqa: N801
    HEURISTICS_CHOICE = "heuristics_choice"
    ALL = "all"


class cudnnGraphNotSupportedError(Exception):  # noqa: N818 - py::register_exception's default base: Exception
    pass


# The plans cuDNN's heuristics list for every graph (tests set these): how many, which fail to build, and each
# built plan's workspace in bytes (execution checks the workspace it is given is at least that).
plan_count = 3
unbuildable_plans: set[int] = set()


def plan_workspace(index: int) -> int:
    return 16 * (index + 1)


def create_handle() -> object:
    return object()


def set_stream(*, handle: object, stream: int) -> None:
    assert handle is not None and isinstance(stream, int)


def backend_version() -> int:
    return 91900


class Tensor:
    def __init__(self, uid: int | None, dim: tuple[int, ...] | None, stride: tuple[int, ...] | None,
                 data_type: data_type | None) -> None:
        self.uid, self.dim, self.stride, self.data_type = uid, dim, stride, data_type
        self.is_output = False
        self.ragged_offset: Tensor | None = None

    def set_ragged_offset(self, offset: Tensor) -> Tensor:
        """python/properties.cpp's binding of Tensor_attributes::set_ragged_offset: per batch, the element offset of
        that batch's first element (test/python/sdpa/fp16.py: prefix_sum(seq_len) * heads * dim, int64 (b + 1, 1, 1,
        1)), replacing the batch stride."""
        self.ragged_offset = offset
        return self

    def set_uid(self, uid: int) -> Tensor:
        self.uid = uid
        return self

    def set_output(self, value: bool) -> Tensor:
        self.is_output = value
        return self

    def set_dim(self, dim: tuple[int, ...]) -> Tensor:
        self.dim = tuple(dim)
        return self

    def set_stride(self, stride: tuple[int, ...]) -> Tensor:
        self.stride = tuple(stride)
        return self

    def set_data_type(self, value: data_type) -> Tensor:
        self.data_type = value
        return self


class pygraph:  # noqa: N801
    def __init__(self, *, io_data_type: data_type, intermediate_data_type: data_type = data_type.FLOAT,
                 compute_data_type: data_type = data_type.FLOAT, handle: object = None) -> None:
        self.io_data_type = io_data_type
        self.tensors: list[Tensor] = []
        self.op: dict[str, Any] | None = None
        self.built: list[str] = []
        self.plans_built: list[int] = []
        self.candidate: int | None = None

    def tensor(self, *, uid: int, dim: tuple[int, ...], stride: tuple[int, ...], data_type: data_type,
               name: str = "") -> Tensor:
        if len(dim) != len(stride):
            raise ValueError(f"dim {dim} and stride {stride} differ in rank")
        t = Tensor(uid, tuple(dim), tuple(stride), data_type)
        self.tensors.append(t)
        return t

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, is_inference: bool | None = None,
             attn_scale: float | None = None, bias: Tensor | None = None, block_mask: Tensor | None = None,
             use_alibi_mask: bool = False, use_padding_mask: bool = False, seq_len_q: Tensor | None = None,
             seq_len_kv: Tensor | None = None, use_causal_mask: bool = False,
             use_causal_mask_bottom_right: bool = False, sliding_window_length: int | None = None,
             diagonal_alignment: diagonal_alignment = diagonal_alignment.TOP_LEFT,
             diagonal_band_left_bound: int | None = None, diagonal_band_right_bound: int | None = None,
             dropout: Any = None, rng_dump: Tensor | None = None, paged_attention_k_table: Any = None,
             paged_attention_v_table: Any = None, paged_attention_max_seq_len_kv: int | None = None,
             compute_data_type: Any = None, name: str = "", score_mod: Any = None, generate_stats: bool | None = None,
             implementation: Any = None, score_max: Any = None, score_sum_exp: Any = None, sink_token: Any = None,
             unfuse_fma: bool = False) -> list[Tensor]:
        if (generate_stats is None) == (is_inference is None):
            raise RuntimeError("Exactly one of {generate_stats, is_inference} must be set (prefer generate_stats).")
        self.op = dict(kind="sdpa", q=q, k=k, v=v, attn_scale=attn_scale, use_causal_mask=use_causal_mask,
                       use_causal_mask_bottom_right=use_causal_mask_bottom_right,
                       diagonal_alignment=diagonal_alignment, left_bound=diagonal_band_left_bound,
                       right_bound=diagonal_band_right_bound, generate_stats=generate_stats, bias=bias,
                       use_alibi_mask=use_alibi_mask, use_padding_mask=use_padding_mask, seq_len_q=seq_len_q,
                       seq_len_kv=seq_len_kv, page_table_k=paged_attention_k_table,
                       page_table_v=paged_attention_v_table, max_seq_len_kv=paged_attention_max_seq_len_kv)
        return self._outputs(2)

    def sdpa_backward(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, dO: Tensor, stats: Tensor,  # noqa: N803
                      attn_scale: float | None = None, bias: Tensor | None = None, dBias: Tensor | None = None,  # noqa: N803
                      use_alibi_mask: bool = False, use_padding_mask: bool = False, seq_len_q: Tensor | None = None,
                      seq_len_kv: Tensor | None = None, max_total_seq_len_q: int | None = None,
                      max_total_seq_len_kv: int | None = None, use_causal_mask: bool = False,
                      use_causal_mask_bottom_right: bool = False, sliding_window_length: int | None = None,
                      diagonal_alignment: diagonal_alignment = diagonal_alignment.TOP_LEFT,
                      diagonal_band_left_bound: int | None = None, diagonal_band_right_bound: int | None = None,
                      dropout: Any = None, rng_dump: Tensor | None = None, use_deterministic_algorithm: bool = False,
                      compute_data_type: Any = None, name: str = "", score_mod: Any = None,
                      score_mod_bprop: Any = None, sink_token: Tensor | None = None,
                      dSink_token: Tensor | None = None) -> list[Tensor]:  # noqa: N803
        if stats.data_type is not data_type.FLOAT or stats.dim != (*q.dim[:3], 1):
            raise ValueError(f"stats must be FLOAT {(*q.dim[:3], 1)}, got {stats.data_type} {stats.dim}")
        if dBias is not None and bias is None:
            raise ValueError("dBias without bias")
        if dBias is not None and (len(dBias.dim) != 4 or dBias.dim[2:] != bias.dim[2:]):
            raise ValueError(f"dBias dims {dBias.dim} against bias {bias.dim}")
        self.op = dict(kind="sdpa_backward", q=q, k=k, v=v, o=o, dO=dO, stats=stats, attn_scale=attn_scale,
                       bias=bias, dBias=dBias, use_alibi_mask=use_alibi_mask, use_causal_mask=use_causal_mask,
                       use_causal_mask_bottom_right=use_causal_mask_bottom_right,
                       diagonal_alignment=diagonal_alignment, left_bound=diagonal_band_left_bound,
                       right_bound=diagonal_band_right_bound, deterministic=use_deterministic_algorithm,
                       use_padding_mask=use_padding_mask, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                       max_total_seq_len_q=max_total_seq_len_q, max_total_seq_len_kv=max_total_seq_len_kv)
        return self._outputs(3)

    def sdpa_fp8(self, q: Tensor, k: Tensor, v: Tensor, descale_q: Tensor, descale_k: Tensor, descale_v: Tensor,
                 descale_s: Tensor, scale_s: Tensor, scale_o: Tensor, is_inference: bool | None = None,
                 attn_scale: float | None = None, bias: Tensor | None = None, use_alibi_mask: bool = False,
                 use_padding_mask: bool = False, seq_len_q: Tensor | None = None, seq_len_kv: Tensor | None = None,
                 use_causal_mask: bool = False, use_causal_mask_bottom_right: bool = False,
                 sliding_window: int | None = None,
                 diagonal_alignment: diagonal_alignment = diagonal_alignment.TOP_LEFT,
                 left_bound: int | None = None, right_bound: int | None = None, dropout: Any = None,
                 rng_dump: Tensor | None = None, paged_attention_k_table: Any = None,
                 paged_attention_v_table: Any = None, paged_attention_max_seq_len_kv: int | None = None,
                 compute_data_type: Any = None, name: str = "", fn: Any = None, generate_stats: bool | None = None,
                 score_max: Any = None, score_sum_exp: Any = None, sink_token: Any = None) -> list[Tensor]:
        if (generate_stats is None) == (is_inference is None):
            raise RuntimeError("Exactly one of {generate_stats, is_inference} must be set (prefer generate_stats).")
        for t in (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o):
            if t.dim != (1, 1, 1, 1) or t.data_type is not data_type.FLOAT:
                raise ValueError(f"sdpa_fp8 scales are FLOAT (1, 1, 1, 1), got {t.dim} {t.data_type}")
        self.op = dict(kind="sdpa_fp8", q=q, k=k, v=v, descale_q=descale_q, descale_k=descale_k,
                       descale_v=descale_v, descale_s=descale_s, scale_s=scale_s, scale_o=scale_o,
                       attn_scale=attn_scale, use_causal_mask=use_causal_mask,
                       use_causal_mask_bottom_right=use_causal_mask_bottom_right,
                       diagonal_alignment=diagonal_alignment, left_bound=left_bound, right_bound=right_bound,
                       generate_stats=generate_stats)
        return self._outputs(4)

    def sdpa_fp8_backward(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, dO: Tensor, stats: Tensor,  # noqa: N803
                          descale_q: Tensor, descale_k: Tensor, descale_v: Tensor, descale_o: Tensor,
                          descale_dO: Tensor, descale_s: Tensor, descale_dP: Tensor, scale_s: Tensor,  # noqa: N803
                          scale_dQ: Tensor, scale_dK: Tensor, scale_dV: Tensor, scale_dP: Tensor,  # noqa: N803
                          attn_scale: float | None = None, use_padding_mask: bool = False,
                          seq_len_q: Tensor | None = None, seq_len_kv: Tensor | None = None,
                          use_causal_mask: bool = False, use_causal_mask_bottom_right: bool = False,
                          diagonal_alignment: diagonal_alignment = diagonal_alignment.TOP_LEFT,
                          left_bound: int | None = None, right_bound: int | None = None,
                          use_deterministic_algorithm: bool = False, dropout: Any = None,
                          compute_data_type: Any = None, name: str = "", sink_token: Tensor | None = None,
                          dSink_token: Tensor | None = None) -> list[Tensor]:  # noqa: N803
        scales = dict(descale_q=descale_q, descale_k=descale_k, descale_v=descale_v, descale_o=descale_o,
                      descale_dO=descale_dO, descale_s=descale_s, descale_dP=descale_dP, scale_s=scale_s,
                      scale_dQ=scale_dQ, scale_dK=scale_dK, scale_dV=scale_dV, scale_dP=scale_dP)
        for t in scales.values():
            if t.dim != (1, 1, 1, 1) or t.data_type is not data_type.FLOAT:
                raise ValueError(f"sdpa_fp8_backward scales are FLOAT (1, 1, 1, 1), got {t.dim} {t.data_type}")
        if stats.data_type is not data_type.FLOAT or stats.dim != (*q.dim[:3], 1):
            raise ValueError(f"stats must be FLOAT {(*q.dim[:3], 1)}, got {stats.data_type} {stats.dim}")
        self.op = dict(kind="sdpa_fp8_backward", q=q, k=k, v=v, o=o, dO=dO, stats=stats, **scales,
                       attn_scale=attn_scale, use_causal_mask=use_causal_mask,
                       use_causal_mask_bottom_right=use_causal_mask_bottom_right,
                       diagonal_alignment=diagonal_alignment, left_bound=left_bound, right_bound=right_bound,
                       deterministic=use_deterministic_algorithm)
        return self._outputs(7)

    def _outputs(self, n: int) -> list[Tensor]:
        outs = [Tensor(None, None, None, None) for _ in range(n)]
        assert self.op is not None
        self.op["outputs"] = outs
        return outs

    # the build steps, in the order the samples call them
    def validate(self) -> None:
        """cuDNN's support checks on what this fake computes (sdpa_support_surface.h and the backward node's
        validate in scaled_dot_product_flash_attention.h), raised as the binding raises GRAPH_NOT_SUPPORTED."""
        op = self.op
        assert op is not None
        if op["kind"] in ("sdpa", "sdpa_backward"):
            self._validate_padding(op)
            right, bottom_right = op["right_bound"], op["diagonal_alignment"] is diagonal_alignment.BOTTOM_RIGHT
            padding = op["use_padding_mask"]
            if op["use_alibi_mask"] and right != 0:
                raise cudnnGraphNotSupportedError("When alibi mask is used, diagonal_band_right_bound needs to be "
                                                  "set to 0.")
            if right is not None and bottom_right and (op["bias"] is not None or op["use_alibi_mask"]):
                raise cudnnGraphNotSupportedError("Bottom right causal mask is only supported with is_bias=False, "
                                                  "is_alibi=False, is_dropout=False.")
            s_q, s_kv = op["q"].dim[2], op["k"].dim[2]
            if right is not None and bottom_right and not padding and s_q > s_kv:
                raise cudnnGraphNotSupportedError("Bottom right causal mask does not support max_s_q > max_s_kv.")
            if op["left_bound"] is not None and not padding and s_q > s_kv:
                raise cudnnGraphNotSupportedError("Sliding window attention is only supported with max_s_q <= "
                                                  "max_s_kv.")
            if op["kind"] == "sdpa_backward" and op["q"].dim[2] == 1 and op["k"].dim[2] == 1:
                raise cudnnGraphNotSupportedError("s_q = s_kv = 1 is not supported.")
        self.built.append("validate")

    @staticmethod
    def _validate_padding(op: dict[str, Any]) -> None:
        """sdpa_support_surface.h's and the backward node's checks of the padding mask, ragged offsets, the
        backward's max_total_seq_len and paged caches (ATTRIBUTE_NOT_SET raised as RuntimeError)."""
        padding, has_q, has_kv = op["use_padding_mask"], op["seq_len_q"] is not None, op["seq_len_kv"] is not None
        if padding and not (has_q and has_kv):
            raise RuntimeError("Padding mask requires seq_len_q and seq_len_kv to be set.")
        if not padding and (has_q or has_kv):
            raise RuntimeError("seq_len_q and seq_len_kv needs to be set only if padding mask is enabled.")
        for name in ("seq_len_q", "seq_len_kv"):
            t = op[name]
            if t is not None and (t.data_type is not data_type.INT32 or t.dim != (op["q"].dim[0], 1, 1, 1)):
                raise ValueError(f"{name} must be INT32 (b, 1, 1, 1) = {(op['q'].dim[0], 1, 1, 1)}, got "
                                 f"{t.data_type} {t.dim}")
        ragged = [t for t in (op["q"], op["k"], op["v"], op["outputs"][0]) if t.ragged_offset is not None]
        if ragged and not padding:
            raise cudnnGraphNotSupportedError("Ragged offsets are only supported with padding mask.")
        for t in ragged:
            offset = t.ragged_offset
            assert offset is not None
            if offset.data_type is not data_type.INT64 or offset.dim != (t.dim[0] + 1, 1, 1, 1):
                raise ValueError(f"a ragged offset is INT64 (b + 1, 1, 1, 1) = {(t.dim[0] + 1, 1, 1, 1)}, got "
                                 f"{offset.data_type} {offset.dim}")
        if op["kind"] == "sdpa_backward":
            if (op["max_total_seq_len_q"] is not None or op["max_total_seq_len_kv"] is not None) and not ragged:
                raise cudnnGraphNotSupportedError("max_total_seq_len_q is only supported with packed layout")
            return
        paged = op["page_table_k"] is not None or op["page_table_v"] is not None
        if paged and not (has_q and has_kv):
            raise cudnnGraphNotSupportedError("Paged caches can only be used in combination with padding mask and "
                                              "variable sequence lengths for both Q and KV.")
        if not paged and op["max_seq_len_kv"] is not None:
            raise cudnnGraphNotSupportedError("When not using paged attention, there is no need to explicitly set "
                                              "max kv sequence length.")
        for name, container in (("page_table_k", op["k"]), ("page_table_v", op["v"])):
            table = op[name]
            if table is None:
                continue
            if table.data_type is not data_type.INT32 or len(table.dim) != 4 or table.dim[0] != op["q"].dim[0] \
                    or table.dim[1] != 1 or table.dim[3] != 1:
                raise ValueError(f"{name} is INT32 (b, 1, max_pages, 1), got {table.data_type} {table.dim}")
            # paged_cache_load.h (INVALID_VALUE): the table holds exactly ceil(s_kv / block_size) pages, s_kv the
            # paged_attention_max_seq_len_kv (else inferred from the table)
            block_size = container.dim[2]
            s_kv = op["max_seq_len_kv"] if op["max_seq_len_kv"] is not None else table.dim[2] * block_size
            if -(-s_kv // block_size) != table.dim[2]:
                raise RuntimeError("Paged cache load: block table size must equal ceil(s_kv/block_size), except "
                                   "when using packed block tables")

    def build_operation_graph(self) -> None:
        self.built.append("build_operation_graph")

    def create_execution_plans(self, modes: list[heur_mode]) -> None:
        assert all(isinstance(m, heur_mode) for m in modes)
        self.built.append("create_execution_plans")

    def check_support(self) -> None:
        self.built.append("check_support")

    def build_plans(self, policy: build_plan_policy = build_plan_policy.HEURISTICS_CHOICE) -> None:
        """HEURISTICS_CHOICE builds the first plan that builds; ALL every plan (plans.h: the candidate stays the
        first built; one that fails is skipped); neither built: an error."""
        if not isinstance(policy, build_plan_policy):
            raise TypeError(f"build_plans(policy) takes a build_plan_policy, got {policy!r}")
        self.built.append("build_plans")
        for index in range(plan_count):
            if index in unbuildable_plans:
                continue
            self.plans_built.append(index)
            if policy is build_plan_policy.HEURISTICS_CHOICE:
                break
        if not self.plans_built:
            raise cudnnGraphNotSupportedError("[cudnn_frontend] Error: No valid execution plans built.")
        self.candidate = self.plans_built[0]
        graphs.append(self)

    def get_execution_plan_count(self) -> int:
        return plan_count

    def get_workspace_size(self) -> int:
        assert self.candidate is not None
        return plan_workspace(self.candidate)

    def get_workspace_size_plan_at_index(self, index: int) -> int:
        return plan_workspace(index) if index in self.plans_built else 0  # "not built: returns 0"

    def get_plan_name_at_index(self, index: int) -> str:
        return f"fake_engine_{index}"

    def execute_plan_at_index(self, tensor_to_device_buffer: dict[int, torch.Tensor], workspace: torch.Tensor,
                              index: int, handle: object = None, override_uids: Any = None,
                              override_shapes: Any = None, override_strides: Any = None) -> None:
        if not 0 <= index < plan_count:
            raise RuntimeError(f"Plan index {index} is invalid.")
        if index not in self.plans_built:
            raise RuntimeError(f"Plan index {index} did not build.")
        self._run(tensor_to_device_buffer, workspace, index)

    def execute(self, tensor_to_device_buffer: dict[int, torch.Tensor], workspace: torch.Tensor,
                handle: object = None, override_uids: Any = None, override_shapes: Any = None,
                override_strides: Any = None) -> None:
        assert self.candidate is not None
        self._run(tensor_to_device_buffer, workspace, self.candidate)

    def _run(self, variant_pack: dict[int, torch.Tensor], workspace: torch.Tensor, plan: int) -> None:
        if workspace.numel() < plan_workspace(plan):
            raise RuntimeError(f"plan {plan} needs a workspace of {plan_workspace(plan)} bytes, got "
                               f"{workspace.numel()}")
        if self.built != ["validate", "build_operation_graph", "create_execution_plans", "check_support",
                          "build_plans"]:
            raise RuntimeError(f"graph executed after build steps {self.built}")
        op = self.op
        assert op is not None
        executions.append(dict(graph=self, pack=dict(variant_pack), plan=plan))

        def typed(t: Tensor) -> torch.Tensor:
            data = variant_pack[t.uid]
            if _TORCH[t.data_type] != data.dtype:
                raise TypeError(f"uid {t.uid}: graph says {t.data_type}, pack has {data.dtype}")
            return data

        def raw(t: Tensor) -> torch.Tensor:
            """An index tensor (lengths, offsets, page tables) as the graph declared it."""
            data = typed(t)
            return data.as_strided(t.dim, t.stride, data.storage_offset())

        padding = op.get("use_padding_mask", False)
        lengths = {}
        if padding:  # (b,) per side; a ragged tensor's rows past its sequence's length are neither read nor written
            lengths = {side: [int(n) for n in raw(op[name]).reshape(-1).tolist()]
                       for side, name in (("q", "seq_len_q"), ("k", "seq_len_kv"))}

        def blocks(t: Tensor, side: str) -> list[tuple[int, torch.Tensor]]:
            """(batch, the (h, rows, d) view of its valid rows) of a ragged tensor: the batch's element offset
            replaces the batch stride (torch.as_strided refuses a view past the storage: an out-of-bounds offset
            fails as cuDNN's would fault)."""
            assert t.ragged_offset is not None
            data, offsets = variant_pack[t.uid], raw(t.ragged_offset).reshape(-1).tolist()
            _, _, s_max, _ = t.dim
            views = []
            for b, n in enumerate(lengths[side]):
                if not 0 <= n <= s_max:
                    raise RuntimeError(f"seq_len {n} of batch {b} outside 0..{s_max} (the graph's max length)")
                if n:
                    views.append((b, data.as_strided((t.dim[1], n, t.dim[3]), t.stride[1:],
                                                     data.storage_offset() + offsets[b])))
            return views

        def read(t: Tensor, side: str = "q") -> torch.Tensor:
            data = typed(t)
            if t.ragged_offset is None:
                return data.as_strided(t.dim, t.stride, data.storage_offset()).double()
            value = torch.zeros(t.dim, dtype=torch.float64)
            for b, view in blocks(t, side):
                value[b, :, : view.shape[1]] = view.double()
            return value

        def write(t: Tensor, value: torch.Tensor, side: str = "q") -> None:
            target = variant_pack[t.uid]
            if _TORCH[t.data_type] != target.dtype:
                raise TypeError(f"output uid {t.uid}: graph says {t.data_type}, pack has {target.dtype}")
            if target.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # saturating, as a scaled FP8 output
                value = value.clamp(-torch.finfo(target.dtype).max, torch.finfo(target.dtype).max)
            if t.ragged_offset is None:
                target.as_strided(t.dim, t.stride, target.storage_offset()).copy_(value.to(target.dtype))
                return
            for b, view in blocks(t, side):
                view.copy_(value[b, :, : view.shape[1]].to(target.dtype))

        fp8 = op["kind"] not in ("sdpa", "sdpa_backward")
        q = read(op["q"])
        if op.get("page_table_k") is not None:  # paged_cache_load: each sequence's keys from its pages, in order
            k, v = (self._gather_pages(read(op[name]), raw(op[table]), lengths["k"], op["max_seq_len_kv"])
                    for name, table in (("k", "page_table_k"), ("v", "page_table_v")))
        else:
            k, v = read(op["k"], "k"), read(op["v"], "k")
        if fp8:
            q = q * read(op["descale_q"])
            k = k * read(op["descale_k"])
            v = v * read(op["descale_v"])
        b, hq, sq, _ = q.shape
        hk, sk = k.shape[1], k.shape[2]
        group = hq // hk
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * op["attn_scale"]
        if op.get("bias") is not None:  # fp16_ref.py's order: bias, ALiBi, then the masks
            scores = scores + read(op["bias"])
        if op.get("use_alibi_mask"):  # (col - row) * slope: cuDNN's fixed slopes (get_alibi_slope), top-left
            distance = (torch.arange(sk)[None, :] - torch.arange(sq)[:, None]).double()
            scores = scores + distance * torch.tensor(alibi_slopes(hq), dtype=torch.float64).view(1, hq, 1, 1)
        rows, cols = torch.arange(sq).view(1, 1, sq, 1), torch.arange(sk).view(1, 1, 1, sk)
        if padding:  # fp16_ref.py: keys past seq_len_kv masked, rows past seq_len_q zero; per-batch diagonal
            len_q = torch.tensor(lengths["q"]).view(b, 1, 1, 1)
            len_kv = torch.tensor(lengths["k"]).view(b, 1, 1, 1)
            keep = (cols < len_kv) & (rows < len_q)
            offset = len_kv - len_q if op["diagonal_alignment"] is diagonal_alignment.BOTTOM_RIGHT else \
                torch.zeros(b, 1, 1, 1, dtype=torch.long)
        else:
            keep = torch.ones(1, 1, sq, sk, dtype=torch.bool)
            offset = torch.tensor(sk - sq if op["diagonal_alignment"] is diagonal_alignment.BOTTOM_RIGHT else 0)
        rel = cols - rows - offset  # j - (i + o)
        if op["use_causal_mask"] or op["use_causal_mask_bottom_right"]:
            raise AssertionError("the adapter expresses causal as right_bound 0 (not exercised by this fake)")
        if op["right_bound"] is not None:
            keep &= rel <= op["right_bound"]
        if op["left_bound"] is not None:
            keep &= rel > -op["left_bound"]
        scores = scores.masked_fill(~keep, float("-inf"))
        if op["kind"] == "sdpa_fp8_backward":
            self._backward(op, read, write, q, k, v, scores, group)
            return
        if op["kind"] == "sdpa_backward":
            self._half_backward(op, read, write, q, k, v, scores, group)
            return
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = probs @ v
        if op["generate_stats"]:  # the softmax's log-sum-exp per query row (natural log), (b, h, s_q, 1)
            write(op["outputs"][1], torch.logsumexp(scores, dim=-1, keepdim=True), "q")
        if fp8:  # the amaxes in real units, before their scales (fp8_ref.py: o_amax = max|o|, then o * scale_o)
            amax_s, amax_o = op["outputs"][2:4]
            write(amax_s, probs.abs().max().reshape(1, 1, 1, 1))
            write(amax_o, out.abs().max().reshape(1, 1, 1, 1))
            out = out * read(op["scale_o"])
        write(op["outputs"][0], out)

    @staticmethod
    def _gather_pages(container: torch.Tensor, table: torch.Tensor, lengths: list[int],
                      max_seq_len_kv: int | None) -> torch.Tensor:
        """(b, h, s_kv, d) from the container (num_pages, h, block_size, d) and the page table (b, 1, pages, 1):
        sequence b's pages, those its length uses (a page it uses outside the container faults, as cuDNN would
        read out of bounds); keys past its length are zeros (masked anyway)."""
        pages, h, block, d = container.shape
        s_kv = max_seq_len_kv if max_seq_len_kv is not None else table.shape[2] * block
        out = torch.zeros(len(lengths), h, table.shape[2] * block, d, dtype=torch.float64)
        for b, n in enumerate(lengths):
            for p in range(-(-n // block)):
                page = int(table[b, 0, p, 0])
                if not 0 <= page < pages:
                    raise RuntimeError(f"page table [{b}, {p}] = {page} outside the container's {pages} pages")
                out[b, :, p * block:(p + 1) * block] = container[page]
        return out[:, :, :s_kv]

    @staticmethod
    def _backward(op: dict[str, Any], read: Any, write: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scores: torch.Tensor, group: int) -> None:
        """dQ, dK, dV of FP8 attention in float64 from the forward's stats (P = exp(S - stats): a wrong stats
        tensor gives wrong gradients), o and dO dequantized by their descales; each gradient written times its
        scale (saturating FP8), the amaxes in real units (before the scales)."""
        o = read(op["o"]) * read(op["descale_o"])
        d_o = read(op["dO"]) * read(op["descale_dO"])
        d_q, d_k, d_v, d_p, _ = _attention_grads(op, read, q, k, v, scores, o, d_o, group)
        out_dq, out_dk, out_dv, amax_dq, amax_dk, amax_dv, amax_dp = op["outputs"]
        for out, amax, value, scale in ((out_dq, amax_dq, d_q, "scale_dQ"), (out_dk, amax_dk, d_k, "scale_dK"),
                                        (out_dv, amax_dv, d_v, "scale_dV")):
            write(out, value * read(op[scale]))
            write(amax, value.abs().max().reshape(1, 1, 1, 1))
        write(amax_dp, d_p.abs().max().reshape(1, 1, 1, 1))


    @staticmethod
    def _half_backward(op: dict[str, Any], read: Any, write: Any, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, scores: torch.Tensor, group: int) -> None:
        """dQ, dK, dV (and dBias, summed over the dims it has as 1) of bf16/fp16 attention in float64 from the
        forward's stats (P = exp(S - stats): a wrong stats tensor gives wrong gradients), rounded to their dtype."""
        d_q, d_k, d_v, _, d_s = _attention_grads(op, read, q, k, v, scores, read(op["o"]), read(op["dO"]), group)
        for out, value, side in zip(op["outputs"], (d_q, d_k, d_v), ("q", "k", "k"), strict=True):
            write(out, value, side)
        if op["dBias"] is not None:  # a reduction of dS into dBias's dims
            dims = [i for i in (0, 1) if op["dBias"].dim[i] == 1 and d_s.shape[i] != 1]
            write(op["dBias"], d_s.sum(dim=dims, keepdim=True) if dims else d_s)


def _attention_grads(op: dict[str, Any], read: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scores: torch.Tensor, o: torch.Tensor, d_o: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Attention's backward in float64 from the forward's stats (P = exp(S - stats): a wrong stats tensor gives
    wrong gradients), o and dO in real units: (dQ, dK, dV, dP, dS), dK/dV summed over each kv head's query heads."""
    probs = torch.exp(scores - read(op["stats"])).nan_to_num(0.0)
    d_v = probs.transpose(-1, -2) @ d_o
    d_p = d_o @ v.transpose(-1, -2)
    d_s = probs * (d_p - (d_o * o).sum(-1, keepdim=True))
    d_q = d_s @ k * op["attn_scale"]
    d_k = d_s.transpose(-1, -2) @ q * op["attn_scale"]
    b, hq = q.shape[:2]
    d_k = d_k.reshape(b, hq // group, group, *d_k.shape[2:]).sum(2)  # GQA: a kv head's query heads summed
    d_v = d_v.reshape(b, hq // group, group, *d_v.shape[2:]).sum(2)
    return d_q, d_k, d_v, d_p, d_s


def alibi_slopes(heads: int) -> list[float]:
    """cudnn_frontend_utils.h's get_alibi_slope, written independently of the adapter (float64 here; cuDNN's
    are float32, within an ulp)."""
    n = 2 ** int(math.floor(math.log2(heads)))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * i / n) for i in range(1, 2 * (heads - n), 2)]
    return slopes


def fake_modules() -> dict[str, types.ModuleType]:
    import sys

    return {"cudnn": sys.modules[__name__]}
