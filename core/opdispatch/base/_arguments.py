"""One declarative definition of an op's arguments, and the front door generated from it.

An op's `OpArguments` lists its arguments once: name, type, default, whether it may be positional, and how it
enters the per-call fast-path key. From it come

- the front door (``opdispatch.<op>``): its signature, the torch.compile hand-off, the fast-path key and the
  hand-off to the op's slow path (validate, decide, bind) — generated as Python source, as `dataclasses`
  generates ``__init__``, so the hot path is the same straight-line code one would write by hand;
- the signatures of the op's other entry points (``explain_<op>``, ``plan``): `signature()`;
- the registration-time check that the op's validator and compile entry take exactly these arguments
  (`check_callable`), so no copy of the list can drift;
- the documentation table (`markdown`).

How an argument enters the fast-path key (`Arg.key`):

``tensor``     a required tensor: shape, dtype, device; its requires_grad joins the one grad-mode field
``strided``    as ``tensor``, plus the last dim's stride (validation reads it)
``tensor?``    an optional tensor: None, or (shape, dtype, device, requires_grad)
``index``      an optional index tensor or int: on accelerators its shape/dtype/device; on the CPU, where
               validation reads its values each call (no sync there), it bypasses the fast path
``value``      the value and its class (``causal=1`` must not hit ``causal=True``'s entry: validation refuses
               it; strings need no class); a tuple also its elements' classes; an unhashable value bypasses the
               fast path
``bypass``     any value but None bypasses the fast path (validated in full each call)
"""

from __future__ import annotations

import inspect
import itertools
import keyword
import linecache
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The Python front doors' hit counters, one per op, process-wide (`opdispatch.stats()` reads them): `next()` on
# an itertools.count is one C call that the GIL makes atomic (a `+= 1` on a Python int is not).
_python_hits: dict[str, itertools.count[int]] = {}
_hits_lock = threading.Lock()


def python_hit_counter(op: str) -> Callable[[], int]:
    """The function the Python front door of `op` calls on each fast-path hit (one C call)."""
    with _hits_lock:
        counter = _python_hits.get(op)
        if counter is None:
            counter = _python_hits[op] = itertools.count()
    return counter.__next__

__all__ = ["Arg", "OpArguments", "REQUIRED"]

REQUIRED: Any = inspect.Parameter.empty
KEY_KINDS = ("tensor", "strided", "tensor?", "index", "value", "bypass")


