"""The runtime breaker: an implementation that raises at run time is demoted for the calls it failed on.

With ``settings.fallback_on_error`` (on by default) an exception from an implementation the policy chose — not a
pinned one (a pin never falls back), not inside torch.compile tracing or CUDA graph capture, not an
out-of-memory error — is recorded here as a `Demotion`, and the call is decided again without it: the next
candidate in the policy's order takes the call. A failure in binding the kernel to a call's signature
(``Impl.bind``) counts as a failure of the kernel.

Scope. The first failure demotes the implementation for the failing call's *signature* only (its exact
shapes, dtypes and flags: the call record's ``signature()``, what the per-call fast path keys on): a kernel
that fails at one sequence length keeps every other length of its call class. Once it has failed on two
distinct signatures of one call class, it is demoted for the whole *class* (every signature of it).

Retries. A demotion is retried after `RETRY_AFTER_S[0]` seconds, again after `RETRY_AFTER_S[1]` if it failed
again at that scope, and after that it holds for the rest of the process (a broken kernel costs at most three
exceptions per signature and three per class). Time is read from `Breaker.clock` (``time.monotonic`` unless
given; tests give a fake one). Each implementation's first failure logs one WARNING, and so does its demotion
for a whole class; later ones log at INFO. ``explain()`` lists a demoted candidate with the error, the failing
call, the scope and when it will be retried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ._state import bounded_put

__all__ = ["CLASS", "RETRY_AFTER_S", "SIGNATURE", "Breaker", "Demotion", "RetryDue", "may_fail_over"]

# Seconds before a demoted implementation is tried again: after its first failure, after its second; a third
# failure demotes it for the rest of the process (bounded retry: a broken kernel costs at most three exceptions
# per signature and per call class).
RETRY_AFTER_S = (60.0, 600.0)

# The scopes of a demotion: the failing call's signature alone, or every signature of its call class.
SIGNATURE = "signature"
CLASS = "class"


class RetryDue(Exception):  # noqa: N818 — a signal, not an error
    """Raised by a function bound while a demotion holds, once its retry time has come: the front door then
    decides the call again (the demoted implementation gets its retry)."""


@dataclass(frozen=True)
class Demotion:
    """One implementation demoted for one call signature or one call class: the error, the call it last failed
    on, how often it failed at this scope, until when."""

    impl_id: str
    error: str
    call: str  # the failing call (the latest failure), as `describe()` gives it
    failures: int
    retry_at: float | None  # on the breaker's clock; None: for the rest of the process
    scope: str = SIGNATURE  # SIGNATURE or CLASS

    @property
    def scope_text(self) -> str:
        return ("for this call signature (these shapes, dtypes and flags; other signatures of its class still "
                "use it)" if self.scope == SIGNATURE else "for its whole call class (it failed on two distinct "
                "signatures of it)")

    def outlook(self, now: float) -> str:
        if self.retry_at is None:
            return f"demoted {self.scope_text} for the rest of the process"
        return f"demoted {self.scope_text}; retried in {max(0.0, self.retry_at - now):.0f} s"

    def reason(self, now: float) -> str:
        times = "once" if self.failures == 1 else f"{self.failures} times"
        return (f"raised {self.error} at run time ({times}; last on [{self.call}]); {self.outlook(now)}. Fix or "
                "report the kernel, or pin it with impl= to see the error")


def may_fail_over(exc: BaseException) -> bool:
    """Whether an exception from a kernel may move the call to the next implementation.

    Out-of-memory is not a fault of the kernel: another implementation needs memory too (the reference needs
    the most), so it is raised as is. Nor is torch.utils.checkpoint's early stop (`_StopRecomputationError`): it is
    raised through the kernel on purpose, once a recomputation has every tensor the backward needs, and must reach
    the checkpoint — a fail-over would demote the kernel and run the next one inside a stopped recomputation.
    """
    if not isinstance(exc, Exception) or isinstance(exc, RetryDue):
        return False
    import torch

    return not isinstance(exc, torch.OutOfMemoryError) and not _is_checkpoint_stop(exc)


def _is_checkpoint_stop(exc: BaseException) -> bool:
    from torch.utils import checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)  # private to torch; absent: nothing to tell apart
    return stop is not None and isinstance(exc, stop)


def _retry_at(failures: int, now: float) -> float | None:
    return now + RETRY_AFTER_S[failures - 1] if failures <= len(RETRY_AFTER_S) else None


class Breaker:
    """The demotions of one manager: per (call class key, implementation id), and per call signature within a
    class; bounded like every cache. `clock` gives the time demotions are measured in (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._classes: dict[tuple[Hashable, str], Demotion] = {}
        # class key -> implementation id -> signature -> its demotion (kept after its retry: the count matters)
        self._signatures: dict[Hashable, dict[str, dict[Hashable, Demotion]]] = {}
        self._warned: set[tuple[str, str]] = set()

    def active(self, class_key: Hashable, signature: Hashable | None, impl_id: str, now: float
               ) -> Demotion | None:
        """The demotion of `impl_id` that still holds at `now` for `class_key` or, given its `signature`, for that
        signature (None: none, or its retry is due). The class's demotion comes first."""
        demotion = self._classes.get((class_key, impl_id))
        if demotion is not None and (demotion.retry_at is None or now < demotion.retry_at):
            return demotion
        if signature is None:
            return None
        demotion = self._signatures.get(class_key, {}).get(impl_id, {}).get(signature)
        if demotion is not None and (demotion.retry_at is None or now < demotion.retry_at):
            return demotion
        return None

    def has_signature_demotions(self, class_key: Hashable) -> bool:
        """Whether any implementation ever failed on one signature of `class_key` (one dict lookup)."""
        return class_key in self._signatures

    def holds_for_signature(self, class_key: Hashable, signature: Hashable, now: float) -> bool:
        """Whether some implementation is demoted at `now` for `signature` of `class_key` alone: calls of that
        signature then need a decision of their own."""
        for by_signature in list(self._signatures.get(class_key, {}).values()):
            demotion = by_signature.get(signature)
            if demotion is not None and (demotion.retry_at is None or now < demotion.retry_at):
                return True
        return False

    def record(self, class_key: Hashable, signature: Hashable | None, impl_id: str, exc: BaseException,
               call: str) -> tuple[Demotion, bool]:
        """Demote `impl_id` after `exc` on the call `call` (described) of `signature` in `class_key`: for that
        signature, or — from its second distinct failing signature in the class on, or with no signature — for
        the whole class. Also whether to log it loudly (WARNING): the implementation's first failure, and its
        first demotion for a whole class."""
        now = self.clock()
        error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            failed_signatures = 0
            if signature is not None:
                by_impl = self._signatures.get(class_key)
                if by_impl is None:
                    by_impl = {}
                    bounded_put(self._signatures, class_key, by_impl)
                by_signature = by_impl.setdefault(impl_id, {})
                previous = by_signature.get(signature)
                failures = 1 if previous is None else previous.failures + 1
                demotion = Demotion(impl_id, error, call, failures, _retry_at(failures, now), SIGNATURE)
                bounded_put(by_signature, signature, demotion)
                failed_signatures = len(by_signature)
            if signature is None or failed_signatures >= 2:
                previous = self._classes.get((class_key, impl_id))
                failures = 1 if previous is None else previous.failures + 1
                demotion = Demotion(impl_id, error, call, failures, _retry_at(failures, now), CLASS)
                bounded_put(self._classes, (class_key, impl_id), demotion)
            loud = (impl_id, demotion.scope) not in self._warned
            self._warned.add((impl_id, demotion.scope))
        return demotion, loud

    def watched(self) -> tuple[dict[tuple[Hashable, str], Demotion],
                               dict[Hashable, dict[str, dict[Hashable, Demotion]]]]:
        """The dicts every demotion is recorded in first (while none is recorded, a new one changes one of them):
        what a cache of "no demotion applies" watches for changes."""
        return self._classes, self._signatures

    def __bool__(self) -> bool:
        return bool(self._classes) or bool(self._signatures)

    def clear(self) -> None:
        with self._lock:
            self._classes.clear()
            self._signatures.clear()
            self._warned.clear()
