"""Huawei Ascend attention: `torch_npu.npu_fusion_attention` (FlashAttentionScore), forward and backward.

Sources (read 2026-11): Ascend/op-plugin `docs/context/torch_npu-npu_fusion_attention.md` (the API reference),
Huawei's hiascend.com pages for the same op (PyTorch 6.0.0 `ptaoplist_000850`, CANN 7.0 `ptaoplist_000139`), and
mindstudio-probe's float64 golden of the op (`msprobe/pytorch/bench_functions/npu_fusion_attention.py`):

    npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647,
                         inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False)
        -> (attention_out, softmax_max, softmax_sum, softmax_out (reserved), seed, offset, numels)

Its autograd formula is `npu_fusion_attention_grad` (q, k, v differentiable), so training is autograd through
the call. What this adapter passes, and why:

- layouts: bshd → "BSND", bhsd → "BNSD", sbhd → "SBH" (q/k/v viewed as (S, B, heads * dim)), thd → "TND" with
  `actual_seq_qlen`/`actual_seq_kvlen` the *cumulative ends* as host lists (cu_seqlens[1:]: "2 2 2 → 2 4 6"),
  so a varlen call reads its offsets on the host. `head_num` is q's head count; k/v keep theirs (GQA: Nq/Nkv an
  integer, Nq <= 256).
- `scale` the call's; `keep_prob` = 1 - dropout_p.
- masks: `atten_mask` True = masked out (the opposite of opdispatch's attn_mask). With `atten_mask=None` the op
  ignores sparse_mode, pre_tockens and next_tockens ("固定为全计算"): every pattern passes a mask.
  Causal: sparse_mode 2 (leftUpCausal) or 3 (rightDownCausal) with the compressed 2048x2048 upper-triangular
  mask. A window where the alignment cannot matter (equal lengths): sparse_mode 4 (band) with the compressed
  mask, pre_tockens = left and next_tockens = right (keys before / after the diagonal; INT32_MAX unbounded).
  A window over unequal dense lengths, and any attn_mask: sparse_mode 0 with the explicit mask (the golden
  reads band mode's origin top-left, the reference says bottom-right; the explicit mask needs neither), the
  tockens at their defaults so they bound nothing.
- LSE (dense layouts): softmax_max and softmax_sum are fp32 (B, N, Sq, 8), the row's max of the scaled scores
  and the sum of exp(score - max) (eight equal copies; the golden rebuilds softmax from them the same way), so
  lse = max + log(sum). TND's stats layout changed between releases (`softmax_layout`, added in 7.2.0): no LSE.

Not claimed: softcap (no such argument); ALiBi and additive bias (`pse` is added to q·kᵀ before the scale and
must have q's dtype, so a bias would be divided by the scale and rounded to fp16/bf16); a v head dim above q/k's
(unequal dims are documented only by the newest reference: a narrower v is zero-padded, `pads_v_head_dim`); KV
caches (the inference ops are npu_fused_infer_attention_score and npu_incre_flash_attention); queries that see no
key through the causal/window pattern (the op then turns on its undocumented "invalid row" computation). A row
that only an attn_mask blinds comes back as zeros (LSE -inf), as opdispatch defines it: the op's mask is a large
finite negative, so it would average the values there.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import allowed_positions, pads_v_head_dim, unaccepted_keywords_reason

FUNCTION = "npu_fusion_attention"
KEYWORDS = ("query", "key", "value", "head_num", "input_layout", "atten_mask", "scale", "keep_prob", "pre_tockens",
            "next_tockens", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode")
INT32_MAX = 2147483647  # the op's "unbounded" pre_tockens / next_tockens (its defaults)
COMPRESSED_MASK_SIZE = 2048  # sparse_mode 2/3/4 take this upper-triangular mask, whatever the lengths
INPUT_LAYOUTS = {"bshd": "BSND", "bhsd": "BNSD", "sbhd": "SBH", "thd": "TND"}
MAX_HEADS_Q = 256  # "Nq取值范围1~256"
MAX_VARLEN_BATCH = 1024  # "actual_seq_qlen的长度…varlen场景下长度最大支持1K"
SPARSE_DEFAULT, SPARSE_LEFT_UP_CAUSAL, SPARSE_RIGHT_DOWN_CAUSAL, SPARSE_BAND = 0, 2, 3, 4


class FusionAttentionOptions(BaseModel):
    """Policy knobs of `ascend.fusion_attention`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sync: bool = Field(default=False, description="the op's `sync`: generate the dropout mask synchronously")


