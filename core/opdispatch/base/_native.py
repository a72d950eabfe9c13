"""The compiled per-call fast path: building it, loading it, and turning a Python front door into a C builtin.

`_native.cpp` is a small C++ extension against torch's headers (``torch/csrc/autograd/python_variable.h``,
``c10/core/GradMode.h``): a front door whose hit path — parse the arguments, key the tensors' metadata from their
TensorImpl and the flags, find the bound kernel, call it — runs in C. Anything else goes to the Python front door,
which stays the reference behaviour (it validates, decides, binds, raises); after it ran a call, the builtin reads
the bound function back from the manager's cache under the key the Python path used (`OpArguments.key_function`).

It is never required. ``opdispatch build`` compiles it with torch's `cpp_extension` (a C++ compiler for the standard
torch builds extensions with — C++20 with current torch, C++17 with older — and ninja) into a cache directory keyed
by the environment (sys.prefix), Python, torch, the C++ ABI and this source; importing opdispatch loads it from
there when it exists. It builds for CPython 3.11–3.13 (`PYTHONS`); on other Pythons opdispatch runs the Python path.
``OPDISPATCH_FAST_PATH`` chooses: ``auto`` (default: compiled when built, else Python), ``python``, or ``compiled``
(raise where it cannot load). ``opdispatch doctor`` says which path is active and why.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys
import sysconfig
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ._arguments import REQUIRED, OpArguments
from ._errors import OpDispatchError

__all__ = ["ENV", "NativeStatus", "build", "build_directory", "compiled_front_door", "context_sources", "forget",
           "front_doors", "kernel_call", "native_module", "python_of", "reset_status", "status", "thread_flag", "twin"]

ENV = "OPDISPATCH_FAST_PATH"
MODES = ("auto", "python", "compiled")
SOURCE = Path(__file__).with_name("_native.cpp")
# The compiled front door's key kinds, by number (_native.cpp's `Kind`).
KIND_CODES = {"tensor": 0, "strided": 1, "tensor?": 2, "index": 3, "value": 4, "str": 5, "int_tuple": 6,
              "bypass": 7, "zero": 8}


@dataclass(frozen=True)
class NativeStatus:
    """Which per-call fast path the front doors take, and why."""

    active: bool
    reason: str
    path: str | None = None

    def describe(self) -> str:
        return ("compiled" if self.active else "python") + f" ({self.reason})"


@functools.cache  # the source does not change under a running process: read and hashed once, not per name
def _source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def module_name() -> str:
    return f"_opdispatch_native_{_source_digest()}"


def build_directory() -> Path:
    """Where the extension for this environment (sys.prefix), Python, torch, C++ ABI and source lives
    (``OPDISPATCH_CACHE_DIR`` or the user's cache directory)."""
    root = os.environ.get("OPDISPATCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "opdispatch")
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "na")
    # The environment too: two venvs with the same Python and torch each keep their own build (one rebuilding
    # would replace the other's loaded .so under it).
    environment = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    tag = (f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}-cxx11abi{int(bool(abi))}-"
           f"{platform.machine()}-env{environment}-{_source_digest()}")
    return Path(root) / "native" / tag.replace("+", "_")


def _built_path() -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    directory = build_directory()
    exact = directory / f"{module_name()}{suffix}"
    return exact if exact.exists() else directory / f"{module_name()}.so"  # cpp_extension names it plainly


def build(*, verbose: bool = False) -> Path:
    """Compile the extension for this environment (cached: a second call only loads it) and return its path.

    Raises OpDispatchError saying what is missing (a C++ compiler, ninja, torch's headers) and how to get it.
    """
    if not supported_python():
        raise OpDispatchError(
            f"opdispatch's compiled fast path builds for Python {_pythons_text()}, not {platform.python_version()} "
            "(it reads CPython internals those versions share); the Python fast path runs here, with the same "
            "behaviour. `opdispatch doctor` shows which is active.")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # ninja from the environment's own bin (pip's `ninja`) when the PATH lacks it.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=module_name(), sources=[str(SOURCE)], build_directory=str(directory),
                           extra_cflags=["-O2"], verbose=verbose)
    except Exception as exc:  # a compiler error, no compiler, no ninja: say which, and that Python still runs
        raise OpDispatchError(
            f"building opdispatch's compiled fast path failed: {type(exc).__name__}: {exc}\n"
            f"It needs a C++ compiler (g++ or clang++) for {cxx_standard()} — the standard torch "
            f"{torch.__version__}'s cpp_extension compiles with —, ninja (pip install ninja) and torch's headers "
            f"(in the torch wheel). Without it the Python fast path runs; `opdispatch doctor` shows which is "
            f"active. Build directory: {directory}") from exc
    path = _built_path()
    if not path.exists():
        raise OpDispatchError(f"opdispatch build: the compiler ran but {path} is missing; remove {directory} "
                              "and build again")
    return path


