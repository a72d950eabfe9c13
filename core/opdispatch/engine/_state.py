"""The dispatch state: everything that holds for one installed policy, built whole and swapped in one assignment.

A `DispatchState` carries the policy, the implementations configured with that policy's options (copies: the
registry's objects are never changed) and every cache whose answers depend on them — decisions, decision classes,
availability, the per-call fast path, the varlen signatures already checked, the reference-fallback warnings.
Building one validates everything first (option values, implementation ids the policy names), so a policy that is
rejected leaves the installed state untouched; installing a new policy, registering a plugin or clearing caches
installs a new state; a forked child gets an empty copy (`fresh`). Nothing is cleared in place: a reader holding
the old state only ever sees old, consistent entries.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import random
from collections.abc import Callable
from typing import Any

from ._classes import DecisionClasses
from ..base._errors import PolicyError
from ..base._impl import Impl
from ._registry import Registry

__all__ = ["CACHE_LIMIT", "DispatchState", "bounded_put"]

log = logging.getLogger("opdispatch")

# The bound of every cache in a state: decisions (one per call class), bound functions of the per-call fast path
# (one per exact signature), varlen signatures whose cu_seqlens were read, reference-fallback warnings.
CACHE_LIMIT = 4096


_EVICTION_SAMPLE = 16
_random = random.Random(0)  # deterministic: the same sequence of calls evicts the same entries


def bounded_put(cache: dict[Any, Any], key: Any, value: Any, limit: int | None = None) -> None:
    """Insert, dropping old insertions beyond `limit` (CACHE_LIMIT): the one eviction rule of every cache.

    Never a wholesale wipe, and never a cliff: the victim is a random one of the 16 oldest (of the oldest
    bound/8 in small caches, so a tiny cache stays first-in first-out). A cache that wants least-recently-used
    order re-inserts on a hit (the decision cache does); the per-call fast path does not, so its hits stay a plain
    dict subscript and an evicted hot signature costs one re-validation.
    """
    cache[key] = value
    bound = CACHE_LIMIT if limit is None else limit
    while len(cache) > bound:
        try:
            # A random one of the oldest few, not the oldest: a working set cycling just above the bound would
            # otherwise evict, every time, the entry needed next (FIFO's and LRU's worst case: 100% misses).
            oldest = list(itertools.islice(iter(cache), min(_EVICTION_SAMPLE, max(1, bound // 8))))
            del cache[oldest[_random.randrange(len(oldest))]]
        except (KeyError, RuntimeError, IndexError, ValueError):  # another thread changed it meanwhile
            break


class DispatchState:
    """One policy with its configured implementations and its caches (see the module docstring)."""

    def __init__(self, policy: Any, impls: dict[str, dict[str, Impl]]) -> None:
        self.policy = policy
        # Per op, implementation id -> the implementation configured with this policy's options, in registry order.
        self.impls = impls
        self.decisions: dict[Any, Any] = {}
        self.classes: dict[str, DecisionClasses] = {}
        self.availability: dict[tuple[str, Any], str | None] = {}
        # Per-call fast path of the front doors: argument key -> bound function.
        self.fast: dict[Any, Any] = {}
        # Varlen signatures whose cu_seqlens values were checked once (accelerators only; see _api), each with
        # whether cu_seqlens_k held the values of cu_seqlens_q.
        self.checked_varlen: dict[Any, bool] = {}
        # Size-generic templates of the front doors (opdispatch.doors._api): a fast-path key without its sizes -> the
        # validated call, decision and bound function that calls differing only in sizes reuse.
        self.size_generic: dict[Any, Any] = {}
        self.warned_reference: dict[Any, None] = {}

    @classmethod
    def build(cls, policy: Any, registry: Registry, strict_hint: Callable[[], str] = str) -> DispatchState:
        """Configure every registered implementation with `policy`'s options and check the ids it names.

        Raises PolicyError (naming the file:line, the option and the fix) before anything is installed.
        `strict_hint()` adds context to the strict-mode error (the plugins that failed to load).
        """
        impls: dict[str, dict[str, Impl]] = {}
        for op in registry.ops():
            options = policy.options(op)
            configured: dict[str, Impl] = {}
            for entry in registry.for_op(op):
                impl = entry.impl
                try:
                    configured[impl.id] = impl.with_options(options.get(impl.id))
                except ValueError as exc:
                    where = next((w for p, what, w in policy.patterns(op) if what == "options" and p == impl.id),
                                 policy.source)
                    raise PolicyError(f"{where}: field ops.{op}.options.{impl.id}: {exc}",
                                      field=f"ops.{op}.options.{impl.id}") from exc
            impls[op] = configured
            _check_named_ids(op, policy, configured, strict_hint)
        return cls(policy, impls)

    def fresh(self) -> DispatchState:
        """The same policy and implementations with empty caches (a forked child: device state may differ)."""
        return DispatchState(self.policy, self.impls)

    def implementation(self, op: str, impl_id: str) -> Impl | None:
        return self.impls.get(op, {}).get(impl_id)


def _check_named_ids(op: str, policy: Any, known: dict[str, Impl], strict_hint: Callable[[], str]) -> None:
    unknown = [(p, what, where) for p, what, where in policy.patterns(op)
               if not any(fnmatch.fnmatchcase(i, p) for i in known)]
    if not unknown:
        return
    text = (f"the policy names implementations of {op!r} that are not registered: "
            + "; ".join(f"{where}: {what} {p!r}" for p, what, where in unknown)
            + f". Registered: {', '.join(sorted(known)) or 'none'}.")
    if policy.settings.strict:
        raise PolicyError(text + strict_hint() + "\n(settings.strict is on; turn it off to only warn)",
                          field=f"ops.{op}")
    log.debug("%s", text)