@functools.lru_cache(maxsize=8)
def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 upper-triangular bool mask (True = masked) sparse_modes 2, 3 and 4 require."""
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device).triu_(1)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def mask_plan(call: AttentionCall) -> tuple[torch.Tensor | None, int, int, int, torch.Tensor | None]:
    """(atten_mask, sparse_mode, pre_tockens, next_tockens, blind rows or None) for `call` (see the module doc).
    `blind` is (b or 1, h or 1, sq) bool: rows an attn_mask leaves without a key."""
    device = call.q.device
    window = call.window
    offset = call.seqlen_k - call.seqlen_q if call.causal_alignment == "bottom_right" else 0
    if call.attn_mask is not None:  # dense only (validation)
        allowed = _as_4d(call.attn_mask)
        pattern = allowed_positions(call.seqlen_q, call.seqlen_k, call.causal, window, offset, device)
        if pattern is not None:
            allowed = allowed & pattern
        # The op takes BNSS, B1SS, 11SS or SS: a mask broadcast over the batch but not the heads becomes BNSS.
        batch = call.batch if allowed.shape[0] != 1 or allowed.shape[1] != 1 else 1
        allowed = allowed.expand(batch, allowed.shape[1], call.seqlen_q, call.seqlen_k)
        return (~allowed).contiguous(), SPARSE_DEFAULT, INT32_MAX, INT32_MAX, ~allowed.any(-1)
    if not call.causal and window is None:
        return None, SPARSE_DEFAULT, INT32_MAX, INT32_MAX, None
    if window is None:
        mode = SPARSE_RIGHT_DOWN_CAUSAL if call.causal_alignment == "bottom_right" else SPARSE_LEFT_UP_CAUSAL
        return compressed_causal_mask(device), mode, INT32_MAX, 0, None
    left, right = window  # causal made right 0 (validation)
    if not call.alignment_matters:
        return (compressed_causal_mask(device), SPARSE_BAND, INT32_MAX if left < 0 else left,
                INT32_MAX if right < 0 else right, None)
    allowed = allowed_positions(call.seqlen_q, call.seqlen_k, call.causal, window, offset, device)
    return (~allowed).contiguous(), SPARSE_DEFAULT, INT32_MAX, INT32_MAX, None


def resolve_function() -> Any:
    return getattr(importlib.import_module("torch_npu"), FUNCTION)


@pads_v_head_dim
class AscendFusionAttention(AttentionImpl):
    vendor: ClassVar[str] = "ascend"
    name: ClassVar[str] = "fusion_attention"
    priority: ClassVar[int] = 80
    description: ClassVar[str] = ("Huawei Ascend torch_npu.npu_fusion_attention (FlashAttentionScore), with its "
                                  "backward npu_fusion_attention_grad")
    device_types: ClassVar[frozenset[str]] = frozenset({"npu"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"ascend"})
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        module="torch_npu", distribution="torch-npu",
        install_hint=("pip install torch-npu==<your torch version> (Ascend Extension for PyTorch), on a machine "
                      "with the CANN toolkit it was built for; see gitee.com/ascend/pytorch")),)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        # fp32 is documented only by newer references; head dims: every reference allows 16..256 in steps of 16
        # (MindSpore's binding of the same op: multiples of 16 up to 512; op-plugin now: 1..768).
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_min=16, head_dim_max=256,
        head_dim_multiple=16, layouts=frozenset(INPUT_LAYOUTS),
        causal=True, causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True,
        softcap=False, alibi=False, dropout=True, attn_mask=True, attn_bias=False, lse=True, backward=True,
        # the backward's determinism is a global torch_npu switch (enable_deterministic_with_backward), not ours
        deterministic_forward=True, deterministic_backward=False,
    )
    options_model: ClassVar[type[BaseModel]] = FusionAttentionOptions

    # Of a dense call, selection_key reads whether heads_q exceeds MAX_HEADS_Q (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {"heads_q": (MAX_HEADS_Q + 1,)}

    def selection_key(self, call: AttentionCall) -> Any:
        return (call.heads_q > MAX_HEADS_Q, call.varlen and call.batch > MAX_VARLEN_BATCH)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        if call.heads_q > MAX_HEADS_Q:
            reasons.append(f"{call.heads_q} query heads: npu_fusion_attention takes at most {MAX_HEADS_Q}")
        if call.varlen and call.batch > MAX_VARLEN_BATCH:
            reasons.append(f"{call.batch} packed sequences: npu_fusion_attention's actual_seq_qlen takes at most "
                           f"{MAX_VARLEN_BATCH} in TND")
        if call.keyless_rows:
            reasons.append("the causal/window pattern may leave a query without keys: npu_fusion_attention then "
                           "runs its undocumented 'invalid row' computation (opdispatch's answer is zeros, LSE -inf)")
        if call.varlen and call.return_lse:
            reasons.append("return_lse with layout 'thd': TND's softmax_max/softmax_sum layout differs between "
                           "torch_npu releases (softmax_layout, 7.2.0)")
        return reasons

    def extra_availability(self, device: DeviceInfo) -> str | None:
        try:
            fn = resolve_function()
        except Exception as exc:
            return f"torch_npu is installed but has no usable {FUNCTION}: {type(exc).__name__}: {exc}"
        return unaccepted_keywords_reason(fn, KEYWORDS, f"torch_npu.{FUNCTION}")

    def run(self, call: AttentionCall) -> Any:
        fn = resolve_function()
        layout = INPUT_LAYOUTS[call.layout]
        q, k, v = call.q, call.k, call.v
        if layout == "SBH":  # (S, B, N, D) → (S, B, N * D)
            q, k, v = (t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v))
        seq_lens: dict[str, Any] = {}
        if call.varlen:  # cumulative ends as host lists (the op's API)
            seq_lens = dict(actual_seq_qlen=call.cu_seqlens_q[1:].tolist(),
                            actual_seq_kvlen=call.cu_seqlens_k[1:].tolist())
        atten_mask, sparse_mode, pre, nxt, blind = mask_plan(call)
        res = fn(query=q, key=k, value=v, head_num=call.heads_q, input_layout=layout, atten_mask=atten_mask,
                 scale=call.scale, keep_prob=1.0 - call.dropout_p, pre_tockens=pre, next_tockens=nxt,
                 sparse_mode=sparse_mode, sync=self.options.sync, **seq_lens)
        out, softmax_max, softmax_sum = res[0], res[1], res[2]
        if layout == "SBH":
            out = out.reshape(call.seqlen_q, call.batch, call.heads_q, call.head_dim_v)
        lse = None
        if call.return_lse:
            lse = softmax_max[..., 0] + torch.log(softmax_sum[..., 0])
        if blind is not None:
            out = call.from_bhsd(call.bhsd(out).masked_fill(blind.unsqueeze(-1), 0.0))
            if lse is not None:
                lse = lse.masked_fill(blind, float("-inf"))
        return (out, lse) if call.return_lse else out
