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


class CompiledKernel:
    """Triton 3.6's CompiledKernel as JITFunction.run uses it: ``run`` (a property: the launcher), ``function``,
    ``packed_metadata``, ``launch_metadata``."""

    def __init__(self, launches: list) -> None:
        self.function = 0xF00D
        self.packed_metadata = (4, 1, 0)  # num_warps, num_ctas, shared
        self.launches = launches

    @property
    def run(self):
        def launcher(gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata, launch_enter_hook,
                     launch_exit_hook, *args):
            self.launches.append(("direct", (gridX, gridY, gridZ), stream, function, packed_metadata,
                                  launch_metadata, launch_enter_hook, launch_exit_hook, args))
        return launcher

    def launch_metadata(self, grid, stream, *args):
        return None


class Jit:
    """A JITFunction: ``jit[grid](*args)`` launches (recorded) and returns its CompiledKernel."""

    def __init__(self, kernel_factory=None) -> None:
        self.arg_names = list(PARAMS)
        self.pre_run_hooks: list = []
        self.used_global_vals: dict = {}
        self.launches: list = []
        self.kernel = (kernel_factory or CompiledKernel)(self.launches)

    def __getitem__(self, grid):
        def runner(*args):
            self.launches.append(("jit", grid, args))
            return self.kernel
        return runner


class Driver:
    def __init__(self) -> None:
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def fake_triton(monkeypatch):
    """The tested Triton as `_supported` returns it: a driver config and knobs of our own."""
    drivers = types.SimpleNamespace(active=Driver())
    knobs = types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain(reversed=True),
                                      debug=False),
        compilation=types.SimpleNamespace(instrumentation_mode=""))
    monkeypatch.setattr(_triton_direct, "_supported", lambda: (drivers, knobs))
    return drivers, knobs


def args(n=64, stride=3):
    return ("x", "y", n, stride, 128)


def kinds(jit):
    return [launch[0] for launch in jit.launches]


def test_the_first_call_goes_through_the_jit_and_later_ones_pass_what_jit_run_passes(fake_triton):
    jit = Jit()
    direct = DirectKernel(jit)
    for _ in range(3):
        direct.launch((5, 2, 1), args(), (3,))
    assert kinds(jit) == ["jit", "direct", "direct"] and direct.jit_launches == 1
    assert jit.launches[0] == ("jit", (5, 2, 1), args())
    # JITFunction.run: kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
    # launch_metadata, enter_hook, exit_hook, *bound_args.values()) — None for the metadata and the empty hooks.
    assert jit.launches[1] == ("direct", (5, 2, 1), 1000, 0xF00D, (4, 1, 0), None, None, None, args())


def test_a_call_with_another_key_is_launched_through_the_jit(fake_triton):
    jit = Jit()
    direct = DirectKernel(jit)
    direct.launch((1, 1, 1), args(stride=3), (3,))
    direct.launch((1, 1, 1), args(stride=16), (16,))  # another specialization: the jit picks its kernel
    direct.launch((1, 1, 1), args(stride=3), (3,))
    assert kinds(jit) == ["jit", "jit", "direct"]


@pytest.mark.parametrize("change", ["device", "driver", "pre_run_hook", "enter_hook", "exit_hook", "debug",
                                    "instrumentation"])
def test_anything_the_capture_relied_on_changing_sends_the_call_through_the_jit(fake_triton, change):
    drivers, knobs = fake_triton
    jit = Jit()
    direct = DirectKernel(jit)
    direct.launch((1, 1, 1), args(), (3,))
    undo = {
        "device": lambda: setattr(drivers.active, "device", 1),
        "driver": lambda: setattr(drivers, "active", Driver()),
        "pre_run_hook": lambda: jit.pre_run_hooks.append(print),
        "enter_hook": lambda: knobs.runtime.launch_enter_hook.add(print),
        "exit_hook": lambda: knobs.runtime.launch_exit_hook.add(print),
        "debug": lambda: setattr(knobs.runtime, "debug", True),
        "instrumentation": lambda: setattr(knobs.compilation, "instrumentation_mode", "consan"),
    }[change]
    undo()
    direct.launch((1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "jit"]


def test_a_failing_direct_launch_is_launched_through_the_jit_and_the_kernel_dropped(fake_triton):
    class Broken(CompiledKernel):
        @property
        def run(self):
            def launcher(*a):
                self.launches.append(("direct-failed",))
                raise TypeError("an argument the launcher cannot parse")
            return launcher

    Broken.__name__ = "CompiledKernel"  # what a capture checks
    jit = Jit(Broken)
    direct = DirectKernel(jit)
    for _ in range(3):
        direct.launch((1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "direct-failed", "jit", "jit"]


@pytest.mark.parametrize("case", ["interpreter", "future", "arity", "globals", "hooks", "other_triton"])
def test_a_kernel_this_path_cannot_vouch_for_is_never_launched_directly(fake_triton, monkeypatch, case):
    drivers, knobs = fake_triton
    jit = Jit()
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
        direct.launch((1, 1, 1), args(), (3,))
    assert kinds(jit) == ["jit", "jit", "jit"]


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
    assert type(triton.knobs.runtime.launch_enter_hook).__name__ == "HookChain"
    assert not triton.knobs.runtime.launch_enter_hook.calls and not triton.knobs.runtime.launch_exit_hook.calls


@pytest.mark.parametrize("layout", ["dense", "rows", "paged"])
def test_the_fused_append_passes_every_parameter_in_declaration_order(monkeypatch, layout):
    """FusedAppend's argument tuples bind to the real kernels' parameters by position, constexprs included, with
    the values they name; the key is the strides (the ints that may change between calls)."""
    seen = {}

    class Recording:
        def __init__(self, name, jit):
            self.name, self.jit = name, jit

        def launch(self, grid, given, key):
            seen[self.name] = (grid, inspect.signature(self.jit.fn).bind(*given).arguments, key)

    monkeypatch.setattr(_kv_append, "DirectKernel", lambda jit: Recording(jit.__name__, jit))
    batch, new, heads_k, dim, page, width = 3, 2, 2, 8, 4, 5
    has_rows, paged = layout == "rows", layout == "paged"
    fused = _kv_append.FusedAppend(batch, new, width if paged else 0, page, 7, page * (width if paged else 1),
                                   has_rows, paged, heads_k, dim)
    lens = torch.zeros(batch, dtype=torch.int32)
    rows = torch.arange(batch, dtype=torch.int32) if has_rows else None
    table = torch.zeros(batch, width, dtype=torch.int32) if paged else None
    k, v = torch.zeros(batch, new, heads_k, dim), torch.zeros(batch, new, heads_k, 2 * dim)[..., :dim]
    k_cache, v_cache = torch.zeros(7, page, heads_k, dim), torch.zeros(7, page, heads_k, dim)
    report = torch.zeros(fused.report_width, dtype=torch.int32)
    scratch = fused.scratch(torch.device("cpu"))
    fused(lens, rows, table, k, v, k_cache, v_cache, report, scratch)
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
