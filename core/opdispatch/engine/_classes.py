"""Decision classes: the key under which a decision is cached, derived from what can change it.

A decision depends on the call only through (a) its class key — dtype, layout, head dims, GQA ratio, flags —
(b) the thresholds the policy's rules compare sizes with (`seqlen_k: '>=4096'`), (c) the limits the candidates'
capabilities put on sizes (`max_seqlen`), (d) what each candidate's `selection_key` says its extra checks read, and
(e) with an autotune table, the tuned bucket. Two calls that agree on all of these get the same decision, so a
decode loop (one more key per step) or a new batch size reuses it instead of deciding again.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

from ..base._impl import Impl
from ..base._ops import op_spec

# Size fields a `when:` condition may compare; head dims and the GQA ratio are exact in the class key already.
SIZE_FIELDS = ("seqlen_q", "seqlen_k", "batch", "heads_q", "heads_kv")


class DecisionClasses:
    """Maps a validated call to its decision class, for one op under one policy and one set of implementations.

    Built once per (policy, registry) and kept by the manager; `key(call)` is what the decision cache uses.
    """

    def __init__(self, op: str, policy: Any, impls: Sequence[Any]) -> None:
        self.size_tests: list[tuple[str, Any]] = []  # (field, IntSpec) from every rule of every layer
        for layer in policy.layers:
            spec = layer.op(op)
            if spec is None:
                continue
            for rule in spec.rules:
                for field in SIZE_FIELDS:
                    int_spec = getattr(rule.when, field, None)
                    if int_spec is not None:
                        self.size_tests.append((field, int_spec))
        caps = [getattr(impl, "caps", None) for impl in impls]
        self.max_seqlens = sorted({m for m in (getattr(c, 'max_seqlen', None) for c in caps) if m is not None})
        # Only implementations whose checks read more than the class key contribute a selection key — and only
        # on devices where they are available (the manager filters per device: `keyed_on`).
        self.keyed = [impl for impl in impls if _reads_more(impl)]
        self.keyed_on: dict[Any, list[Any]] = {}
        # With an autotune table, the op's bucket sizes (attention: seqlen_q, seqlen_k, batch) join the class.
        tuning = op_spec(op).tuning
        self.tuned_sizes = (tuning.bucket_sizes if tuning is not None and policy.autotune_table(op) is not None
                            else None)
        self.tuned = self.tuned_sizes is not None
        self.generic = not impls or not all(hasattr(impl, "selection_key") for impl in impls)
        self.policy_hash: str = policy.hash
        # Where each policy size test may change its answer (None: a form `_cuts` does not know).
        self._size_cuts = [(field, _cuts(spec)) for field, spec in self.size_tests]
        # Compiled once: the key is computed on every call that misses the per-call fast path (each decode step).
        self._tests = [(operator.attrgetter(field), _predicate(spec)) for field, spec in self.size_tests]

    def key(self, call: Any, keyed: Sequence[Any]) -> tuple[Any, ...]:
        """The class of `call`; `keyed` are the implementations whose selection keys count (see `keyed_on`)."""
        if self.generic or not hasattr(call, "class_key"):
            return ("exact", call.signature())  # an op without classes: every signature decides on its own
        key = [call.class_key()]
        for get, test in self._tests:
            key.append(test(get(call)))
        if self.max_seqlens:
            longest = max(call.seqlen_q, call.seqlen_k)
            key.append(tuple(longest <= m for m in self.max_seqlens))
        for impl in keyed:
            key.append(impl.selection_key(call))
        if self.tuned_sizes is not None:
            # Autotune blends buckets by log-distance: quarter-octave steps keep the verdict within one class.
            key.append(tuple(round(4 * math.log2(max(s, 1))) for s in self.tuned_sizes(call)))
        return tuple(key)

    def boxable(self, keyed: Sequence[Any]) -> bool:
        """Whether `size_box` can say a box for any call of this op with `keyed` counting: the policy's size
        tests have known cuts, no autotune buckets, and every keyed candidate declares the sizes its dense
        selection key reads (`dense_key_size_cuts`). Fixed for a state and device: a "no" holds for every size."""
        return (not self.generic and self.tuned_sizes is None
                and all(cuts is not None for _, cuts in self._size_cuts)
                and all(_dense_key_cuts(impl) is not None for impl in keyed))

    def size_box(self, call: Any, keyed: Sequence[Any]) -> dict[str, tuple[int, int | None]] | None:
        """Per size field (`SIZE_FIELDS`), the interval [low, high) around `call`'s value (high None: unbounded)
        inside which every size test of `key` — the policy's thresholds, the candidates' `max_seqlen` limits and
        the sizes the keyed candidates' selection keys read (`dense_key_size_cuts`) — answers as it does for
        `call`: a dense call without a KV cache or bias (with or without a boolean mask) whose sizes all lie in
        it (and whose `class_key` is `call`'s, which holds the mask's broadcast pattern) is of `call`'s class.
        None where the class reads sizes otherwise (`boxable`): an op without classes, a candidate's selection
        key that declares no cuts (Python code), autotune buckets. What the compiled front door checks sizes
        against (opdispatch.doors._api, `_native_size_entry`)."""
        if not self.boxable(keyed):
            return None
        box: dict[str, tuple[int, int | None]] = {field: (1, None) for field in SIZE_FIELDS}

        def narrow(field: str, low: int, high: int | None) -> None:
            old_low, old_high = box[field]
            box[field] = (max(old_low, low), high if old_high is None else old_high if high is None
                          else min(old_high, high))

        def between(field: str, cuts: Sequence[int]) -> None:  # the interval of consecutive cuts holding the value
            value = getattr(call, field)
            narrow(field, max((c for c in cuts if c <= value), default=1),
                   min((c for c in cuts if c > value), default=None))

        for field, policy_cuts in self._size_cuts:
            between(field, policy_cuts or ())  # never None here: boxable
        for impl in keyed:
            for field, key_cuts in (_dense_key_cuts(impl) or {}).items():  # never None here: boxable
                between(field, key_cuts)
        seqlen_q, seqlen_k = call.seqlen_q, call.seqlen_k
        for limit in self.max_seqlens:  # `max(seqlen_q, seqlen_k) <= limit`: kept true, or kept false by the longer
            if max(seqlen_q, seqlen_k) <= limit:
                narrow("seqlen_q", 1, limit + 1)
                narrow("seqlen_k", 1, limit + 1)
            else:
                narrow("seqlen_k" if seqlen_k > limit else "seqlen_q", limit + 1, None)
        return box


def _dense_key_cuts(impl: Any) -> dict[str, Sequence[int]] | None:
    """`impl.dense_key_size_cuts` where it is a valid declaration — per size field (`SIZE_FIELDS`), the values at
    which the implementation's `selection_key` of a dense call (no KV cache, bias, ALiBi or window; with or
    without a boolean mask, whose sizes follow the call's) may change (constant between two consecutive ones; a
    field not named is not read) — else None: the key may read any size. A declaration naming another field, or
    a cut that is not an int, counts as none (and fails tests/test_native_sized.py's check of every built-in
    declaration, decode and prefill, causal and masked)."""
    cuts = getattr(impl, "dense_key_size_cuts", None)
    if not isinstance(cuts, dict) or not all(
            field in SIZE_FIELDS and isinstance(values, tuple) and all(type(c) is int for c in values)
            for field, values in cuts.items()):
        return None
    return cuts


# Where a comparison's answer may change: it is constant on each interval between consecutive cuts.
_CUTS: dict[str, Callable[[int], tuple[int, ...]]] = {
    ">=": lambda n: (n,), "<": lambda n: (n,), ">": lambda n: (n + 1,), "<=": lambda n: (n + 1,),
    "==": lambda n: (n, n + 1), "!=": lambda n: (n, n + 1)}


def _cuts(spec: Any) -> list[int] | None:
    """The values at which `spec.matches` may change its answer (between two consecutive ones it is constant);
    None for a form not known here."""
    if spec.values is not None:
        return [c for v in spec.values for c in (v, v + 1)]
    cuts: list[int] = []
    for op, n in spec.comps:
        if op not in _CUTS or type(n) is not int:
            return None
        cuts.extend(_CUTS[op](n))
    return cuts


def _reads_more(impl: Any) -> bool:
    """Whether `impl` overrides its op's default checks (`selection_key`, `extra_reasons`): the defaults are those
    of its op's implementation base — the class in its MRO that derives from `Impl` directly (AttentionImpl for
    attention) — found without importing any op (the engine sits below the ops)."""
    cls = type(impl)
    base = next((c for c in cls.__mro__ if Impl in c.__bases__), None)
    if base is None:  # not an Impl: assume it reads more
        return True
    return any(getattr(cls, name, None) is not getattr(base, name, None) for name in ("selection_key", "extra_reasons"))


def _predicate(spec: Any) -> Callable[[int], bool]:
    """`spec.matches` as the cheapest callable: a set lookup, one bound comparison, or the general method."""
    if spec.values is not None:
        return spec.values.__contains__  # type: ignore[no-any-return]
    if len(spec.comps) == 1:
        op, n = spec.comps[0]
        # value OP n, written as n's reflected comparison: a bound method call, no Python frame.
        reflected = {">=": "__le__", "<=": "__ge__", ">": "__lt__", "<": "__gt__", "==": "__eq__", "!=": "__ne__"}
        return getattr(n, reflected[op])  # type: ignore[no-any-return]
    return spec.matches  # type: ignore[no-any-return]
