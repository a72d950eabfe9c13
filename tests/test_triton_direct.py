"""core.compat._triton_direct: a Triton kernel launched through its CompiledKernel after its first jit launch
(issue 31). Against a fake CompiledKernel whose ``run`` has Triton 3.6's launcher signature and records what it
was given: the arguments a direct launch passes, and every fallback to the jit launch. The installed Triton's
own `JITFunction.run` is read to check that the fake's calling convention is the one Triton uses."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="the direct launch is Triton's")
from triton.knobs import HookChain  # noqa: E402

from opdispatch.compat import _kv_append, _triton_direct  # noqa: E402
from opdispatch.compat._triton_direct import DirectKernel  # noqa: E402

PARAMS = ["x_ptr", "y_ptr", "n", "stride", "BLOCK"]


class CudaLauncher:
    """Triton 3.6's CudaLauncher (backends/nvidia/driver.py): ``__call__`` allocates the scratch buffers (None
    where their size is 0) and calls the C ``launch`` with the cooperative-grid and PDL flags and the scratch
    pointers before the rest; both record what they were given."""

    def __init__(self, launches: list, scratch: int = 0) -> None:
        self.launches = launches
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch, profile_scratch,
               packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *args):
        self.launches.append(("direct", (gridX, gridY, gridZ), stream, function, cooperative, pdl, global_scratch,
                              profile_scratch, packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook,
                              args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = object() if self.global_scratch_size else None  # (Triton's allocator's buffer)
        self.launches.append(("launcher",))
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, scratch,
                    None, *args)


class CompiledKernel:
    """Triton 3.6's CompiledKernel as JITFunction.run uses it: ``run`` (a property: the launcher), ``function``,
    ``packed_metadata``, ``launch_metadata``."""

    def __init__(self, launches: list, scratch: int = 0) -> None:
        self.function = 0xF00D
        self.packed_metadata = (4, 1, 0)  # num_warps, num_ctas, shared
        self.launches = launches
        self.launcher = CudaLauncher(launches, scratch)

    @property
    def run(self):
        return self.launcher

    def launch_metadata(self, grid, stream, *args):
        return None


class Jit:
    """A JITFunction: ``jit[grid](*args)`` launches (recorded, with the current device) and returns its
    CompiledKernel."""

    def __init__(self, driver, kernel_factory=None) -> None:
        self.arg_names = list(PARAMS)
        self.pre_run_hooks: list = []
        self.used_global_vals: dict = {}
        self.launches: list = []
        self.driver = driver
        self.kernel = (kernel_factory or CompiledKernel)(self.launches)

    def __getitem__(self, grid):
        def runner(*args):
            self.launches.append(("jit", grid, args, self.driver.active.device))
            return self.kernel
        return runner


class Driver:
    def __init__(self) -> None:
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


class Drivers:
    """Triton's DriverConfig: ``active`` a property returning ``_active``."""

    def __init__(self) -> None:
        self._active = Driver()

    @property
    def active(self):
        return self._active


@pytest.fixture
def fake_triton(monkeypatch):
    """The tested Triton as `_supported` returns it: a driver config and knobs of our own; a CUDA device guard
    that sets the fake driver's current device."""
    drivers = Drivers()
    knobs = types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain(reversed=True),
                                      debug=False),
        compilation=types.SimpleNamespace(instrumentation_mode=""))
    monkeypatch.setattr(_triton_direct, "_supported", lambda: (drivers, knobs))
    monkeypatch.setattr(_triton_direct, "_gate", None)

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.before, drivers.active.device = drivers.active.device, self.index

        def __exit__(self, *exc):
            drivers.active.device = self.before

    monkeypatch.setattr(_triton_direct, "_current_device", lambda: drivers.active.device)
    monkeypatch.setattr(_triton_direct, "_on_device", Guard)
    return drivers, knobs


def args(n=64, stride=3):
    return ("x", "y", n, stride, 128)


def kinds(jit):
    return [launch[0] for launch in jit.launches]


def go(direct, grid, given, key, index=0):
    """One launch as FusedAppend makes it: the stream checked for the tensors' device first."""
    direct.launch(grid, given, key, index, _triton_direct.stream_for(index))