# The Pythons the extension builds for (_native.cpp's #error lines): 3.11 added PyErr_SetHandledException, 3.14
# removed dict version tags. opdispatch itself runs on Python >= 3.10 (requires-python): elsewhere the Python path.
PYTHONS = ((3, 11), (3, 13))


def supported_python() -> bool:
    return PYTHONS[0] <= sys.version_info[:2] <= PYTHONS[1]


def _pythons_text() -> str:
    return f"{PYTHONS[0][0]}.{PYTHONS[0][1]}–{PYTHONS[1][0]}.{PYTHONS[1][1]}"


def cxx_standard() -> str:
    """The C++ standard torch's cpp_extension builds the extension with (it passes ``-std`` itself: C++20 with
    current torch, C++17 with older); read from torch, so a message never names a standard the build does not use."""
    import inspect
    import re

    try:
        from torch.utils import cpp_extension

        found = {int(n) for n in re.findall(r"-std=c\+\+(\d+)", inspect.getsource(cpp_extension))}
    except (OSError, TypeError, ImportError):  # no source shipped: say what any torch >= 2.4 accepts at least
        found = set()
    return f"C++{max(found)}" if found else "C++17 or newer"


_loaded: ModuleType | None = None
_status: NativeStatus | None = None
_lock = threading.Lock()


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise OpDispatchError(f"{ENV}={mode!r} is not a fast-path mode; allowed: {', '.join(MODES)}. Unset it "
                              "for the default (auto: compiled when built, else Python).")
    return mode


def native_module() -> ModuleType | None:
    """The loaded extension, or None where the Python path runs (`status()` says why)."""
    global _loaded, _status
    if _status is not None:
        return _loaded
    with _lock:
        if _status is None:
            _loaded, _status = _load()
    return _loaded


def status() -> NativeStatus:
    native_module()
    assert _status is not None
    return _status


def _load() -> tuple[ModuleType | None, NativeStatus]:
    mode = _mode()
    if mode == "python":
        return None, NativeStatus(False, f"{ENV}=python")
    if not supported_python():
        reason = (f"not available on Python {platform.python_version()} (it builds for Python {_pythons_text()}); "
                  "the Python path runs, with the same behaviour")
        if mode == "compiled":
            raise OpDispatchError(f"{ENV}=compiled, but the compiled fast path is {reason}")
        return None, NativeStatus(False, reason)
    path = _built_path()
    if not path.exists():
        reason = (f"not built for this Python, torch {torch.__version__} and source: run `opdispatch build` "
                  f"(looked in {path.parent})")
        if mode == "compiled":
            raise OpDispatchError(f"{ENV}=compiled, but the compiled fast path is {reason}")
        return None, NativeStatus(False, reason)
    name = module_name()
    try:
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.machinery.ExtensionFileLoader(name, str(path))
            spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            sys.modules[name] = module
    except Exception as exc:  # an ABI mismatch the tag did not catch, a truncated file
        reason = f"{path} does not load ({type(exc).__name__}: {exc}); rebuild with `opdispatch build`"
        if mode == "compiled":
            raise OpDispatchError(f"{ENV}=compiled, but {reason}") from exc
        return None, NativeStatus(False, reason)
    return module, NativeStatus(True, f"built for torch {torch.__version__}", str(path))


def reset_status() -> None:
    """Forget the load decision (after a build, or a change of OPDISPATCH_FAST_PATH or the cache directory); front
    doors made before keep the path they took."""
    global _loaded, _status
    with _lock:
        _loaded, _status = None, None


# -- compiled front doors ------------------------------------------------------------------------------------------

_doors: list[tuple[weakref.ref[Any], Callable[..., Any]]] = []


def front_doors() -> list[Any]:
    """The compiled front doors alive in this process."""
    return [door for ref, _ in _doors if (door := ref()) is not None]


def forget() -> None:
    """Drop every compiled front door's entries (a new process-wide manager: the old one's kernels go)."""
    for door in front_doors():
        door.__self__.forget()


