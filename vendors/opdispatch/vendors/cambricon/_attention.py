"""Cambricon MLU attention: torch's own `F.scaled_dot_product_attention` on `mlu`, which torch_mlu routes to its
CNNL flash or memory-efficient kernels, forward and backward.

Sources (Cambricon/torch_mlu, release branch r1.22_pt2.4.0 = torch_mlu 1.22.0, the earliest public release, and
the development branch r2.4_develop):

- codegen/mlu_functions.yaml: torch_mlu registers `scaled_dot_product_attention(query, key, value, attn_mask=None,
  dropout_p=0.0, is_causal=False, *, scale=None)` (custom autograd) and the flash / efficient forward and backward
  ops behind it (torch_mlu/csrc/aten/operators/cnnl/transformers/attention.cpp: flash for no mask, efficient with
  `preprocess_mask` expanding a mask to (B, H, Sq, Sk); math otherwise).
- transformers/sdp_utils.cpp and sdp_utils.h: which backend `_fused_sdp_choice` picks. Both fused kernels: 4-D
  inputs, q/k/v of one dtype in {float16, bfloat16}, **equal batch and head counts** (no GQA), last-dim stride 1,
  no empty sequence; head dims (1.22.0, `check_head_dim_size_flash` / `_mem_efficient`): q == k, 64 <= d <= 256,
  d % 8 == 0 (flash: v's too; efficient: v 64..256, multiple of 8) — develop relaxes this to 1..256; flash: no
  attn_mask, is_causal only when seqlen_q == seqlen_k; efficient's causal is CausalFromTopLeft.
  `check_fused_kernel_mlu_support` (1.22.0): the device's major version 5 (MLU500 series; develop adds 6),
  B * H * ceil(Sk / 256) > 12, and Sq * Sk / (ceil_512(Sq) * ceil_256(Sk)) >= 0.6 (develop also accepts long
  unmasked calls) — otherwise F.sdpa silently takes torch_mlu's unfused math path. This adapter claims only calls
  that pass the 1.22.0 checks, so what it is chosen for runs fused on every release.
- test/torch_ops/test_scaled_dot_product_attention.py: flash and efficient forward and backward against a float
  reference for float16 and bfloat16, head dims 128/256, dropout 0/0.22/0.48, explicit scale, causal (flash),
  masks (efficient).
- the efficient backward warns "attn_mask does not support gradient calculation in backward" and returns an
  unfilled gradient: a bias with grad is not claimed.

How the call is passed (GQA expanded, masks folded, rows without keys): the toolkit's
`functional_sdpa_call`.
Not claimed:
varlen (F.sdpa has no packed entry), softcap, ALiBi, LSE (F.sdpa returns none), KV caches, a v head dim above
q/k's (flash needs them equal: a narrower v is zero-padded to q/k's, `pads_v_head_dim`).
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import functional_sdpa_call, pads_v_head_dim


MIN_TORCH_MLU = "1.22.0"  # the earliest public release (r1.22_pt2.1.0 / 2.3.0 / 2.4.0); its checks are mirrored
_MLU500_ARCH = re.compile(r"mlu5\d\d$")  # check_fused_kernel_mlu_support: `(*prop).major != 5` -> unfused
MIN_SPLIT = 12  # "Both fused kernels require split condition greater than 12"
MIN_VALID_RATIO = 0.6  # "Both fused kernels require valid data ratio greater than or equal 0.6"


def _ceiling(number: int, significance: int) -> int:
    return math.ceil(number / significance) * significance


def fused_gate(batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> str | None:
    """torch_mlu 1.22.0's size checks (`check_fused_kernel_mlu_support`) on the call torch_mlu sees (heads: q's,
    k/v expanded to them): why F.sdpa would take the unfused math path, or None."""
    split = batch * heads * math.ceil(seqlen_k / 256)
    if not split > MIN_SPLIT:
        return (f"batch * heads * ceil(seqlen_k / 256) = {split}: torch_mlu's fused SDPA kernels need more than "
                f"{MIN_SPLIT} (check_fused_kernel_mlu_support), F.sdpa would run its unfused math path")
    if seqlen_q == 0 or seqlen_k == 0:
        return "an empty sequence: torch_mlu's fused SDPA kernels refuse zero lengths (math path)"
    ratio = seqlen_q * seqlen_k / (_ceiling(seqlen_q, 512) * _ceiling(seqlen_k, 256))
    if not ratio >= MIN_VALID_RATIO:
        return (f"seqlen_q * seqlen_k / (ceil_512(seqlen_q) * ceil_256(seqlen_k)) = {ratio:.3f}: torch_mlu's fused "
                f"SDPA kernels need >= {MIN_VALID_RATIO} (check_fused_kernel_mlu_support), F.sdpa would run its "
                "unfused math path")
    return None


@pads_v_head_dim
class CambriconSdpa(AttentionImpl):
    vendor: ClassVar[str] = "cambricon"
    name: ClassVar[str] = "sdpa"
    priority: ClassVar[int] = 80
    description: ClassVar[str] = ("Cambricon torch_mlu's fused F.scaled_dot_product_attention (CNNL flash / "
                                  "memory-efficient), forward and backward")
    device_types: ClassVar[frozenset[str]] = frozenset({"mlu"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"cambricon"})
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        module="torch_mlu", distribution="torch_mlu", min_version=MIN_TORCH_MLU,
        install_hint=(f"pip install torch_mlu-<version>+torch<your torch>-….whl (>= {MIN_TORCH_MLU}) from "
                      "Cambricon's release for your CNToolkit/CNNL, or its PyTorch container; see "
                      "github.com/Cambricon/torch_mlu")),)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_min=64, head_dim_max=256, head_dim_multiple=8,
        layouts=frozenset({"bshd", "bhsd", "sbhd"}),
        # is_causal with equal lengths; otherwise the pattern goes in as a mask (either alignment, exactly)
        causal=True, causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True,
        dropout=True, attn_mask=True, attn_bias=True, bias_grad=False, lse=False, backward=True,
        deterministic_forward=True, deterministic_backward=False,
    )

    def selection_key(self, call: AttentionCall) -> Any:
        return fused_gate(call.batch, call.heads_q, call.seqlen_q, call.seqlen_k) is None

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reason = fused_gate(call.batch, call.heads_q, call.seqlen_q, call.seqlen_k)
        return [reason] if reason else []

    def extra_availability(self, device: DeviceInfo) -> str | None:
        if not _MLU500_ARCH.match(device.arch or ""):
            return (f"arch {device.arch!r}: torch_mlu's fused SDPA kernels run on the MLU500 series only "
                    "(check_fused_kernel_mlu_support); elsewhere F.sdpa takes its unfused math path")
        return None

    def run(self, call: AttentionCall) -> torch.Tensor:
        # a call with a mask reaches the efficient kernel, the rest flash: both fused (see the module doc)
        return functional_sdpa_call(call, torch.nn.functional.scaled_dot_product_attention, call.scale)
