"""Drop-in front doors: the functions people already call, with their exact signatures, dispatched by opdispatch.

- `scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``; `route_sdpa` /
  `unroute_sdpa` / ``with routed_sdpa():`` send a whole program's calls of it through opdispatch.
- `unpad_input` / `pad_input`: a padding ``attention_mask`` to packed varlen sequences (`cu_seqlens` and the
  indices of the kept tokens) and back.
"""

from ._padding import pad_input, unpad_input
from ._sdpa import SdpaError, route_sdpa, routed_sdpa, scaled_dot_product_attention, torch_sdpa, unroute_sdpa

__all__ = ["SdpaError", "pad_input", "route_sdpa", "routed_sdpa", "scaled_dot_product_attention", "torch_sdpa",
           "unpad_input", "unroute_sdpa"]
