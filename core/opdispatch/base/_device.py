"""What opdispatch knows about a device: probed from the running process or loaded from a YAML descriptor.

A descriptor lets selection be simulated for hardware this machine does not have: implementations then read
library availability from the descriptor and never import the vendor library.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._errors import DeviceDescriptorError

# The vendors `DeviceInfo.vendor` takes from the built-in probes, and the device types torch knows (a device no
# plugin claims is described with its type as vendor). A policy's `vendor:`/`device_type:` must name one of these
# or an installed plugin (`known_vendors`): a typo such as `nvida` would otherwise never match, silently.
BUILTIN_VENDORS = ("amd", "cpu", "iluvatar", "kunlunxin", "nvidia")
TORCH_DEVICE_TYPES = ("cpu", "cuda", "hpu", "ipu", "lazy", "maia", "meta", "mps", "mtia", "npu", "privateuseone",
                      "ve", "vulkan", "xla", "xpu")


def known_device_types() -> tuple[str, ...]:
    """torch's device types, with the renamed private-use backend of this process (e.g. ``npu``) if any."""
    torch = sys.modules.get("torch")
    renamed = getattr(getattr(torch, "_C", None), "_get_privateuse1_backend_name", None)
    extra = (str(renamed()),) if renamed is not None else ()
    return tuple(sorted({*TORCH_DEVICE_TYPES, *extra}))


def known_vendors(*, plugins: bool = True) -> tuple[str, ...]:
    """Vendor names a device can report: the built-ins, torch's device types and (`plugins`) installed plugins'
    entry-point names — reading those scans every installed distribution, so callers try without first."""
    names = {*BUILTIN_VENDORS, *known_device_types()}
    if plugins:
        import importlib.metadata

        from ._entry_points import ENTRY_POINT_GROUP

        names.update(ep.name.lower() for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return tuple(sorted(names))


_ARCH_RE = re.compile(r"^(sm\d{2,3}[a-z]?|gfx[0-9a-f]{3,4}|[a-z][a-z0-9_.-]*)$")


@dataclass(frozen=True, eq=False)
class DeviceInfo:
    """One device as the selection logic sees it.

    `vendor` is who makes the hardware (``nvidia``, ``amd``, ``iluvatar``, ``kunlunxin``, ``cpu``…), `type` the
    torch device type tensors live on (``cuda``, ``cpu``, ``xpu``…), `arch` a short architecture name
    (``sm90``, ``gfx942``, ``x86_64``), `capability` the (major, minor) compute capability where the vendor has
    one, `libraries` the versions of the libraries implementations depend on (``torch``, ``cudnn``,
    ``flash_attn``, ``flag_gems``…). A library absent from `libraries` of a simulated device is treated as not
    installed.
    """

    vendor: str
    type: str
    arch: str
    name: str
    index: int | None = None
    capability: tuple[int, int] | None = None
    memory_bytes: int | None = None
    multiprocessors: int | None = None
    libraries: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    simulated: bool = False
    source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.libraries, MappingProxyType):
            object.__setattr__(self, "libraries", MappingProxyType(dict(self.libraries)))
        # The key identifies the device in decision caches; computed once because it sits on the hot path.
        key = (self.vendor, self.type, self.index, self.arch, self.capability, self.name, self.simulated,
               tuple(sorted(self.libraries.items())))
        object.__setattr__(self, "key", key)

    key: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceInfo) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def describe(self) -> str:
        cap = f" (capability {self.capability[0]}.{self.capability[1]})" if self.capability else ""
        where = f", simulated from {self.source}" if self.simulated else ""
        return f"{self.vendor} {self.name} [{self.type}, {self.arch}{cap}{where}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "vendor": self.vendor, "type": self.type, "arch": self.arch, "name": self.name,
            "index": self.index, "capability": list(self.capability) if self.capability else None,
            "memory_bytes": self.memory_bytes, "multiprocessors": self.multiprocessors,
            "libraries": dict(self.libraries), "simulated": self.simulated, "source": self.source,
        }


