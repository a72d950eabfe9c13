"""Packed q/k/v layouts: one tensor holding q, k and v (or k and v), as fused projections produce them.

Names follow TransformerEngine's ``qkv_layout`` (flash-attn's packed functions use three of them): a base layout
(``bshd``, ``sbhd``, ``thd``) with the packing dimension written in, ``3`` for q/k/v and ``2`` for k/v:

- ``bs3hd``, ``bsh3d``, ``sb3hd``, ``sbh3d``, ``t3hd``, ``th3d``: one tensor holds q, k and v;
- ``bshd_bs2hd``, ``bshd_bsh2d``, ``sbhd_sb2hd``, ``sbhd_sbh2d``, ``thd_t2hd``, ``thd_th2d``: q, then one tensor
  holding k and v (k/v may have fewer heads than q).

`packed_views` splits them into views of the base layout with ``unbind`` (no copy: each view keeps the head dim
unit-stride, so kernels that take strided inputs read the packed memory directly, and autograd writes the three
gradients into one packed gradient). `attention_packed` calls `opdispatch.attention` on those views.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from ..ops._attention import ATTENTION_ARGS, DENSE_LAYOUTS

_BASES = (*DENSE_LAYOUTS, "thd")


class PackedLayout(NamedTuple):
    """A packed layout: the base layout of the views, the packed tensor's dim holding them, and how many."""

    base: str
    dim: int
    tensors: int  # 3: q, k, v; 2: k, v (q is a tensor of its own)


# The packing dim right after the sequence dims, or after the heads (TransformerEngine's set).
PACKED_LAYOUTS: dict[str, PackedLayout] = {}
for _base in _BASES:
    _seq_dims = 1 if _base == "thd" else 2
    for _dim in (_seq_dims, _seq_dims + 1):
        for _count in (3, 2):
            _packed = _base[:_dim] + str(_count) + _base[_dim:]
            _name = _packed if _count == 3 else f"{_base}_{_packed}"
            if _base != "bhsd":  # heads before the sequence: no fused projection produces it
                PACKED_LAYOUTS[_name] = PackedLayout(_base, _dim, _count)


def packed_views(layout: str, packed: torch.Tensor, kv: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(q, k, v, base layout): views of a packed layout's tensors (see the module doc), no copies.

    ``packed_views("bs3hd", qkv)`` for q/k/v in one tensor; ``packed_views("bshd_bs2hd", q, kv)`` for k/v in one.
    ValueError naming the layout, the tensor, its shape and what is expected otherwise.
    """
    spec = PACKED_LAYOUTS.get(layout) if isinstance(layout, str) else None
    if spec is None:
        raise ValueError(f"packed layout {layout!r} is not known; allowed: {', '.join(PACKED_LAYOUTS)} (plain "
                         f"layouts {', '.join(_BASES)} take q, k, v as separate tensors: call opdispatch.attention)")
    rank = len(spec.base) + 1
    if spec.tensors == 3:
        if kv is not None:
            raise ValueError(f"packed layout {layout!r} holds q, k and v in one tensor: pass it alone (got a second "
                             f"tensor of shape {tuple(kv.shape)}; for k/v packed apart from q use "
                             f"'{spec.base}_{spec.base[:spec.dim]}2{spec.base[spec.dim:]}')")
        q, k, v = _unbind(layout, "qkv", packed, spec, rank)
        return q, k, v, spec.base
    if kv is None:
        raise ValueError(f"packed layout {layout!r} takes q and a tensor holding k and v: "
                         f"attention_packed(q, kv, layout={layout!r})")
    if not isinstance(packed, torch.Tensor) or packed.dim() != len(spec.base):
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"packed layout {layout!r}: q must be a {len(spec.base)}-D {spec.base} tensor, got {shape}")
    k, v = _unbind(layout, "kv", kv, spec, rank)
    return packed, k, v, spec.base


def _unbind(layout: str, what: str, t: Any, spec: PackedLayout, rank: int) -> tuple[torch.Tensor, ...]:
    if not isinstance(t, torch.Tensor) or t.dim() != rank:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"packed layout {layout!r}: {what} must be a {rank}-D tensor "
                         f"({_dims(layout, spec)}), got {shape}")
    if t.shape[spec.dim] != spec.tensors:
        raise ValueError(f"packed layout {layout!r}: {what} has {t.shape[spec.dim]} entries in dim {spec.dim} (shape "
                         f"{tuple(t.shape)}), where it packs {spec.tensors} tensors ({_dims(layout, spec)})")
    return t.unbind(spec.dim)


def _dims(layout: str, spec: PackedLayout) -> str:
    packed = layout.split("_")[-1]
    return ", ".join(spec.base[:spec.dim]) + f", {spec.tensors}, " + ", ".join(packed[spec.dim + 1:])


def attention_packed(qkv_or_q: torch.Tensor, kv: torch.Tensor | None = None, *, layout: str,
                     **kwargs: Any) -> Any:
    """`opdispatch.attention` over a packed layout: ``attention_packed(qkv, layout="bs3hd", causal=True)`` or
    ``attention_packed(q, kv, layout="thd_t2hd", cu_seqlens_q=..., ...)``. Every other keyword is attention's;
    the output is in the base layout (``bshd`` for ``bs3hd``), as attention returns it."""
    from ._api import attention

    q, k, v, base = packed_views(layout, qkv_or_q, kv)
    return attention(q, k, v, layout=base, **kwargs)


# Its signature: the packed tensors and layout, then attention's own keywords (what **kwargs forwards), from
# attention's argument definition — so help(), IDEs and the typing stub (`opdispatch.tools._stubs`) list them.
attention_packed.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("qkv_or_q", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="torch.Tensor"),
     inspect.Parameter("kv", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                       annotation="torch.Tensor | None"),
     inspect.Parameter("layout", inspect.Parameter.KEYWORD_ONLY, annotation="str"),
     *ATTENTION_ARGS.signature(drop=("q", "k", "v", "layout")).parameters.values()],
    return_annotation="torch.Tensor | tuple[torch.Tensor, torch.Tensor]")
attention_packed.__opdispatch_arguments__ = ATTENTION_ARGS  # type: ignore[attr-defined]
