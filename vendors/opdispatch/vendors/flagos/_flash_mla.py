"""`flagos.flash_mla`: FlagGems' paged MLA decode kernel (absorbed MLA, DeepSeek's 576/512), forward only.

``flag_gems.flash_mla(q, block_table, blocked_k, max_seqlen_pad, block_size, b, s_q, cache_seqlens, h_q, h_kv, d,
dv, causal)`` as FlagGems 5.0.2 defines it (src/flag_gems/fused/flash_mla.py; _cambricon, _kunlunxin and _metax
carry their own copies with other tile choices, which `runtime.replace_customized_ops` puts at the top-level name,
so it is taken from there). What it does, read from that source, and what this adapter therefore requires:
- q ``(b, s_q, h_q, d)`` is viewed ``(-1, h_q, d)`` and its grid covers ``q.shape[0]`` rows: one query per
  sequence (seqlen_q 1), or rows past the batch are never written.
- The cache is ``blocked_k.view([-1, d])``, slot ``block_table[b, i // block_size] * block_size + i % block_size``:
  one KV head (the MLA latent; a second head would be read as further slots), pages of adjacent rows.
- V is read from the same rows: their first ``dv`` columns (``offs_d_ckv = tl.arange(0, HEAD_DIM_V)`` for both the
  scores and the values). A separate v cache is never read, so v must be exactly ``k[..., :dv]`` of the same
  storage.
- ``sm_scale = 1 / math.sqrt(d)`` always; ``assert causal``, and with one query the query is the last position,
  so it sees its sequence's first ``cache_seqlens[b]`` keys: bottom-right causal, the same as non-causal there.
  No LSE, no autograd; int32 ``block_table``/``cache_seqlens`` (its test), offsets in int32 (a pool of 2**31
  elements or more would wrap).
- ``assert d > dv``; ``tl.arange(HEAD_DIM_V, HEAD_DIM)`` needs a power-of-two rope width; FlagGems tests
  ``d=576, dv=512, h_kv=1, s_q=1``, bf16 only (tests/test_flash_mla.py), which is what is claimed here.
- An empty sequence (cache_seqlens 0) divides 0 by 0: its rows are set to zeros here, as opdispatch answers.
- Tiles by ``get_device_capability()`` major: 9 (BLOCK_H 64, 3 stages), 8 (32, 2), 7 on Iluvatar, 3 on Moore
  Threads; else ``error.backend_not_support``. _kunlunxin and _metax take 9/8 only, _cambricon any Cambricon
  device. _hygon lists flash_mla in op_black_list.yaml ("RuntimeError") and its test skips Hygon; _ascend has none
  (the generic kernel's capability majors are CUDA-style). On AMD, ROCm reports gfx90a/gfx942 as major 9, which
  would pick the Hopper tiles: one 64 × 576 bf16 key tile (72 KiB) alone exceeds the 64 KiB LDS of MI250X/MI300X
  (inferred from the tile sizes, not run), and FlagGems has no AMD copy or test of its own, so AMD is refused.
- NVIDIA: declared (capability 8/9, as the source). The default order does not name it, so it takes the '*'
  place, after every named kernel (nvidia.mem_efficient takes paged MLA on NVIDIA) and before reference.math: not
  yet run on a GPU by this project, NVIDIA keeps its choice.
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo

from ._attention import FLAG_GEMS, GEMS_VENDORS, gems_vendor_mismatch

# The head dims FlagGems' test runs (d, dv): DeepSeek's absorbed MLA (512 latent + 64 rope).
MLA_HEAD_DIMS = (576, 512)
# Capability majors at which each vendor's flash_mla picks tiles (5.0.2; None: any device of that vendor).
TILE_MAJORS: dict[str, frozenset[int] | None] = {
    "nvidia": frozenset({8, 9}), "iluvatar": frozenset({7}), "mthreads": frozenset({3}),
    "kunlunxin": frozenset({8, 9}), "metax": frozenset({8, 9}), "cambricon": None,
}
NO_KERNEL: dict[str, str] = {
    "hygon": ("FlagGems 5.0.2 black-lists flash_mla on Hygon (runtime/backend/_hygon/op_black_list.yaml: "
              "'RuntimeError') and skips its test there"),
    "ascend": ("FlagGems 5.0.2's _ascend backend has no flash_mla, and the generic kernel picks tiles only for "
               "CUDA-style capability majors 9/8 (7 Iluvatar, 3 Moore Threads)"),
    "amd": ("FlagGems 5.0.2 has no AMD flash_mla and does not test it there: the generic kernel would take "
            "ROCm's capability major 9 for Hopper's tiles (BLOCK_H 64, BLOCK_N 64, 3 stages), whose 64 x 576 bf16 "
            "key tile alone (72 KiB, inferred, not run) exceeds the 64 KiB LDS of gfx90a/gfx942"),
}
_INT32_LIMIT = 2 ** 31


def v_is_k_prefix(call: AttentionCall) -> bool:
    """Whether v is exactly the first head_dim_v columns of k: same storage, offset, strides, shape[:-1]."""
    k, v = call.k, call.v
    if v.dtype != k.dtype or v.device != k.device or v.stride() != k.stride():
        return False
    if tuple(v.shape) != tuple(k.shape[:-1]) + (call.head_dim_v,) or v.storage_offset() != k.storage_offset():
        return False
    if k.device.type != "meta" and v.data_ptr() != k.data_ptr():
        return False
    # The same storage object: `Tensor.is_set_to` has no meta kernel (explain runs on meta tensors), and meta
    # tensors' data_ptr() is 0 for all.
    return bool(v.untyped_storage()._cdata == k.untyped_storage()._cdata)


def as_float32(x: float) -> float:
    """`x` rounded to float32: the kernel is handed its scale as a float32 argument."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def scale_is_kernels(call: AttentionCall) -> bool:
    """Whether the call's scale is the one flash_mla applies (``sm_scale = 1 / math.sqrt(d)``), as float32."""
    return as_float32(call.scale) == as_float32(1 / math.sqrt(call.head_dim))