@dataclass(frozen=True)
class Arg:
    """One argument of an op's front door."""

    name: str
    annotation: str
    default: Any = REQUIRED
    key: str = "value"
    positional: bool = False
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class OpArguments:
    """An op's arguments in order, plus what its fast path needs besides them.

    bound: the tensors the bound function of a decided signature takes (``Impl.bind``'s function and the call
      record's ``with_tensors``), in that order.
    bound_optional: optional tensors whose values change from call to call of one signature (a KV cache's
      lengths and pages, a mask): when any is given, the bound function takes them all too, after `bound`
      (None for those not given); calls without them call it with `bound` alone. Their key kind is ``index``
      or ``tensor?`` (shape, dtype and device in the key).
    context: names of zero-argument functions (looked up in the front door's namespace) whose results join the
      key: the active overrides, the module scope, torch's determinism flag…
    return_forms: the front door's return by one argument's value, for type checkers (the generated stub's
      overloads, `opdispatch.tools._stubs`): ``(argument, its annotation in this form, the return annotation)``, e.g.
      ``("return_lse", "Literal[True]", "tuple[torch.Tensor, torch.Tensor]")``. A return annotation that is the
      union of the forms' returns is refined by them; the union stays the catch-all form.
    """

    op: str
    args: tuple[Arg, ...]
    bound: tuple[str, ...]
    context: tuple[str, ...] = ("_overrides", "_module", "_profiling")
    bound_optional: tuple[str, ...] = ()
    return_forms: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        names = [a.name for a in self.args]
        problems = []
        if len(set(names)) != len(names):
            problems.append(f"duplicate argument names in {names}")
        for a in self.args:
            if not a.name.isidentifier() or keyword.iskeyword(a.name):
                problems.append(f"argument name {a.name!r} is not a Python identifier")
            if a.key not in KEY_KINDS:
                problems.append(f"argument {a.name!r} has key kind {a.key!r}; allowed: {', '.join(KEY_KINDS)}")
        positional = [a.positional for a in self.args]
        if positional != sorted(positional, reverse=True):
            problems.append("positional arguments must come before keyword-only ones")
        seen_default = False
        for a in self.args:
            if a.positional and not a.required:
                seen_default = True
            elif a.positional and seen_default:
                problems.append(f"positional argument {a.name!r} without a default follows one with a default")
        missing = [n for n in self.bound if n not in names]
        if missing:
            problems.append(f"bound names {missing} are not arguments")
        by_name = {a.name: a for a in self.args}
        for n in self.bound_optional:
            if n not in by_name or by_name[n].key not in ("index", "tensor?") or n in self.bound:
                problems.append(f"bound_optional name {n!r} must be an argument of key kind 'index' or 'tensor?', "
                                "not in bound")
        for form in self.return_forms:
            if len(form) != 3 or form[0] not in by_name:
                problems.append(f"return form {form!r} must be (argument name, its annotation, return annotation)")
        if problems:
            raise ValueError(f"op {self.op!r}: malformed argument definition: " + "; ".join(problems))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def bound_tensors(self, given: Mapping[str, Any]) -> tuple[Any, ...]:
        """What the bound function of a call with these argument values takes: `bound`, then `bound_optional`
        when any of those is given."""
        tensors = tuple(given[n] for n in self.bound)
        if any(given[n] is not None for n in self.bound_optional):
            tensors += tuple(given[n] for n in self.bound_optional)
        return tensors

    def signature(self, *, drop: tuple[str, ...] = (), extra: tuple[inspect.Parameter, ...] = (),
                  return_annotation: Any = inspect.Signature.empty) -> inspect.Signature:
        """The front door's signature (minus `drop`, plus keyword-only `extra` parameters)."""
        params = []
        for a in self.args:
            if a.name in drop:
                continue
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if a.positional else inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(a.name, kind, default=a.default, annotation=a.annotation))
        params.extend(extra)
        return inspect.Signature(params, return_annotation=return_annotation)

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str) -> dict[str, Any]:
        """Every argument's value (defaults filled in) for a call of `what` taking the op's arguments; the
        TypeError of a wrong call names `what` and its signature."""
        try:
            bound = self.signature().bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{what}{self.signature()}: {exc}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def check_callable(self, fn: Callable[..., Any], what: str, *, drop: tuple[str, ...] = (),
                       allowed_extra: tuple[str, ...] = ()) -> None:
        """Raise TypeError unless `fn` takes exactly these arguments (minus `drop`; keyword extras allowed), in
        this order, with these defaults and positional kinds."""
        params = list(inspect.signature(fn).parameters.values())
        params = [p for p in params if p.name not in allowed_extra]
        expected = [a for a in self.args if a.name not in drop]
        got = [(p.name, p.default, p.kind == inspect.Parameter.KEYWORD_ONLY) for p in params]
        want = [(a.name, a.default, not a.positional) for a in expected]
        if got != want:
            raise TypeError(f"op {self.op!r}: {what} takes {_describe(got)}; the op's argument definition says "
                            f"{_describe(want)}. Change the definition (one place) or {what}.")

    def call_text(self) -> str:
        """The front door as one would call it: ``rms_norm(x, weight=None, eps=1e-06, residual=None, *, impl=None)``."""
        bare = [p.replace(annotation=inspect.Parameter.empty) for p in self.signature().parameters.values()]
        return f"{self.op}{inspect.Signature(bare)}"

    def markdown(self) -> str:
        """A table of the arguments for the docs."""
        rows = ["| argument | type | default | |", "|---|---|---|---|"]
        for a in self.args:
            default = "required" if a.required else f"`{a.default!r}`"
            annotation = a.annotation.replace("|", "\\|")  # a bare | would split the table cell
            rows.append(f"| `{a.name}` | `{annotation}` | {default} | {a.doc.replace('|', chr(92) + '|')} |")
        return "\n".join(rows)

    # -- the generated front door ----------------------------------------------------------------------------
    def front_door(self, *, doc: str, namespace: dict[str, Any], compiled: str, slow: str, failed: str,
                   return_annotation: str = "Any", manager: str = "_manager or get_manager()") -> Callable[..., Any]:
        """Generate ``opdispatch.<op>``.

        namespace: the globals of the generated function (the defining module's own, so it reads the current
          process-wide manager): it must hold `compiled` (the torch.compile entry, called with the arguments as
          the front door takes them), `slow` (called as ``slow(manager, key, *arguments)``, key None when the call
          bypasses the fast path), `failed` (called as ``failed(manager, key, fn, exc, *arguments)`` when the bound
          function `fn` of a fast-path hit raised `exc`), ``_is_compiling``, ``_manager``/``get_manager`` and the
          `context` and key helpers (``_grad_enabled``, ``_index_key``).
        manager: the expression that finds the manager (the default reads the defining module's global).
        """
        # The hit counter of `opdispatch.stats()` (one C call per hit: see opdispatch.engine._stats).
        namespace[_hit_counter_name(self.op)] = python_hit_counter(self.op)
        source = self.front_door_source(compiled=compiled, slow=slow, failed=failed,
                                        return_annotation=return_annotation, manager=manager)
        fn: Callable[..., Any] = _exec_source(source, f"<opdispatch front door {self.op}>", namespace)[self.op]
        fn.__doc__ = doc
        fn.__signature__ = self.signature(return_annotation=return_annotation)  # type: ignore[attr-defined]
        fn.__module__ = "opdispatch"
        fn.__qualname__ = self.op
        fn.__opdispatch_source__ = source  # type: ignore[attr-defined]
        fn.__opdispatch_arguments__ = self  # type: ignore[attr-defined]  # what the typing stub is generated from
        return fn

    def front_door_source(self, *, compiled: str, slow: str, failed: str, return_annotation: str = "Any",
                          manager: str = "_manager or get_manager()") -> str:
        params = []
        star = False
        for a in self.args:
            if not a.positional and not star:
                params.append("*")
                star = True
            params.append(a.name if a.required else f"{a.name}={_default_name(a)}")
        names = ", ".join(self.names)
        forward = ", ".join(f"{a.name}={a.name}" if not a.positional else a.name for a in self.args)
        bypass = self._bypass_condition()
        lines = [
            f"def {self.op}({', '.join(params)}) -> {return_annotation}:",
            "    if _is_compiling():",
            f"        return {compiled}({forward})",
            f"    manager = {manager}",
            "    key = None",
        ]
        body = [
            "try:",
            f"    key = {self._key_expression()}",
            "    fn = manager.fast[key]",
            "except KeyError:",
            "    pass  # the first call of this signature",
            "except (AttributeError, TypeError, IndexError, RuntimeError):",
            "    key = None  # not tensors, an unhashable value, a CPU index tensor: the slow path checks all",
            "else:",
            f"    {_hit_counter_name(self.op)}()",
            "    try:",
        ]
        if self.bound_optional:
            body += [f"        if {' and '.join(f'{n} is None' for n in self.bound_optional)}:",
                     f"            return fn({', '.join(self.bound)})",
                     f"        return fn({', '.join(self.bound + self.bound_optional)})"]
        else:
            body.append(f"        return fn({', '.join(self.bound)})")
        body += [
            "    except Exception as exc:  # free until raised (zero-cost try): the breaker decides what follows",
            f"        return {failed}(manager, key, fn, exc, {names})",
        ]
        if bypass:
            lines.append(f"    if {bypass}:")
            lines += ["        " + line for line in body]
        else:
            lines += ["    " + line for line in body]
        lines.append(f"    return {slow}(manager, key, {names})")
        return "\n".join(lines) + "\n"

    def key_function(self, namespace: dict[str, Any]) -> Callable[..., Any]:
        """``key_of(*arguments)``: the fast-path key the front door builds for these arguments (all of them,
        positionally, in definition order), or None where it builds none — what the compiled front door reads
        back from the manager's cache after the Python path ran a call (`opdispatch.base._native`)."""
        fn: Callable[..., Any] = _exec_source(self.key_function_source(), f"<opdispatch fast-path key {self.op}>",
                                              namespace)[f"{self.op}_key"]
        return fn

    def key_function_source(self) -> str:
        bypass = self._bypass_condition()
        body = ["try:",
                f"    return {self._key_expression()}",
                "except (AttributeError, TypeError, IndexError, RuntimeError):",
                "    return None"]
        lines = [f"def {self.op}_key({', '.join(self.names)}):"]
        if bypass:
            lines.append(f"    if not ({bypass}):")
            lines.append("        return None")
        lines += ["    " + line for line in body]
        return "\n".join(lines) + "\n"

    def _bypass_condition(self) -> str:
        return " and ".join(f"{a.name} is None" for a in self.args if a.key == "bypass")

    def _key_expression(self) -> str:
        """The fast-path key tuple as a Python expression over the argument names (the one statement of it)."""
        key_items = [repr(self.op)]
        grads = []
        for a, kind in zip(self.args, self.native_kinds()):
            n = a.name
            if kind in ("tensor", "strided"):
                key_items += [f"{n}.shape", f"{n}.dtype", f"{n}.device"]
                if kind == "strided":
                    key_items.append(f"{n}.stride(-1)")
                grads.append(f"{n}.requires_grad")
            elif kind == "tensor?":
                key_items.append(f"None if {n} is None else ({n}.shape, {n}.dtype, {n}.device, {n}.requires_grad)")
                grads.append(f"({n} is not None and {n}.requires_grad)")
            elif kind == "index":  # None inline: most calls pass none, and a call costs more than the test
                key_items.append(f"None if {n} is None else _index_key({n})")
            elif kind == "int_tuple":  # element types too: (4.0, 0) == (4, 0)
                key_items.append(f"None if {n} is None else ({n}, tuple(map(type, {n})))")
            elif kind == "str":  # no str equals another type's value
                key_items.append(n)
            elif kind == "value":  # with its class: True == 1 == 1.0 hash alike, validation tells them apart
                key_items += [n, f"{n}.__class__"]
        if grads:
            key_items.append(f"_grad_enabled() and ({' or '.join(grads)})")
        key_items += [f"{c}()" for c in self.context]
        return f"({', '.join(key_items)})"

    def native_kinds(self) -> list[str]:
        """Each argument's key kind, the value kinds split by annotation: what `_key_expression` writes for it and
        what the compiled front door reads (`opdispatch.base._native`)."""
        kinds = []
        for a in self.args:
            if a.key != "value":
                kinds.append(a.key)
            elif "tuple[" in a.annotation:
                kinds.append("int_tuple")
            elif a.annotation in ("str", "str | None"):
                kinds.append("str")
            else:
                kinds.append("value")
        return kinds


def _hit_counter_name(op: str) -> str:
    return f"_opdispatch_{op}_hits"


def _exec_source(source: str, filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run generated source (as dataclasses does) and register it in `linecache` under its file name, so
    tracebacks, pdb and `inspect.getsource` show the generated lines. Returns the names it defined."""
    # A linecache entry with mtime None is never checked against a file (`linecache.checkcache` keeps it); the
    # same text under the same name (a second door of one op, in tests) is simply replaced.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    local: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), namespace, local)
    return local


def _default_name(a: Arg) -> str:
    if a.default is None or isinstance(a.default, (bool, int, float, str)):
        return repr(a.default)
    raise ValueError(f"argument {a.name!r}: default {a.default!r} must be None, a bool, a number or a string")


def _describe(items: list[tuple[str, Any, bool]]) -> str:
    parts = []
    for name, default, kw_only in items:
        text = name if default is REQUIRED else f"{name}={default!r}"
        parts.append(text + (" (keyword)" if kw_only else ""))
    return "(" + ", ".join(parts) + ")"
