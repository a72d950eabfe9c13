"""A Triton kernel launched without `JITFunction.run`'s per-call work once its first call compiled it (issue 31).

`JITFunction.run` costs ~60 µs of host time per launch on an H100 host — the binder, the specialization of every
argument, the cache key, the compiled kernel's `launch_metadata` — of which the launch itself
(`__triton_launcher.launch`) is ~15 µs (benchmarks/results/h100-43848a0/kvcache_decode-paged0-h100-profile.txt).
A decode step launches the same kernel with the same specialization every time, so `DirectKernel` launches the
first call through the jit function, keeps the `CompiledKernel` it returned, and launches later calls the way
`JITFunction.run` itself does, minus what cannot change between them.

What this relies on, Triton 3.6.0 exactly (`TESTED_TRITON`; any other version keeps the jit launch):

- ``triton/runtime/jit.py`` `JITFunction.run` (lines 695-746): returns the kernel it launched, after
  ``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
  knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())`` — every parameter in
  declaration order, constexprs included (the launcher parses them as objects and drops them:
  ``backends/nvidia/driver.py`` `make_launcher`, ``format_of`` / ``internal_args_list``, lines 186-241), with
  ``device = driver.active.get_current_device()`` and ``stream = driver.active.get_current_stream(device)``
  (lines 700-701). The cache key is the specialization of each argument plus the options (``debug`` from
  ``knobs.runtime.debug``, ``instrumentation_mode``) per device: the same values launch the same kernel.
- ``triton/compiler/compiler.py`` `CompiledKernel` (lines 404-500): ``run`` the launcher (a property, lines
  474-477), ``function`` and ``packed_metadata``; ``launch_metadata(...)`` (lines 479-488) only feeds the launch
  hooks, which this path requires empty (``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``, HookChains
  with no ``calls``: ``triton/knobs.py`` lines 406-424, 468-469) — so it passes None for the metadata and the
  hooks, which the launcher then skips (``if (launch_enter_hook != Py_None)``).
- Specialization (``create_function_from_signature``, jit.py lines 394-440): the kernels of
  `core.compat._kv_append_triton` mark every pointer ``do_not_specialize_on_alignment``, so a pointer
  specializes only on its dtype (keyed by the caller's signature); ints specialize on their value (1, multiples of
  16, i32 or i64): the caller passes the ints that may change between calls as `key`, and a call whose key
  differs from the captured call's is launched through the jit function.

Anything else unexpected — another current device or driver, a pre-run hook, launch hooks set, the debug or
instrumentation knob changed, a kernel that is not a plain `CompiledKernel`, an error from the direct launch
(raised before the kernel is queued) — launches through the jit function (a launch error also drops the captured
kernel for good): never a wrong launch.
"""

from __future__ import annotations

import functools
from typing import Any

TESTED_TRITON = "3.6.0"


@functools.cache
def _supported() -> Any:
    """Triton's (driver, knobs) where its version is the tested one, else None (the jit launch only)."""
    try:
        import triton
        from triton import knobs
        from triton.runtime import driver
    except ImportError:
        return None
    if getattr(triton, "__version__", None) != TESTED_TRITON:
        return None
    return driver, knobs


def _hooks_empty(knobs: Any) -> bool:
    """Whether no launch hook is set (a HookChain without calls, or None)."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (type(hook).__name__ != "HookChain" or hook.calls):
            return False
    return True


class DirectKernel:
    """``launch(grid, args, key)``: the jit kernel `jit` launched on `grid` (a 3-tuple) with `args`, every
    parameter in declaration order (constexprs included); `key` holds the ints among them that may change between
    calls (everything else must be fixed for this instance: pointer dtypes, the other ints, the constexprs). One
    instance per (call signature, device): its first call, or one with another key, goes through `jit`."""

    __slots__ = ("jit", "n_params", "tried", "jit_launches", "kernel", "launcher", "function", "packed", "device",
                 "key", "debug", "drivers", "active", "get_device", "get_stream", "knobs")

    def __init__(self, jit: Any) -> None:
        self.jit = jit
        self.n_params = len(getattr(jit, "arg_names", ()))
        self.tried = False  # whether the first jit launch was looked at (a kernel is captured once, at most)
        self.jit_launches = 0  # launches through `jit` (the GPU tests check that later steps launch directly)
        self.kernel: Any = None  # the captured CompiledKernel (None: launch through `jit`)
        # What a capture keeps (`_capture`): the launcher and its arguments, the device, key and options it holds
        # for, and where Triton's driver and knobs are read.
        self.launcher: Any = None
        self.function: Any = None
        self.packed: Any = None
        self.device: Any = None
        self.key: Any = None
        self.debug: Any = None
        self.drivers: Any = None
        self.active: Any = None
        self.get_device: Any = None
        self.get_stream: Any = None
        self.knobs: Any = None

    def launch(self, grid: tuple[int, int, int], args: tuple[Any, ...], key: tuple[Any, ...]) -> None:
        if self.kernel is not None and key == self.key:
            knobs = self.knobs
            device = self.get_device()
            if (device == self.device and self.drivers.active is self.active and not self.jit.pre_run_hooks
                    and (knobs.runtime.debug, knobs.compilation.instrumentation_mode) == self.debug
                    and _hooks_empty(knobs)):
                try:
                    self.launcher(grid[0], grid[1], grid[2], self.get_stream(device), self.function,
                                  self.packed, None, None, None, *args)
                    return
                except Exception:  # raised before the kernel was queued: the jit launch takes it, from now on
                    self.kernel = None
        kernel = self.jit[grid](*args)
        self.jit_launches += 1
        if not self.tried:
            self.tried = True
            self._capture(kernel, args, key)

    def _capture(self, kernel: Any, args: tuple[Any, ...], key: tuple[Any, ...]) -> None:
        """Keep `kernel` (what the jit launch of `args` returned) when everything this path relies on holds."""
        supported = _supported()
        if supported is None or type(kernel).__name__ != "CompiledKernel" or hasattr(kernel, "result"):
            return  # another Triton, the interpreter (no CompiledKernel), or an asynchronous compile
        drivers, knobs = supported
        jit = self.jit
        if (len(args) != self.n_params or jit.pre_run_hooks or getattr(jit, "used_global_vals", None)
                or not _hooks_empty(knobs)):
            return
        try:
            launcher, function, packed = kernel.run, kernel.function, kernel.packed_metadata
            active = drivers.active
            get_device, get_stream = active.get_current_device, active.get_current_stream
            device = get_device()
        except Exception:  # an attribute this Triton does not have: keep the jit launch
            return
        if not callable(launcher) or function is None:
            return
        self.drivers, self.active, self.get_device, self.get_stream = drivers, active, get_device, get_stream
        self.knobs, self.device, self.key = knobs, device, key
        self.debug = (knobs.runtime.debug, knobs.compilation.instrumentation_mode)  # the options in the cache key
        self.launcher, self.function, self.packed, self.kernel = launcher, function, packed, kernel
