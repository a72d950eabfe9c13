"""A dispatch decision: the chosen implementation and, for every candidate, its status, reasons and provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errors import OpDispatchError

if TYPE_CHECKING:
    from ._device import DeviceInfo
    from ._impl import Impl

CHOSEN = "chosen"
ELIGIBLE = "eligible"
REJECTED = "rejected"
DENIED = "denied by policy"
UNAVAILABLE = "unavailable"
FAILED = "failed to load"
DEMOTED = "demoted after raising"  # by the runtime breaker (opdispatch.engine._breaker)


@dataclass(frozen=True)
class Provenance:
    """What decided something: a policy rule (file:line), an env var, a context override or an argument."""

    kind: str  # policy | env | context | argument | priority
    source: str  # "configs/default.yaml:12", "OPDISPATCH_IMPL_ATTENTION", "impl=", "policy_override()"
    rule: str | None = None
    note: str | None = None

    def __str__(self) -> str:
        text = self.source
        if self.rule:
            text += f" rule {self.rule!r}"
        if self.note:
            text += f" ({self.note})"
        return text

    def short(self, impl_id: str | None = None) -> str:
        """A table cell: the file by its name (shipped configs) or relative path, and the rule's name — or the
        list entry, left out when it is `impl_id` itself (`default.yaml:21 order`). `str()` has it all."""
        source = _short_path(self.source)
        if self.rule:
            return f"{source} rule {self.rule!r}"
        if self.note:
            note = self.note.split(";")[0]
            if impl_id is not None and note.endswith(f" {impl_id!r}"):
                note = note[: -len(impl_id) - 3]
            return f"{source} {note}"
        return source


def _short_path(source: str) -> str:
    """`source` ("path:line" or a name) with a shipped config as its file name and a path under the working
    directory relative to it."""
    import os
    from importlib import resources
    from pathlib import Path

    path, sep, line = source.rpartition(":")
    if not sep or not line.isdigit():
        path, line = source, ""
    if not path.endswith((".yaml", ".yml")):
        return source
    configs = Path(str(resources.files("opdispatch.configs"))).resolve()
    try:
        resolved = Path(path).resolve()
        if configs in resolved.parents or Path.cwd() in resolved.parents:
            base = configs if configs in resolved.parents else Path.cwd()
            path = os.path.relpath(resolved, base)
    except (OSError, ValueError):
        pass
    return f"{path}:{line}" if line else path


@dataclass
class Candidate:
    impl_id: str
    status: str
    reasons: list[str] = field(default_factory=list)
    decided_by: Provenance | None = None
    origin: str = ""


@dataclass
class Decision:
    """The outcome of resolving one call. `str(decision)` is a readable table; `chosen` is None on failure."""

    op: str
    call: str
    device: DeviceInfo
    chosen: Impl | None
    candidates: list[Candidate]
    decided_by: Provenance | None
    policy_source: str
    policy_hash: str
    pinned: str | None = None
    # The decision cache key of the call class it was made for (the breaker demotes per class and per
    # signature), and when a demotion it honours expires (on the breaker's clock): the cached decision is then
    # made again, giving the demoted kernel its retry.
    cache_key: Any = field(default=None, repr=False, compare=False)
    retry_at: float | None = field(default=None, repr=False, compare=False)
    # The call signature it was made for alone, when an implementation is demoted for that signature only
    # (opdispatch.engine._breaker); None: it stands for the whole class.
    signature: Any = field(default=None, repr=False, compare=False)
    # How the ranks of a torch.distributed group agreed on it (opdispatch.engine._agreement); None: agreement is off.
    agreement: str | None = field(default=None, compare=False)
    agreed: bool = field(default=False, compare=False)  # by every rank of the group (then `agreement` says how)

    @property
    def chosen_id(self) -> str | None:
        return self.chosen.id if self.chosen is not None else None

    def candidate(self, impl_id: str) -> Candidate:
        for c in self.candidates:
            if c.impl_id == impl_id:
                return c
        raise KeyError(f"{impl_id!r} is not a candidate of this decision; candidates: "
                       f"{', '.join(c.impl_id for c in self.candidates)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op, "call": self.call, "device": self.device.to_dict(), "chosen": self.chosen_id,
            "decided_by": str(self.decided_by) if self.decided_by else None,
            "policy": {"source": self.policy_source, "hash": self.policy_hash}, "pinned": self.pinned,
            "agreement": self.agreement,
            "candidates": [
                {"impl": c.impl_id, "status": c.status, "reasons": c.reasons,
                 "decided_by": str(c.decided_by) if c.decided_by else None, "origin": c.origin}
                for c in self.candidates
            ],
        }

    def __str__(self) -> str:
        return self.format()

    def format(self, width: int | None = None) -> str:
        """The decision as text. `width`: wrap the table's reasons to fit that many columns, and show each
        candidate's provenance in short (`Provenance.short`); None: one line per candidate, all of it."""
        from ._table import format_fields, format_table

        fields = [("op", self.op), ("call", str(self.call)), ("device", self.device.describe()),
                  ("policy", f"{self.policy_source} (hash {self.policy_hash})")]
        if self.chosen is not None:
            fields.append(("chosen", f"{self.chosen_id}  (decided by {self.decided_by})"))
        else:
            fields.append(("chosen", "none — no implementation can take this call"))
        if self.agreement is not None:
            fields.append(("group", str(self.agreement)))
        head = format_fields(fields, width=width)
        rows = [("#", "implementation", "status", "decided by", "reasons")]
        for i, c in enumerate(self.candidates, 1):
            reasons = "; ".join(c.reasons) if c.reasons else "-"
            by = "-" if c.decided_by is None else c.decided_by.short(c.impl_id) if width else str(c.decided_by)
            rows.append((str(i), c.impl_id, c.status, by, reasons))
        return "\n".join(head) + "\n\n" + "\n".join(format_table(rows, width=width, rule=True))


class NoImplementationError(OpDispatchError, NotImplementedError):
    """No implementation can take the call: the message lists every candidate with its reasons."""

    def __init__(self, message: str, *, decision: Decision | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class PinnedImplementationError(NoImplementationError):
    """The implementation pinned by `impl=`, an env var or the policy cannot take the call.

    A pin never falls back silently; this error carries the pinned implementation's reasons.
    """