class FlagGemsFlashMLA(AttentionImpl):
    vendor: ClassVar[str] = "flagos"
    name: ClassVar[str] = "flash_mla"
    priority: ClassVar[int] = 24
    description: ClassVar[str] = ("FlagGems (FlagOS) flash_mla: paged absorbed-MLA decode (q/k 576, v = k[..., :512], "
                                  "one KV head, one query per sequence), forward only")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda", "musa", "mlu", "npu"})
    device_vendors: ClassVar[frozenset[str]] = frozenset(GEMS_VENDORS)
    requires = (FLAG_GEMS,)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.bfloat16}), head_dim_min=MLA_HEAD_DIMS[0], head_dim_max=MLA_HEAD_DIMS[0],
        head_dim_v_differs=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True,
        causal_alignments=frozenset({"bottom_right"}), gqa=True, kv_cache=True, paged_kv=True,
        deterministic_forward=True,
    )

    def device_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = super().device_reasons(device)
        if reasons:
            return reasons
        vendor = GEMS_VENDORS.get(device.vendor, device.vendor)
        if vendor in NO_KERNEL:
            return [NO_KERNEL[vendor]]
        majors = TILE_MAJORS.get(vendor)
        if majors is not None and (device.capability is None or device.capability[0] not in majors):
            have = "none" if device.capability is None else "%d.%d" % device.capability
            reasons.append(f"FlagGems 5.0.2's flash_mla picks tiles on {vendor} only at compute capability major "
                           f"{' or '.join(map(str, sorted(majors)))} (else error.backend_not_support); the device "
                           f"reports {have}")
        return reasons

    def extra_availability(self, device: DeviceInfo) -> str | None:
        mismatch = gems_vendor_mismatch(device)
        if mismatch:
            return mismatch
        import flag_gems

        if not callable(getattr(flag_gems, "flash_mla", None)):
            return "flag_gems has no flash_mla (added in FlagGems 5.0)"
        return None

    # A dense call (no paged cache) is refused whatever its sizes (extra_reasons), so its key is one constant and
    # reads no size: the class of a dense decode keeps its size box on devices with FlagGems (the compiled door's
    # size-generic entries; on the H100 this key alone kept every growing decode on the Python path).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        if not call.paged:
            return None
        return (call.seqlen_q == 1, v_is_k_prefix(call), scale_is_kernels(call),
                call.k.is_contiguous(), call.k.numel() < _INT32_LIMIT, call.heads_kv == 1)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        if not call.paged:
            reasons.append("needs a paged KV cache (block_table and seqused_k): flash_mla reads keys only through "
                           "its block_table")
            return reasons
        if call.seqlen_q != 1:
            reasons.append(f"seqlen_q {call.seqlen_q}: flash_mla's grid covers one query per sequence (decode only)")
        if call.head_dim_v != MLA_HEAD_DIMS[1]:
            reasons.append(f"v head_dim {call.head_dim_v}: flash_mla is claimed for q/k {MLA_HEAD_DIMS[0]} with v "
                           f"{MLA_HEAD_DIMS[1]} only (FlagGems' tests/test_flash_mla.py)")
        if call.heads_kv != 1:
            reasons.append(f"heads_kv {call.heads_kv}: flash_mla reads one latent KV head (blocked_k.view(-1, d)); "
                           "a second head would be read as further cache slots")
        if not v_is_k_prefix(call):
            reasons.append(f"v is not k[..., :{call.head_dim_v}] of the same storage: flash_mla reads V from the "
                           "k cache's first dv columns and never reads a separate v (pass v = k[..., :dv])")
        if not scale_is_kernels(call):
            reasons.append(f"scale {call.scale!r}: flash_mla always uses 1/sqrt({call.head_dim}) = "
                           f"{1 / math.sqrt(call.head_dim)!r}")
        if call.causal and call.causal_alignment != "bottom_right":
            reasons.append("causal with causal_alignment='top_left' over a KV cache: flash_mla's one query is the "
                           "sequence's last position (bottom-right)")
        if not call.k.is_contiguous():
            reasons.append(f"k page pool with strides {tuple(call.k.stride())} is not contiguous: flash_mla views it "
                           "as (-1, d) rows")
        if call.k.numel() >= _INT32_LIMIT:
            reasons.append(f"k page pool of {call.k.numel()} elements: flash_mla's offsets are int32 (< 2**31)")
        return reasons

    def run(self, call: AttentionCall) -> Any:
        import flag_gems

        if not v_is_k_prefix(call):  # selection checked it; never let a separate v go unread
            raise ValueError("flagos.flash_mla: v must be k[..., :dv] of the same storage (flash_mla reads V from k)")
        q = call.bshd(call.q).contiguous()
        batch, pages = call.block_table.shape
        page_size = call.page_size
        used = call.seqused_k
        assert used is not None
        with _current_device(q.device):
            out = flag_gems.flash_mla(q, call.block_table, call.k, pages * page_size, page_size, batch, 1, used,
                                      call.heads_q, call.heads_kv, call.head_dim, call.head_dim_v, True)
        # 0/0 for a sequence without keys: opdispatch's answer is zeros (computed on the device, no sync)
        out = out.masked_fill((used == 0).view(batch, 1, 1, 1), 0.0)
        return call.from_bshd(out)


def _current_device(device: torch.device) -> Any:
    """`device` made current: flash_mla allocates its output on FlagGems' default device (``device.name``)."""
    if device.index is None or device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).device(device.index)


__all__ = ["FlagGemsFlashMLA", "MLA_HEAD_DIMS", "v_is_k_prefix"]
