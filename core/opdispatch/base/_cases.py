"""Tuning cases, shared by the ops that declare them and every layer that reads them: an op's tuning description
(`OpSpec.tuning`, a `TuningSpec`), its presets, cases loaded from YAML, and the helpers an op's spec builds its
cases with (`grid`, `known_fields`, `random_tensor`). Measuring them is the tools' job
(core/opdispatch/tools/_tuning.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from ._ops import TuningSpec, op_spec, tunable_ops

__all__ = ["ALL", "TuningCase", "grid", "known_fields", "load_cases", "preset", "preset_names", "random_tensor",
           "tuning_of"]

ALL = "all"  # the preset of every preset of an op


class TuningCase(Protocol):
    """What `TuningSpec.case` instances provide (see `TuningSpec`)."""

    @property
    def requires_grad(self) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...

    def describe(self) -> str: ...

    def inputs(self, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]: ...

    def flops(self) -> float: ...


def tuning_of(op: str) -> TuningSpec:
    """The tuning description of `op`; ValueError naming the ops that have one."""
    tuning = op_spec(op).tuning
    if tuning is None:
        raise ValueError(f"op {op!r} cannot be tuned (its OpSpec has no tuning description); ops that can: "
                         f"{', '.join(tunable_ops())}")
    return tuning


def preset_names(op: str) -> tuple[str, ...]:
    return (*tuning_of(op).presets, ALL)


def preset(name: str, device_type: str = "cuda", op: str = "attention") -> list[Any]:
    """The cases of one of `op`'s presets (``all``: every preset's, in order) for a device type."""
    tuning = tuning_of(op)
    if name == ALL:
        return [case for part in tuning.presets for case in tuning.preset(part, device_type)]
    if name not in tuning.presets:
        raise ValueError(f"unknown preset {name!r} for op {op!r}; allowed: {', '.join(preset_names(op))}")
    return tuning.preset(name, device_type)


def load_cases(path: str | os.PathLike[str], op: str = "attention") -> list[Any]:
    """Cases of `op` from YAML: a list of mappings of its case fields, or ``{shapes: [...]}``."""
    case_type: Any = tuning_of(op).case
    text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        fields = ", ".join(getattr(case_type, "__dataclass_fields__", {}))
        raise ValueError(f"{path}: expected a list of {op} shapes (mappings of {case_type.__name__} fields: {fields}), "
                         "or a mapping with a `shapes:` list")
    return [case_type.from_dict(item, where=f"{path}: entry {i}: ") for i, item in enumerate(data)]


# -- building cases --------------------------------------------------------------------------------------------

def grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, as keyword dicts (the first axis varies slowest)."""
    rows: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        rows = [{**row, key: value} for row in rows for value in values]
    return rows


def known_fields(case_type: type, data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """A copy of `data` for building a `case_type` dataclass; ValueError naming unknown fields and the allowed ones."""
    known = set(getattr(case_type, "__dataclass_fields__", {}))
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{where}shape has unknown field(s) {sorted(unknown)}; allowed: {sorted(known)}")
    return dict(data)


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device, generator: torch.Generator | None,
                  requires_grad: bool = False) -> torch.Tensor:
    """Standard-normal values drawn in float32 then cast (so every dtype sees one distribution); no data on meta."""
    if device.type == "meta":
        return torch.empty(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    gen = generator if generator is not None and generator.device.type == device.type else None
    t = torch.randn(*shape, generator=gen, dtype=torch.float32, device=device).to(dtype)
    return t.requires_grad_(requires_grad)
