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

- ``backends/nvidia/driver.py`` `CudaLauncher.__call__` (lines 700-714): allocates the global and profile scratch
  only for a size > 0 (else None) and calls its C ``launch(gridX, gridY, gridZ, stream, function,
  launch_cooperative_grid, launch_pdl, global_scratch, profile_scratch, *args)``: a kernel whose scratch sizes are
  0 (read at capture) is launched by that C call directly, with the flags read from its launcher; any other
  launcher is called as `JITFunction.run` calls it.
- ``backends/nvidia/driver.py`` the generated launcher's ``getPointer`` (lines 388-429): a pointer parameter (parsed
  as an object, ``format_of``) that is an int is taken as the device address as it is; a tensor costs a
  ``data_ptr()`` call and the driver's ``cuPointerGetAttribute``. `DirectKernel.launch_direct` passes the device
  tensors of a call as ints (their ``data_ptr()``: the same address for memory of the current device).
- ``backends/driver.py`` `GPUDriver`: ``get_current_device`` is ``torch.cuda.current_device`` (its lazy init done,
  then ``torch._C._cuda_getDevice``: the C getter is called), ``get_current_stream`` the C
  ``_cuda_getCurrentRawStream``; ``runtime/driver.py`` `DriverConfig.active` a property returning ``_active``.
  `stream_for` checks these once per decode step for all its launches: the current device must be the one the
  call's tensors are on (Triton launches on the current device); a jit launch while another device is current
  runs under a guard for the tensors' device.

Anything else unexpected — another current device or driver, a pre-run hook, launch hooks set, the debug or
instrumentation knob changed, a kernel that is not a plain `CompiledKernel`, an error from the direct launch
(raised before the kernel is queued) — launches through the jit function (a launch error also drops the captured
kernel for good): never a wrong launch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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


class _Gate:
    """What every direct launch relies on beyond its own kernel, as captured with the first kernel: Triton's
    active driver, the options in its cache key, how it reads the current device and stream."""

    __slots__ = ("drivers", "active", "knobs", "runtime", "compilation", "debug", "instrumentation", "get_device",
                 "get_stream")

    def __init__(self, drivers: Any, knobs: Any) -> None:
        self.drivers, self.active, self.knobs = drivers, drivers.active, knobs
        self.runtime, self.compilation = knobs.runtime, knobs.compilation
        self.debug, self.instrumentation = knobs.runtime.debug, knobs.compilation.instrumentation_mode
        get_device = self.active.get_current_device
        # `torch.cuda.current_device` is `_lazy_init()` (done: a kernel ran) then the C getter: the getter alone.
        self.get_device = (torch._C._cuda_getDevice if get_device is getattr(torch.cuda, "current_device", None)
                           and hasattr(torch._C, "_cuda_getDevice") else get_device)
        self.get_stream = self.active.get_current_stream  # `torch._C._cuda_getCurrentRawStream` (C)


_gate: _Gate | None = None  # set at the first capture


def _current_device() -> int:
    return torch.cuda.current_device()


def _on_device(index: int) -> Any:
    """A guard making CUDA device `index` current while it is held."""
    return torch.cuda.device(index)


def stream_for(index: int | None) -> int | None:
    """The current stream of CUDA device `index` (where a call's tensors are) as Triton's launcher takes it, when
    a captured kernel may be launched directly now: `index` is the current device (Triton launches on the current
    one), and the driver, launch hooks and cache-key options are those of the capture. None otherwise (launch
    through the jit function: `DirectKernel.launch`). One check per decode step serves each of its launches."""
    gate = _gate
    if gate is None or index is None or gate.get_device() != index:
        return None
    runtime, compilation = gate.runtime, gate.compilation
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # (`_active`: `DriverConfig.active` is a property that returns it once set, as the capture did.)
    if (getattr(gate.drivers, "_active", None) is not gate.active or runtime.debug != gate.debug
            or compilation.instrumentation_mode != gate.instrumentation
            or (enter is not None and (type(enter).__name__ != "HookChain" or enter.calls))
            or (leave is not None and (type(leave).__name__ != "HookChain" or leave.calls))):
        return None
    stream: int = gate.get_stream(index)
    return stream


def stream_again(stream: int | None, index: int | None) -> int | None:
    """`stream` — what `stream_for(index)` gave a call's first launches — for a later launch of the same call,
    where `index` is still the current device (the work in between ran on that stream, through torch's device
    guards, which restore the current device; Triton's driver, hooks and options are not changed by it): a
    device look-up instead of `stream_for`'s whole check. None (the jit launch) otherwise."""
    gate = _gate
    if stream is None or gate is None or gate.get_device() != index:
        return None
    return stream