class _DescriptorModel(BaseModel):
    """Schema of a device descriptor YAML file (see configs/devices/)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vendor: str = Field(min_length=1)
    type: str = Field(min_length=1, description="torch device type, e.g. cuda, cpu, xpu")
    arch: str = Field(min_length=1)
    name: str = Field(min_length=1)
    index: int | None = Field(default=0, ge=0)
    capability: tuple[int, int] | None = None
    memory_gib: float | None = Field(default=None, gt=0)
    multiprocessors: int | None = Field(default=None, gt=0)
    libraries: dict[str, str] = Field(default_factory=dict)

    @field_validator("arch")
    @classmethod
    def _arch_is_short_name(cls, value: str) -> str:
        if not _ARCH_RE.match(value):
            raise ValueError(f"arch {value!r} is not a short architecture name such as 'sm90', 'gfx942' or 'x86_64'")
        return value

    @field_validator("libraries", mode="before")
    @classmethod
    def _versions_as_text(cls, value: Any) -> Any:
        # YAML reads `cudnn: 9.1` as a float; versions are text.
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return value


def _shipped_descriptor(path: Path) -> Path:
    if path.exists():
        return path
    from importlib import resources

    shipped = resources.files("opdispatch.configs.devices")
    name = path.name if path.suffix == ".yaml" else f"{path.name}.yaml"
    candidate = Path(str(shipped.joinpath(name)))
    if candidate.exists() and (path.parent == Path(".") or path.parent.parts[-2:] == ("configs", "devices")):
        return candidate
    return path


def _shipped_names() -> list[str]:
    from importlib import resources

    return sorted(p.name.removesuffix(".yaml") for p in resources.files("opdispatch.configs.devices").iterdir()
                  if p.name.endswith(".yaml"))


def load_device_descriptor(path: str | os.PathLike[str]) -> DeviceInfo:
    """Load a simulated device from a YAML descriptor — a path, or the name of a shipped one (``h100``, also
    ``configs/devices/h100.yaml`` where that path does not exist: the descriptors ship inside the package);
    errors name the file and the field."""
    path = _shipped_descriptor(Path(path))
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DeviceDescriptorError(
            f"cannot read device descriptor {str(path)!r}: {exc.strerror}. Pass the path of a YAML file, or the "
            f"name of a shipped one: {', '.join(_shipped_names())}.") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeviceDescriptorError(f"device descriptor {path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise DeviceDescriptorError(
            f"device descriptor {path}: the top level must be a mapping with vendor, type, arch and name, "
            f"got {type(data).__name__}")
    try:
        model = _DescriptorModel.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"field {'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
            for err in exc.errors())
        raise DeviceDescriptorError(f"device descriptor {path}: {problems}") from exc
    return DeviceInfo(
        vendor=model.vendor, type=model.type, arch=model.arch, name=model.name, index=model.index,
        capability=model.capability,
        memory_bytes=int(model.memory_gib * 2**30) if model.memory_gib else None,
        multiprocessors=model.multiprocessors, libraries=model.libraries, simulated=True, source=str(path),
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def probe_cpu() -> DeviceInfo:
    """Describe the host CPU (always available)."""
    import torch

    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch: no capability query
        isa = ""
    name = _cpu_name() + (f" ({isa})" if isa else "")
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    arch = platform.machine().lower() or "cpu"
    return DeviceInfo(vendor="cpu", type="cpu", arch=arch, name=name, index=None, memory_bytes=memory,
                      multiprocessors=os.cpu_count(), libraries={"torch": torch.__version__.split("+")[0]})


def probe_generic(device: Any) -> DeviceInfo:
    """Fallback description of a non-CPU device that no plugin claimed: only what torch itself tells."""
    import torch

    module = getattr(torch, device.type, None)
    name = device.type
    try:
        if module is not None and hasattr(module, "get_device_name"):
            name = module.get_device_name(device.index or 0)
    except Exception:
        pass
    return DeviceInfo(vendor=device.type, type=device.type, arch=device.type, name=name, index=device.index,
                      libraries={"torch": torch.__version__.split("+")[0]})


def resolve_device(device: DeviceInfo | str | os.PathLike[str] | None) -> DeviceInfo | None:
    """A DeviceInfo from a DeviceInfo, a descriptor path, or None (the tensors' own device)."""
    if device is None or isinstance(device, DeviceInfo):
        return device
    return load_device_descriptor(device)
