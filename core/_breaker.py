"""The runtime breaker: an implementation that raises at run time is demoted for the call class it failed on.

With ``settings.fallback_on_error`` (on by default) an exception from an implementation the policy chose — not a
pinned one, not inside torch.compile tracing or CUDA graph capture, not an out-of-memory error — is recorded here
as a `Demotion` of that implementation for that call class on that device. The call is then decided again without
it, so the next candidate in the policy's order takes the call, and so do the later calls of the class: the
failing kernel is not retried on every call. It is retried after `RETRY_AFTER_S[0]` seconds, again after
`RETRY_AFTER_S[1]` if it failed again, and after that it stays demoted for the rest of the process. Each
implementation's first failure logs one WARNING; later ones log at INFO. ``explain()`` lists a demoted candidate
with the error and when it will be retried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass

from ._state import bounded_put

__all__ = ["RETRY_AFTER_S", "Breaker", "Demotion", "RetryDue", "may_fail_over"]

# Seconds before a demoted implementation is tried again: after its first failure, after its second; a third
# failure demotes it for the rest of the process (bounded retry: a broken kernel costs at most three exceptions
# per call class).
RETRY_AFTER_S = (60.0, 600.0)


class RetryDue(Exception):  # noqa: N818 — a signal, not an error
    """Raised by a function bound while a demotion holds, once its retry time has come: the front door then
    decides the call again (the demoted implementation gets its retry)."""


@dataclass(frozen=True)
class Demotion:
    """One implementation demoted for one call class: the error, how often it failed, until when."""

    impl_id: str
    error: str
    call: str
    failures: int
    retry_at: float | None  # time.monotonic(); None: for the rest of the process

    def outlook(self, now: float) -> str:
        if self.retry_at is None:
            return "demoted for the rest of the process"
        return f"demoted for this call class; retried in {max(0.0, self.retry_at - now):.0f} s"

    def reason(self, now: float) -> str:
        times = "once" if self.failures == 1 else f"{self.failures} times"
        return (f"raised {self.error} at run time ({times}; first on [{self.call}]); {self.outlook(now)}. Fix or "
                "report the kernel, or pin it with impl= to see the error")


def may_fail_over(exc: BaseException) -> bool:
    """Whether an exception from a kernel may move the call to the next implementation.

    Out-of-memory is not a fault of the kernel: another implementation needs memory too (the reference needs
    the most), so it is raised as is.
    """
    if not isinstance(exc, Exception) or isinstance(exc, RetryDue):
        return False
    import torch

    return not isinstance(exc, torch.OutOfMemoryError)


class Breaker:
    """The demotions of one manager, per (call class key, implementation id); bounded like every cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._demoted: dict[tuple[Hashable, str], Demotion] = {}
        self._warned: set[str] = set()

    def active(self, class_key: Hashable, impl_id: str, now: float) -> Demotion | None:
        """The demotion of `impl_id` for `class_key` that still holds at `now` (None: none, or its retry is due)."""
        demotion = self._demoted.get((class_key, impl_id))
        if demotion is None or (demotion.retry_at is not None and now >= demotion.retry_at):
            return None
        return demotion

    def record(self, class_key: Hashable, impl_id: str, exc: BaseException, call: str) -> tuple[Demotion, bool]:
        """Demote `impl_id` for `class_key` after `exc` (one more failure if it was demoted before); also whether
        this is the implementation's first failure in the process (log it loudly once)."""
        with self._lock:
            previous = self._demoted.get((class_key, impl_id))
            failures = 1 if previous is None else previous.failures + 1
            delay = RETRY_AFTER_S[failures - 1] if failures <= len(RETRY_AFTER_S) else None
            demotion = Demotion(impl_id, f"{type(exc).__name__}: {exc}",
                                call if previous is None else previous.call, failures,
                                None if delay is None else time.monotonic() + delay)
            bounded_put(self._demoted, (class_key, impl_id), demotion)
            first = impl_id not in self._warned
            self._warned.add(impl_id)
        return demotion, first

    def __bool__(self) -> bool:
        return bool(self._demoted)

    def clear(self) -> None:
        with self._lock:
            self._demoted.clear()
            self._warned.clear()