class DirectKernel:
    """``launch(grid, args, key, index, stream)``: the jit kernel `jit` launched on `grid` (a 3-tuple) with `args`,
    every parameter in declaration order (constexprs included), on CUDA device `index` (where the call's tensors
    are; None: the CPU interpreter); `key` holds the ints among them that may change between calls (everything
    else must be fixed for this instance: pointer dtypes, the other ints, the constexprs); `stream` is
    `stream_for(index)`. One instance per (call signature, device): its first call, one with another key, or
    one where `stream` is None goes through `jit`."""

    __slots__ = ("jit", "n_params", "tried", "jit_launches", "kernel", "device", "key", "call", "prefix")

    def __init__(self, jit: Any) -> None:
        self.jit = jit
        self.n_params = len(getattr(jit, "arg_names", ()))
        self.tried = False  # whether the first jit launch was looked at (a kernel is captured once, at most)
        self.jit_launches = 0  # launches through `jit` (the GPU tests check that later steps launch directly)
        self.kernel: Any = None  # the captured CompiledKernel (None: launch through `jit`)
        # What a capture keeps (`_capture`): the device and key it holds for, what is called and the arguments
        # that come before the kernel's own.
        self.device: Any = None
        self.key: Any = None
        self.call: Any = None
        self.prefix: tuple[Any, ...] = ()

    def launch_direct(self, grid: tuple[int, int, int], args: tuple[Any, ...], key: tuple[Any, ...],
                      index: int | None, stream: int | None) -> bool:
        """The direct launch alone, with `args` as `launch` takes them except that device tensors may be passed as
        their ``data_ptr()``: the launcher takes an int pointer as it is, where for a tensor it calls
        ``data_ptr()`` and asks the driver (``cuPointerGetAttribute``) for the pointer's device address — the same
        address for memory of the current CUDA device (unified addressing), which is what the caller passes (a
        signature's tensors are on device `index`, the current one whenever `stream` is not None). False, with
        nothing queued, where `launch` would not launch directly (or the launch raised before queuing): the caller
        then calls `launch` with the tensors."""
        if stream is None or key != self.key or self.kernel is None or index != self.device \
                or self.jit.pre_run_hooks:
            return False
        try:
            self.call(grid[0], grid[1], grid[2], stream, *self.prefix, *args)
        except Exception:  # raised before the kernel was queued: the jit launch takes it, from now on
            self.kernel = None
            return False
        return True

    def launch(self, grid: tuple[int, int, int], args: tuple[Any, ...], key: tuple[Any, ...], index: int | None,
               stream: int | None) -> None:
        if stream is not None and key == self.key and self.kernel is not None and index == self.device \
                and not self.jit.pre_run_hooks:
            try:
                self.call(grid[0], grid[1], grid[2], stream, *self.prefix, *args)
                return
            except Exception:  # raised before the kernel was queued: the jit launch takes it, from now on
                self.kernel = None
        if index is not None and _current_device() != index:
            with _on_device(index):  # Triton launches on the current device: make it the tensors' one
                kernel = self.jit[grid](*args)
        else:
            kernel = self.jit[grid](*args)
        self.jit_launches += 1
        if not self.tried:
            self.tried = True
            self._capture(kernel, args, key)

    def _capture(self, kernel: Any, args: tuple[Any, ...], key: tuple[Any, ...]) -> None:
        """Keep `kernel` (what the jit launch of `args` returned) when everything this path relies on holds."""
        global _gate
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
            gate = _gate if _gate is not None and _gate.drivers is drivers else _Gate(drivers, knobs)
            if (gate.active is not drivers.active or gate.debug != knobs.runtime.debug
                    or gate.instrumentation != knobs.compilation.instrumentation_mode):
                return  # captured under other options than the first kernel: the jit launch only
            device = gate.get_device()
        except Exception:  # an attribute this Triton does not have: keep the jit launch
            return
        if not callable(launcher) or function is None:
            return
        call = launcher
        prefix: tuple[Any, ...] = (function, packed, None, None, None)
        # `CudaLauncher.__call__` (backends/nvidia/driver.py lines 700-714) allocates the global and profile
        # scratch — None where the kernel needs none — and calls the C `launch` with the cooperative-grid and PDL
        # flags, the two scratch pointers, then what it was given: the same call, minus the Python frame.
        if (type(launcher).__name__ == "CudaLauncher" and getattr(launcher, "global_scratch_size", None) == 0
                and getattr(launcher, "profile_scratch_size", None) == 0 and callable(getattr(launcher, "launch",
                                                                                             None))):
            call = launcher.launch
            prefix = (function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, packed, None, None,
                      None)
        _gate = gate
        self.device, self.key, self.call, self.prefix, self.kernel = device, key, call, prefix, kernel
