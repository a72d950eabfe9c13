"""The opdispatch plugin contract: the hooks a plugin may implement. This file is the documentation.

A plugin is any importable object (usually a module) with functions decorated by ``opdispatch.hookimpl``.
Publish it through the ``opdispatch.plugins`` entry-point group in your package's pyproject::

    [project.entry-points."opdispatch.plugins"]
    myvendor = "myvendor_opdispatch.plugin"

The entry-point name is the plugin name that ``OPDISPATCH_PLUGINS`` / ``OPDISPATCH_DISABLE_PLUGINS``, ``opdispatch
doctor`` and error messages use. The built-in vendors are published exactly this way. A plugin owns the vendor
prefixes of the ids it registers: its entry-point name, plus the names a plugin module lists in
``OPDISPATCH_NAMESPACES = ("acme", "acme_npu")``. An implementation in another namespace refuses the plugin's whole
registration (nothing of it stays registered), and the built-in vendors' namespaces (``nvidia``, ``rocm``,
``reference``, ``torch``, …) are theirs alone: a third-party plugin cannot register or displace their ids, whatever
the load order. A plugin module may state the plugin API it was written for, ``OPDISPATCH_PLUGIN_API = 2``
(`PLUGIN_API_VERSION`; missing means the current one, and a registration that then fails names what changed,
`PLUGIN_API_CHANGES`); another is refused with the versions named and, for an older one, what changed since. A
hook function whose name matches no hook below (``opdispatch_impl``) fails the plugin with the name it probably
meant. An import that does not finish in ``OPDISPATCH_PLUGIN_TIMEOUT`` seconds (30) fails its plugin, and dispatch
goes on without it. Every such failure is logged once as a WARNING and shown by ``opdispatch doctor`` and
``explain()``.

Rules every hook follows:

- Import vendor libraries lazily: a hook runs on machines where the vendor's library and hardware are absent
  and must return quickly without importing them (do the import inside ``Impl.run`` or
  ``Impl.extra_availability``).
- Raise only on real bugs. A plugin that raises while loading or inside a hook is recorded with its traceback
  and shown by ``opdispatch doctor`` and ``explain()``; the other plugins keep working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from opdispatch.base._device import DeviceInfo
    from opdispatch.base._impl import Impl

PROJECT_NAME = "opdispatch"
# The plugin contract's version: what a plugin module's OPDISPATCH_PLUGIN_API must equal (when it sets one). It
# grows when a plugin written for the previous version could stop registering or behave differently; what each
# version changed is in PLUGIN_API_CHANGES (a plugin declaring an older version is refused with those changes).
PLUGIN_API_VERSION = 2
PLUGIN_API_CHANGES: dict[int, str] = {
    2: "attention's AttentionCaps.layouts is required (registration refuses an implementation that leaves it "
       "empty: list the layouts run() accepts, e.g. layouts=frozenset({'bshd'})); AttentionCaps.dtypes too",
}

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def opdispatch_impls() -> Sequence[Impl]:
    """Return the implementations this plugin provides, as instances of ``opdispatch.Impl`` subclasses.

    Called once per process when the OpManager initialises. Every implementation is registered whether or not
    its library or device is present here: availability is asked per device later, so ``opdispatch list`` can
    show why an implementation cannot run. Each id (``"<vendor>.<name>"``) must be unique across all plugins;
    a duplicate is refused with both origins named.
    """
    raise NotImplementedError  # a specification: pluggy never calls it


@hookspec(firstresult=True)
def opdispatch_probe_device(device: torch.device) -> DeviceInfo | None:
    """Describe ``device`` if this plugin's vendor owns it, else return None.

    Called once per torch device in the process. Return None fast, without importing heavy libraries, when the
    device is not your vendor's (several vendors share the ``cuda`` device type: NVIDIA, ROCm, Iluvatar,
    KunLunXin). The first non-None answer wins; CPU is described by opdispatch itself.
    """
