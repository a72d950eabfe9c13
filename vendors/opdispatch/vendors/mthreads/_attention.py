"""Moore Threads MUSA attention: torch's own `F.scaled_dot_product_attention` on `musa`, which torch_musa's patched
ATen routes to muDNN's flash kernel, forward and backward.

Sources (MooreThreads/torch_musa, tags v1.2.1 … v2.7.1):

- torch_patches/aten_src_ATen_native_transformers_attention.cpp.patch: on PrivateUse1, `scaled_dot_product_attention`
  calls `_scaled_dot_product_attention_flash_musa(query, key, value, attn_mask, dropout_p, is_causal, scale)` when
  `_fused_sdp_choice` says flash, else its math op. torch_patches/tools_autograd_derivatives.yaml.patch: the flash
  op's derivative is `_scaled_dot_product_attention_flash_musa_backward` — since v1.2.1, whose flash op took no
  `scale` (the call's scale was dropped); v1.3.0 adds `scale`, hence the minimum. (The mudnn README still says
  flash has no backward: written before v1.2.1.)
- torch_musa/csrc/aten/ops/attention/mudnn/SDPUtils.h (`use_flash_attention`): q/k/v of one dtype in {float16,
  bfloat16}, 3-D or 4-D, mp arch >= 2.2 (`check_musa_arch`), head dims q/k <= 128 and v <= 128 (v2.0.0+; also
  160/160 and 192/128 on arch >= 220; v1.3.0: q <= 128 or 160), a mask without grad (v2.0.0+).
- SDP.cpp (`MuDNNFlashSDPAFwd`): `is_causal` and an explicit mask are exclusive; masks 2-D (L, S) / (N, S), 3-D
  or 4-D broadcastable to (N, H_q, L, S), boolean ones read natively (no conversion to -inf); `CheckScale`: with
  a MUSA SDK older than 4.2 an explicit scale other than 1/sqrt(d) raises ("Not support explicit `scale`").
- tests/unittest/operator/test_attention (v2.7.1): flash forward and backward, float16 (bfloat16 backward in
  `test_flash_sdp_dim3_backward`), GQA through `enable_gqa`, equal lengths, causal and *float* masks (the boolean
  mask types 3/4 are not in MASK_TYPES), explicit scale on SDK >= 4.2; "Flash backward doesn't support case with
  head dim not equal to 64 or 128".

What this adapter therefore claims: float16/bfloat16, head dims up to 128 (q = v) forward and 64 or 128 with
gradients; causal as `is_causal` only with equal lengths (muDNN's alignment for unequal ones is untested), every
other pattern and any mask folded into a float mask (the toolkit's
`functional_sdpa_call`: GQA expanded, rows without keys).
The default scale is passed as None (the kernel's own), so only a non-default scale meets `CheckScale`.
Not claimed: dropout (no flash test covers it), varlen, softcap, ALiBi, LSE, KV caches, a bias with grad.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import functional_sdpa_call, pads_v_head_dim


MIN_TORCH_MUSA = "1.3.0"  # the flash op takes `scale` (v1.2.1's backward came with a flash op that dropped it)
MIN_MP_ARCH = 22  # check_musa_arch: (major > 2) || (major == 2 && minor > 1)
BACKWARD_HEAD_DIMS = (64, 128)  # test_flash_sdp_backward: "Flash backward doesn't support ... not equal to 64 or 128"
_MP_ARCH = re.compile(r"mp_?(\d)(\d)$")


def kernel_scale(call: AttentionCall) -> float | None:
    """The scale as passed to F.sdpa: None for the default 1/sqrt(head_dim) (the kernel's own, which CheckScale
    never questions), the call's otherwise."""
    default = 1.0 / math.sqrt(call.head_dim)
    return None if math.isclose(call.scale, default, rel_tol=1e-12, abs_tol=0.0) else call.scale


@pads_v_head_dim
class MthreadsSdpa(AttentionImpl):
    vendor: ClassVar[str] = "mthreads"
    name: ClassVar[str] = "sdpa"
    priority: ClassVar[int] = 80
    description: ClassVar[str] = ("Moore Threads torch_musa's fused F.scaled_dot_product_attention (muDNN flash), "
                                  "forward and backward")
    device_types: ClassVar[frozenset[str]] = frozenset({"musa"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"mthreads"})
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        module="torch_musa", distribution="torch_musa", min_version=MIN_TORCH_MUSA,
        install_hint=(f"pip install torch_musa-<version>-….whl (>= {MIN_TORCH_MUSA}) with the torch wheel of the "
                      "same release, on a machine with the MUSA toolkit; see github.com/MooreThreads/torch_musa")),)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_max=128,
        layouts=frozenset({"bshd", "bhsd", "sbhd"}),
        causal=True, causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True,
        dropout=False, attn_mask=True, attn_bias=True, bias_grad=False, lse=False, backward=True,
        deterministic_forward=True, deterministic_backward=False,
    )

    # selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads only class features (requires_grad, head_dim)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        if call.requires_grad and call.head_dim not in BACKWARD_HEAD_DIMS:
            return [f"head dim {call.head_dim} with gradients: torch_musa's flash backward is tested only for head "
                    f"dims {BACKWARD_HEAD_DIMS} (tests/unittest/operator/test_attention)"]
        return []

    def extra_availability(self, device: DeviceInfo) -> str | None:
        match = _MP_ARCH.match(device.arch or "")
        if match is None or int(match.group(1) + match.group(2)) < MIN_MP_ARCH:
            return (f"arch {device.arch!r}: torch_musa's flash SDPA needs an mp arch >= 2.2 (check_musa_arch, e.g. "
                    "mp22 = MTT S4000); elsewhere F.sdpa takes its math path")
        return None

    def run(self, call: AttentionCall) -> torch.Tensor:
        return functional_sdpa_call(call, torch.nn.functional.scaled_dot_product_attention, kernel_scale(call))
