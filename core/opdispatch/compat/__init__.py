"""Drop-in front doors: the functions people already call, with their exact signatures, dispatched by opdispatch.

- `scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``; `route_sdpa` /
  `unroute_sdpa` / ``with routed_sdpa():`` send a whole program's calls of it through opdispatch.
- `flash_attn`: flash-attn 2.8's public functions (``flash_attn_func``, the varlen and packed variants,
  ``flash_attn_with_kvcache`` with in-place cache append, paged caches and rotary).
- `unpad_input` / `pad_input`: a padding ``attention_mask`` to packed varlen sequences (`cu_seqlens` and the
  indices of the kept tokens) and back.
"""

from . import flash_attn
from ._padding import pad_input, unpad_input
from ._sdpa import SdpaError, route_sdpa, routed_sdpa, scaled_dot_product_attention, torch_sdpa, unroute_sdpa

__all__ = ["SdpaError", "flash_attn", "pad_input", "route_sdpa", "routed_sdpa", "scaled_dot_product_attention",
           "torch_sdpa", "unpad_input", "unroute_sdpa"]
