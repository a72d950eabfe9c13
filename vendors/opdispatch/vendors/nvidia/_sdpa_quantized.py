"""`nvidia.sdpa_quantized`: torch's FP8 attention, `torch.nn.attention.experimental.
_scaled_dot_product_attention_quantized` (torch >= 2.13), which runs only where FlashAttention-3 is activated in
torch's SDPA (`torch.nn.attention.activate_flash_attention_impl("FA3")`, which needs FA3's `flash_attn_interface`).

What it takes, as torch 2.13 and FA3 define it (torch/nn/attention/experimental/_scaled_dot_product_attention_
quantized.py, torch/nn/attention/_fa3.py, flash-attention hopper/flash_api.cpp):
- q/k/v float8_e4m3fn, (batch, heads, seq, dim) — the other dense layouts go as views (the kernel reads strides;
  torch allocates the output with q's memory order, so the result is a view back with no copy);
- descales float32 of shape (batch, heads_kv) only (`DescaleType.PER_HEAD`, the one type torch defines; q's
  too, broadcast over each kv head's query group): a per-tensor factor goes as a stride-0 view of itself there;
- output bfloat16 only (torch allocates it so; FA3: "For FP8 input, output must have dtype BF16"), no LSE, no
  FP8 output or amax; forward only ("FA3 backward does not support fp8");
- `is_causal` goes straight to FA3, whose causal mask is bottom-right where seqlen_q != seqlen_k (flash_api.cpp
  sets window_size_right = 0 from the last query's row), not SDPA's top-left; rows with no key give zeros;
- GQA/MQA (FA3: heads_kv divides heads_q); head dims a multiple of 16 up to 256 for e4m3, v's equal to q's
  (torch allocates the output with q's head dim, so FA3's output shape check refuses a different v head dim);
- sm90 only (`_fa3_common_support_error`: "FA3 requires compute capability 9.0"); no dropout, window, softcap,
  mask, bias, ALiBi, varlen or KV cache (the function has no such argument).
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import at_least

from ._attention import _fa3_descales

QUANTIZED_MODULE = "torch.nn.attention.experimental._scaled_dot_product_attention_quantized"
QUANTIZED_FUNCTION = "_scaled_dot_product_attention_quantized"
# The torch release that added the function (a simulated device declares its torch version only).
QUANTIZED_SINCE = "2.13.0"
# A simulated device declares FA3 activated in torch's SDPA with this key under `libraries:` (its value: the
# flash_attn_3 version torch registered); a real device is asked through torch's registry.
ACTIVATED_KEY = "torch_fa3"
ACTIVATE_HINT = ("activate FA3 in torch's SDPA before the first FP8 call: "
                 "torch.nn.attention.activate_flash_attention_impl(\"FA3\") (it imports FA3's flash_attn_interface: "
                 "build flash-attention's hopper/ package), or afterwards call opdispatch.get_manager().clear_cache() "
                 "so availability is asked again")


def fa3_active() -> bool:
    """Whether torch's flash-attention registry has FA3 activated now (torch >= 2.13)."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current is not None and current() == "FA3"


def quantized_function() -> Any:
    """torch's `_scaled_dot_product_attention_quantized`, or None where this torch has none."""
    try:
        module = importlib.import_module(QUANTIZED_MODULE)
    except ImportError:
        return None
    return getattr(module, QUANTIZED_FUNCTION, None)


class _QuantizedSdpaRequirement(Requirement):
    """torch's quantized SDPA with FA3 activated: on a simulated device, torch >= 2.13 and `torch_fa3` declared;
    on a real one, the function present and torch's registry reporting FA3 active."""

    def describe(self) -> str:
        return f"torch>={QUANTIZED_SINCE} with FA3 activated (torch.nn.attention.activate_flash_attention_impl)"

    def unmet_reason(self, device: DeviceInfo) -> str | None:
        if device.simulated:
            version = device.libraries.get("torch")
            if version is None or not at_least(version, QUANTIZED_SINCE):
                return (f"torch {version or '(not declared)'} in the device descriptor {device.source} has no "
                        f"{QUANTIZED_MODULE}.{QUANTIZED_FUNCTION} (added in torch {QUANTIZED_SINCE}); declare "
                        f"`torch: \"{QUANTIZED_SINCE}\"` under `libraries:` to simulate it")
            if device.libraries.get(ACTIVATED_KEY) is None:
                return (f"FA3 is not activated in torch's SDPA (the device descriptor {device.source} declares no "
                        f"`{ACTIVATED_KEY}:` under libraries; add `{ACTIVATED_KEY}: <flash_attn_3 version>` to "
                        f"simulate it); on the device, {ACTIVATE_HINT}")
            return None
        if quantized_function() is None:
            return (f"torch {torch.__version__} has no {QUANTIZED_MODULE}.{QUANTIZED_FUNCTION} (added in torch "
                    f"{QUANTIZED_SINCE}); upgrade with: pip install 'torch>={QUANTIZED_SINCE}'")
        if not fa3_active():
            return f"FA3 is not activated in torch's SDPA; {ACTIVATE_HINT}"
        return None


class QuantizedSdpa(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "sdpa_quantized"
    priority: ClassVar[int] = 44   # after nvidia.flash_attn3 (45), the same kernel called directly
    description: ClassVar[str] = ("torch's FP8 SDPA (torch.nn.attention.experimental."
                                  "_scaled_dot_product_attention_quantized) over FA3 activated in torch, on Hopper")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    # torch's FA3 wrapper: "FA3 requires compute capability 9.0" (device major 9; sm90 is the one such arch)
    min_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    requires = (_QuantizedSdpaRequirement(module="torch", distribution="torch", key=ACTIVATED_KEY,
                                          min_version=QUANTIZED_SINCE, install_hint=ACTIVATE_HINT),)
    # The module docstring says where each field comes from. No extra_reasons: the caps say it all.
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float8_e4m3fn}), fp8_out_dtypes=frozenset({torch.bfloat16}),
        fp8_descale_per_head=True, head_dim_min=16, head_dim_max=256, head_dim_multiple=16,
        layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"bottom_right"}),
        gqa=True, deterministic_forward=True,
    )

    def run(self, call: AttentionCall) -> torch.Tensor:
        # Availability is cached per device: FA3 restored since then would route the op to torch's FA2, which
        # takes no FP8. Say so instead (the op's fallback then moves the call on).
        if not fa3_active():
            raise RuntimeError(f"nvidia.sdpa_quantized: FA3 is no longer activated in torch's SDPA; {ACTIVATE_HINT}")
        from torch.nn.attention.experimental import _scaled_dot_product_attention_quantized as quantized

        descales = _fa3_descales(call)  # every FP8 call has all three (the op checks)
        out = quantized._scaled_dot_product_attention_quantized(
            call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v), is_causal=call.causal, scale=call.scale,
            q_descale=descales["q_descale"], k_descale=descales["k_descale"], v_descale=descales["v_descale"])
        return call.from_bhsd(out)