def test_the_first_call_goes_through_the_jit_and_later_ones_pass_what_the_launcher_passes(fake_triton):
    drivers, _ = fake_triton
    jit = Jit(drivers)
    direct = DirectKernel(jit)
    for _ in range(3):
        go(direct, (5, 2, 1), args(), (3,))
    assert kinds(jit) == ["jit", "direct", "direct"] and direct.jit_launches == 1
    assert jit.launches[0] == ("jit", (5, 2, 1), args(), 0)
    # JITFunction.run: kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
    # launch_metadata, enter_hook, exit_hook, *bound_args.values()) — None for the metadata and the empty hooks —
    # and CudaLauncher.__call__ passes that to its C launch with its flags and no scratch (size 0): what the
    # direct launch passes the C launch itself.
    assert jit.launches[1] == ("direct", (5, 2, 1), 1000, 0xF00D, False, True, None, None, (4, 1, 0), None, None,
                               None, args())


def test_a_kernel_with_scratch_is_launched_through_its_launcher(fake_triton):
    """Global scratch (allocated per launch by CudaLauncher.__call__): the launcher's own call, not its C launch."""
    drivers, _ = fake_triton
    jit = Jit(drivers, lambda launches: CompiledKernel(launches, scratch=256))
    direct = DirectKernel(jit)
    for _ in range(2):
        go(direct, (5, 2, 1), args(), (3,))
    assert kinds(jit) == ["jit", "launcher", "direct"] and direct.jit_launches == 1
    assert jit.launches[2][6] is not None  # the launcher's scratch buffer


def test_a_call_with_another_key_is_launched_through_the_jit(fake_triton):
    drivers, _ = fake_triton
    jit = Jit(drivers)
    direct = DirectKernel(jit)
    go(direct, (1, 1, 1), args(stride=3), (3,))
    go(direct, (1, 1, 1), args(stride=16), (16,))  # another specialization: the jit picks its kernel
    go(direct, (1, 1, 1), args(stride=3), (3,))
    assert kinds(jit) == ["jit", "jit", "direct"]


@pytest.mark.parametrize("change", ["device", "driver", "pre_run_hook", "enter_hook", "exit_hook", "debug",
                                    "instrumentation", "hook_function"])