def compiled_front_door(python: Callable[..., Any], *, name: str, names: Sequence[str], n_positional: int,
                        defaults: Sequence[Any], kinds: Sequence[str], key_of: Callable[..., Any],
                        failed: Callable[..., Any], bound: Sequence[str], bound_optional: Sequence[str] = (),
                        context: Sequence[Any] = (), exact: Sequence[str] = (), grad: Sequence[str] | None = None,
                        result: Callable[..., Any] | None = None, result_arg: str | None = None,
                        flag: Any = None, api_globals: dict[str, Any],
                        size_entry: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """`python` (a front door) as a C builtin with a compiled hit path, or `python` itself where the extension
    is not loaded.

    names/defaults/n_positional: its parameters (``REQUIRED`` for none); kinds: each one's key kind
    (`KIND_CODES`); key_of(*arguments): the key the Python path keeps the bound function under, or None;
    failed(manager, key, fn, exc, *arguments): what a hit does when the kernel raises; bound/bound_optional: the
    arguments the bound function takes; context: what joins the key besides the arguments — ContextVars (read
    directly), None (torch's determinism flag, read in C), `AUTOCAST` (no hit while torch.autocast is on for any
    device type: the Python door applies it) or zero-argument callables; exact: tensors that must
    be ``torch.Tensor`` itself (not a Parameter); grad: the tensors whose requires_grad makes the grad field
    (default: every tensor); result(out, arguments[result_arg]) shapes the output when that argument is true;
    flag: a `thread_flag()` set while the kernel runs (calls made meanwhile go to Python); api_globals: the
    namespace whose ``_manager`` a hit reads (the front doors' module, whose ``_manager`` follows the process-wide
    manager: core/opdispatch/engine/_current.py); size_entry(*arguments): after the Python path ran a call whose exact
    signature missed, what the door keeps for calls that differ from it only in sizes (opdispatch.doors._api's
    `_native_size_entry` says what; None: no such entries).
    """
    spec = dict(name=name, names=names, n_positional=n_positional, defaults=defaults, kinds=kinds, key_of=key_of,
                failed=failed, bound=bound, bound_optional=bound_optional, context=context, exact=exact, grad=grad,
                result=result, result_arg=result_arg, flag=flag, api_globals=api_globals, size_entry=size_entry)
    python.__opdispatch_native_spec__ = spec  # type: ignore[attr-defined]  # for twin(): the same door, compiled
    native = native_module()
    if native is None:
        return python
    index = {n: i for i, n in enumerate(names)}
    tensors = [n for n, k in zip(names, kinds) if k in ("tensor", "strided", "tensor?")]
    grad_names = set(tensors if grad is None else grad)
    doc = _text_signature(name, python) + (python.__doc__ or "")
    door = native.front_door(
        name=name, doc=doc, names=list(names), n_positional=n_positional, defaults=list(defaults),
        required=REQUIRED, kinds=[KIND_CODES[k] for k in kinds], exact=[int(n in exact) for n in names],
        grad=[int(n in grad_names) for n in names], bound=[index[n] for n in bound],
        bound_optional=[index[n] for n in bound_optional], context=list(context), python=python, key_of=key_of,
        failed=failed, api_globals=api_globals,
        compiler_globals=torch.compiler.__dict__, result=result,
        result_arg=-1 if result_arg is None else index[result_arg], flag=flag)
    if size_entry is not None:
        door.__self__.set_size_entry(size_entry)
    _doors[:] = [(ref, fn) for ref, fn in _doors if ref() is not None]  # doors gone (tests' twins) drop out
    _doors.append((weakref.ref(door), python))
    _polyfill_when_dynamo_loads(door, python)
    return door  # type: ignore[no-any-return]


def python_of(door: Callable[..., Any]) -> Callable[..., Any]:
    """The Python front door behind a compiled one (a Python front door itself: unchanged). Its signature carries
    the annotations, which a builtin's cannot."""
    for ref, python in _doors:
        if ref() is door:
            return python
    return door


def twin(front_door: Callable[..., Any]) -> Callable[..., Any]:
    """A new compiled front door made exactly as `front_door` (compiled or Python) was: the same spec over the same
    Python front door — how tests run both paths on the same cases. Raises OpDispatchError where the extension is
    not loaded (`status()` says why)."""
    python = python_of(front_door)
    spec = getattr(python, "__opdispatch_native_spec__", None)
    if spec is None:
        raise OpDispatchError(f"{front_door!r} is not a front door made by opdispatch.base._native.compiled_front_door")
    if native_module() is None:
        raise OpDispatchError(f"the compiled fast path is not loaded: {status().reason}")
    return compiled_front_door(python, **spec)


def from_arguments(python: Callable[..., Any], arguments: OpArguments, namespace: dict[str, Any],
                   failed: Callable[..., Any], api_globals: dict[str, Any],
                   size_entry: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The compiled front door of an op's generated one (`OpArguments.front_door`, made in `namespace`), keyed
    exactly as it is; `api_globals`, `size_entry`: see `compiled_front_door`."""
    return compiled_front_door(
        python, name=arguments.op, names=arguments.names, n_positional=sum(a.positional for a in arguments.args),
        defaults=[a.default for a in arguments.args], kinds=arguments.native_kinds(),
        key_of=arguments.key_function(namespace), failed=failed, bound=arguments.bound,
        bound_optional=arguments.bound_optional, context=context_sources(*(namespace[c] for c in arguments.context)),
        api_globals=api_globals, size_entry=size_entry)


AUTOCAST = "autocast"  # a context marker: see compiled_front_door


def context_sources(*fns: Callable[..., Any] | str) -> list[Any]:
    """`compiled_front_door`'s context for these zero-argument functions (as `_context_source` reads each)."""
    return [_context_source(fn) for fn in fns]


def _context_source(fn: Callable[..., Any] | str) -> Any:
    """What the compiled door reads for a context function: a ContextVar's bound ``get`` as the ContextVar itself
    (read without a call), torch's determinism flag as None (read from torch's global context in C), else the
    callable, called."""
    import contextvars

    owner = getattr(fn, "__self__", None)
    if isinstance(owner, contextvars.ContextVar) and getattr(fn, "__name__", "") == "get":
        return owner
    if fn is torch.are_deterministic_algorithms_enabled:
        return None
    if fn is AUTOCAST:
        return AUTOCAST
    return fn


def _text_signature(name: str, python: Callable[..., Any]) -> str:
    """The builtin's ``__text_signature__`` (so `inspect.signature` reads the Python front door's)."""
    import inspect

    sig = inspect.signature(python)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    inner = str(inspect.Signature(params))[1:-1]
    return f"{name}($self{', ' + inner if inner else ''})\n--\n\n"


def kernel_call(kernel: Callable[..., Any], *tail: Any, index: int | None = None,
                **kwargs: Any) -> Callable[..., Any]:
    """``fn(*tensors) = kernel(*tensors, *tail, **kwargs)`` (its item `index` when given): a bound kernel as one C
    call where the extension is loaded — no Python frame between a front door, or a plan, and the kernel — else
    the same as a Python function. Attributes may be set on it (the manager sets ``decision``)."""
    native = native_module()
    if native is not None:
        return native.kernel_call(kernel, tail, tuple(kwargs), tuple(kwargs.values()),  # type: ignore[no-any-return]
                                  -1 if index is None else index)
    if index is None:
        return lambda *tensors: kernel(*tensors, *tail, **kwargs)
    return lambda *tensors: kernel(*tensors, *tail, **kwargs)[index]


def thread_flag() -> Any:
    """A per-thread int attribute ``active`` (0 by default): the compiled doors' own when loaded (they read it
    without a lookup), else a threading.local."""
    native = native_module()
    if native is not None:
        return native.ThreadFlag()
    return _LocalFlag()


class _LocalFlag(threading.local):
    active = 0


# -- torch.compile: dynamo inlines the Python front door where it meets the builtin -----------------------------

_pending: list[tuple[Any, Callable[..., Any]]] = []


def _polyfill_when_dynamo_loads(door: Any, python: Callable[..., Any]) -> None:
    if "torch._dynamo" in sys.modules:
        _polyfill(door, python)
        return
    _pending.append((door, python))
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("torch._dynamo", _polyfill_pending))


def _polyfill(door: Any, python: Callable[..., Any]) -> None:
    try:
        torch._dynamo.substitute_in_graph(door, skip_signature_check=True)(python)
    except Exception as exc:  # a torch whose dynamo refuses: compiled code breaks its graph at the builtin
        warnings.warn(f"opdispatch: torch.compile cannot trace the compiled front door {door.__name__} "
                      f"({type(exc).__name__}: {exc}); compiled graphs break there", RuntimeWarning, stacklevel=2)


def _polyfill_pending(_module: ModuleType) -> None:
    while _pending:
        _polyfill(*_pending.pop(0))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after the first import of `name` (importing torch._dynamo up front would
    cost every process a second): the other finders find the module, its loader is wrapped."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec: Any) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.callback(module)