def test_anything_the_capture_relied_on_changing_sends_the_call_through_the_jit(fake_triton, change):
    drivers, knobs = fake_triton
    jit = Jit(drivers)
    direct = DirectKernel(jit)
    go(direct, (1, 1, 1), args(), (3,))
    undo = {
        "device": lambda: setattr(drivers.active, "device", 1),
        "driver": lambda: setattr(drivers, "_active", Driver()),
        "pre_run_hook": lambda: jit.pre_run_hooks.append(print),
        "enter_hook": lambda: knobs.runtime.launch_enter_hook.add(print),
        "exit_hook": lambda: knobs.runtime.launch_exit_hook.add(print),
        "debug": lambda: setattr(knobs.runtime, "debug", True),
        "instrumentation": lambda: setattr(knobs.compilation, "instrumentation_mode", "consan"),
        "hook_function": lambda: setattr(knobs.runtime, "launch_enter_hook", print),
    }[change]
    undo()
    go(direct, (1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "jit"]


def test_a_call_while_another_device_is_current_launches_on_the_tensors_device(fake_triton):
    """Triton launches on the current device: with cuda:1 current and the tensors on cuda:0, the jit launch runs
    under a guard for cuda:0 (and the current device is cuda:1 again after it)."""
    drivers, _ = fake_triton
    jit = Jit(drivers)
    direct = DirectKernel(jit)
    go(direct, (1, 1, 1), args(), (3,))
    drivers.active.device = 1
    go(direct, (1, 1, 1), args(), (3,))
    assert [launch[-1] for launch in jit.launches] == [0, 0] and kinds(jit) == ["jit", "jit"]
    assert drivers.active.device == 1
    drivers.active.device = 0
    go(direct, (1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "jit", "direct"]


def test_a_failing_direct_launch_is_launched_through_the_jit_and_the_kernel_dropped(fake_triton):
    class Broken(CudaLauncher):
        def launch(self, *a):
            self.launches.append(("direct-failed",))
            raise TypeError("an argument the launcher cannot parse")

    Broken.__name__ = "CudaLauncher"  # what a capture checks

    def broken(launches):
        kernel = CompiledKernel(launches)
        kernel.launcher = Broken(launches)
        return kernel

    drivers, _ = fake_triton
    jit = Jit(drivers, broken)
    direct = DirectKernel(jit)
    for _ in range(3):
        go(direct, (1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "direct-failed", "jit", "jit"]


@pytest.mark.parametrize("case", ["interpreter", "future", "arity", "globals", "hooks", "other_triton"])
def test_a_kernel_this_path_cannot_vouch_for_is_never_launched_directly(fake_triton, monkeypatch, case):
    drivers, knobs = fake_triton
    jit = Jit(drivers)
    if case == "interpreter":
        jit.kernel = None  # Triton's interpreter returns no CompiledKernel
    elif case == "future":
        jit.kernel.result = lambda: jit.kernel  # an asynchronous compile's future
    elif case == "arity":
        jit.arg_names.append("EXTRA")
    elif case == "globals":
        jit.used_global_vals = {("G", 0): (1, {})}
    elif case == "hooks":
        knobs.runtime.launch_enter_hook.add(print)
    else:
        monkeypatch.setattr(_triton_direct, "_supported", lambda: None)
    direct = DirectKernel(jit)
    for _ in range(3):
        go(direct, (1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "jit", "jit"]


def test_cpu_tensors_never_launch_directly(fake_triton):
    """The interpreter's calls (index None): no stream, no guard, the jit launch."""
    drivers, _ = fake_triton
    jit = Jit(drivers)
    direct = DirectKernel(jit)
    for _ in range(2):
        go(direct, (1, 1, 1), args(), (3,), index=None)
    assert kinds(jit) == ["jit", "jit"]


def test_only_the_tested_triton_is_supported(monkeypatch):
    _triton_direct._supported.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.7.0")
        assert _triton_direct._supported() is None
        _triton_direct._supported.cache_clear()
        monkeypatch.setattr(triton, "__version__", _triton_direct.TESTED_TRITON)
        drivers, knobs = _triton_direct._supported()
        assert type(drivers).__name__ == "DriverConfig" and hasattr(knobs.runtime, "launch_enter_hook")
    finally:
        _triton_direct._supported.cache_clear()


@pytest.mark.skipif(triton.__version__ != _triton_direct.TESTED_TRITON, reason="reads Triton 3.6.0's sources")
def test_the_installed_triton_launches_as_the_fake_does():
    """The calling convention the fake mirrors, read from the installed Triton's JITFunction.run and
    CompiledKernel, and its launch hooks' type."""
    from triton.compiler.compiler import CompiledKernel as Real
    from triton.runtime.jit import JITFunction

    run = " ".join(inspect.getsource(JITFunction.run).split())
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())") in run
    assert "return kernel" in run
    assert isinstance(Real.__dict__["run"], property)
    # CudaLauncher.__call__: scratch allocated only for a size > 0 (else None), then the C launch with the flags.
    from triton.backends.driver import GPUDriver
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.driver import DriverConfig

    call = " ".join(inspect.getsource(CudaLauncher.__call__).split())
    assert "if size > 0:" in call and "return None" in call
    assert ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
            "global_scratch, profile_scratch, *args)") in call
    assert "def __call__(self, gridX, gridY, gridZ, stream, function, *args):" in call
    # The current device and stream as the gate reads them, and the active driver's property.
    init = " ".join(inspect.getsource(GPUDriver.__init__).split())
    assert "self.get_current_device = torch.cuda.current_device" in init
    assert "self.get_current_stream = _cuda_getCurrentRawStream" in init
    active = " ".join(inspect.getsource(DriverConfig.active.fget).split())
    assert "return self._active" in active
    current = " ".join(inspect.getsource(torch.cuda.current_device).split())
    assert "_lazy_init() return torch._C._cuda_getDevice()" in current
    assert type(triton.knobs.runtime.launch_enter_hook).__name__ == "HookChain"
    assert not triton.knobs.runtime.launch_enter_hook.calls and not triton.knobs.runtime.launch_exit_hook.calls


@pytest.mark.parametrize("single", [True, False], ids=["one_kernel", "two_kernels"])
@pytest.mark.parametrize("layout", ["dense", "rows", "paged"])
def test_the_fused_append_passes_every_parameter_in_declaration_order(monkeypatch, layout, single):
    """FusedAppend's argument tuples bind to the real kernels' parameters by position, constexprs included, with
    the values they name; the key is the strides (the ints that may change between calls). The direct launch's
    tuple is the same, each tensor but the report row (the launcher checks a device can address its pinned host
    memory) passed as its data_ptr()."""
    seen, direct, given_to = {}, {}, {}

    class Recording:
        def __init__(self, name, jit):
            self.name, self.jit = name, jit

        def launch_direct(self, grid, given, key, index, stream):
            direct[self.name] = (grid, given, key)
            return False  # not launched: the caller then calls `launch` with the tensors

        def launch(self, grid, given, key, index, stream):
            assert index is None and stream is None  # CPU tensors
            seen[self.name] = (grid, inspect.signature(self.jit.fn).bind(*given).arguments, key)
            given_to[self.name] = given

    def pointers_for_tensors(report):
        """Each kernel's direct tuple: its launch tuple with the tensors but `report` as their addresses."""
        assert set(direct) == set(given_to)
        for name, (grid, given, key) in direct.items():
            assert (grid, key) == (seen[name][0], seen[name][2]) and len(given) == len(given_to[name])
            for passed, tensor_or_value in zip(given, given_to[name], strict=True):
                if isinstance(tensor_or_value, torch.Tensor) and tensor_or_value is not report:
                    assert type(passed) is int and passed == tensor_or_value.data_ptr()
                else:
                    assert passed is tensor_or_value

    monkeypatch.setattr(_kv_append, "DirectKernel", lambda jit: Recording(jit.__name__, jit))
    batch, new, heads_k, dim, page, width = 3, 2, 2, 8, 4, 5
    has_rows, paged = layout == "rows", layout == "paged"
    fused = _kv_append.FusedAppend(batch, new, width if paged else 0, page, 7, page * (width if paged else 1),
                                   has_rows, paged, heads_k, dim, torch.device("cpu"))
    assert fused.single
    fused.single = single
    lens = torch.zeros(batch, dtype=torch.int32)
    rows = torch.arange(batch, dtype=torch.int32) if has_rows else None
    table = torch.zeros(batch, width, dtype=torch.int32) if paged else None
    k, v = torch.zeros(batch, new, heads_k, dim), torch.zeros(batch, new, heads_k, 2 * dim)[..., :dim]
    k_cache, v_cache = torch.zeros(7, page, heads_k, dim), torch.zeros(7, page, heads_k, dim)
    report = torch.zeros(fused.report_width, dtype=torch.int32)
    scratch = fused.scratch(torch.device("cpu"))
    fused(lens, rows, table, k, v, k_cache, v_cache, report, scratch, None)
    if single:
        grid, bound, key = seen["verdict_append"]
        assert grid == (batch * new, 1, 1) and bound["lens_ptr"] is lens and bound["batch"] == batch
        assert bound["report_ptr"] is report and bound["bad_ptr"] is scratch.bad and bound["new"] == new
        assert bound["verdict_ptr"] is scratch.verdict and bound["lens_out_ptr"] is scratch.lens_out
        assert bound["safe_ptr"] is (scratch.safe if layout != "dense" else scratch.lens_out)
        assert bound["rows_ptr"] is (rows if has_rows else lens) and bound["table_ptr"] is (table if paged else lens)
        assert bound["k_ptr"] is k and bound["v_ptr"] is v and bound["k_cache_ptr"] is k_cache
        assert bound["v_cache_ptr"] is v_cache and bound["max_len"] == fused.max_len
        assert (bound["table_stride_b"], bound["table_stride_w"]) == (table.stride() if paged else (0, 0))
        assert (bound["v_sb"], bound["v_st"], bound["v_sh"], bound["v_sd"]) == v.stride()
        assert (bound["vc_sr"], bound["vc_sp"], bound["vc_sh"], bound["vc_sd"]) == v_cache.stride()
        assert key == ((*table.stride(),) if paged else (0, 0)) + (*k.stride(), *v.stride(), *k_cache.stride(),
                                                                    *v_cache.stride())
        assert bound["heads_dim"] == heads_k * dim and bound["dim"] == dim and bound["BLOCK"] == 16
        assert bound["HAS_ROWS"] is has_rows and bound["PAGED"] is paged and bound["page"] == page
        assert bound["W_BLOCKS"] == -(-fused.width // bound["BLOCK_W"]) and bound["width"] == fused.width
        assert bound["cache_rows"] == 7 and list(seen) == ["verdict_append"]
        pointers_for_tensors(report)
        out = torch.zeros(batch, new, 3, dim)
        assert fused.poison(scratch, out, None)  # the NaN kernel: its output and the verdict as addresses too
        grid, bound, key = seen["poison"]
        assert bound["out_ptr"] is out and bound["verdict_ptr"] is scratch.verdict and key == (out.dtype, None)
        pointers_for_tensors(report)
        return
    grid, bound, key = seen["verdict"]
    assert grid == (1, 1, 1) and bound["lens_ptr"] is lens and bound["batch"] == batch and bound["new"] == new
    assert bound["report_ptr"] is report and bound["bad_ptr"] is scratch.bad
    assert bound["verdict_ptr"] is scratch.verdict and bound["lens_out_ptr"] is scratch.lens_out
    assert bound["safe_ptr"] is (scratch.safe if layout != "dense" else scratch.lens_out)
    assert bound["HAS_ROWS"] is has_rows and bound["PAGED"] is paged and bound["max_len"] == fused.max_len
    assert (bound["table_stride_b"], bound["table_stride_w"]) == key == (table.stride() if paged else (0, 0))
    assert bound["W_BLOCKS"] == -(-fused.width // bound["BLOCK_W"])
    grid, bound, key = seen["append"]
    assert grid == (batch * new, 1, 1) and bound["k_ptr"] is k and bound["v_cache_ptr"] is v_cache
    assert bound["verdict_ptr"] is scratch.verdict and bound["lens_out_ptr"] is scratch.lens_out
    assert (bound["v_sb"], bound["v_st"], bound["v_sh"], bound["v_sd"]) == v.stride()
    assert key == (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride())
    assert bound["heads_dim"] == heads_k * dim and bound["BLOCK"] == 16 and bound["PAGED"] is paged
    pointers_for_tensors(report)


def test_launch_direct_launches_only_the_captured_kernel_and_else_queues_nothing(fake_triton):
    """`launch_direct` (the fused append's launches, its pointers as ints): False and nothing launched before the
    first jit launch captured the kernel, for another key or device, or without a stream; after a capture, the C
    launch given exactly its arguments; a direct launch that raises drops the captured kernel (nothing queued)."""
    drivers, _ = fake_triton
    jit = Jit(drivers)
    direct = DirectKernel(jit)
    pointers = (0x1000, 0x2000, 64, 3, 128)
    assert not direct.launch_direct((5, 1, 1), pointers, (3,), 0, _triton_direct.stream_for(0))
    assert jit.launches == []
    go(direct, (5, 1, 1), args(), (3,))  # the jit launch, captured
    assert direct.launch_direct((5, 1, 1), pointers, (3,), 0, _triton_direct.stream_for(0))
    assert jit.launches[-1] == ("direct", (5, 1, 1), 1000, 0xF00D, False, True, None, None, (4, 1, 0), None, None,
                                None, pointers)
    count = len(jit.launches)
    assert not direct.launch_direct((5, 1, 1), pointers, (4,), 0, 1000)  # another key (a stride changed)
    assert not direct.launch_direct((5, 1, 1), pointers, (3,), 1, 1000)  # another device
    assert not direct.launch_direct((5, 1, 1), pointers, (3,), 0, None)  # stream_for refused
    assert len(jit.launches) == count

    def failing(*given):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    direct.call = failing
    assert not direct.launch_direct((5, 1, 1), pointers, (3,), 0, 1000) and direct.kernel is None
    assert len(jit.launches) == count


@pytest.mark.skipif(triton.__version__ != _triton_direct.TESTED_TRITON, reason="reads Triton 3.6.0's sources")
def test_the_installed_triton_launcher_takes_an_int_pointer_as_the_address():
    """What `launch_direct`'s callers rely on, read from the installed Triton's launcher source (its C, generated
    by backends/nvidia/driver.py): a pointer parameter is parsed as an object and given to getPointer, which takes
    an int as the device address as it is — before the data_ptr() call and the driver's cuPointerGetAttribute
    that a tensor gets."""
    import triton.backends.nvidia.driver as nvidia

    source = " ".join(inspect.getsource(nvidia).split())
    assert "if ty[0] == '*': return \"O\"" in source
    assert "getPointer(_arg{i}, {i}); if (!ptr_info{i}.valid) return NULL;" in source
    get_pointer = source[source.index("static inline DevicePtrInfo getPointer(PyObject *obj, int idx)"):]
    get_pointer = get_pointer[:get_pointer.index("cleanup:")]
    assert get_pointer.index("if (PyLong_Check(obj)) {{ ptr_info.dev_ptr = PyLong_AsUnsignedLongLong(obj); "
                             "return ptr_info; }}") < get_pointer.index("PyObject_CallMethodNoArgs(obj, data_ptr_str)")
    assert get_pointer.index("return ptr_info; }}") < get_pointer.index("cuPointerGetAttribute")
