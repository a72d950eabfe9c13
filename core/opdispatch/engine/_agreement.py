"""Rank-consistent decisions: every new decision (and a tuned table) agreed across a torch.distributed group.

Ranks that decide differently — an env var set on one node, a library missing on one host, other autotune
timings — run different kernels with different numerics, or deadlock where a kernel carries collectives. With
agreement on (`consistent()`, or ``OPDISPATCH_DISTRIBUTED=consistent``), the manager gathers each rank's decision
(a small record: the call's class, the choice, every candidate's status) once per new decision class, with
``all_gather_object`` over the group, and applies one rule on every rank:

- every rank chose the same implementation: agreed;
- otherwise rank 0's choice, when every rank's decision found it eligible (available, able to take the call,
  not denied or pinned away): the other ranks use it, and their `explain()` says who chose what;
- otherwise `AgreementError` on every rank, listing each rank's choice and reasons, the implementations every
  rank could run, and how to fix it.

Agreement is collective: every rank of the group must make the same new decisions in the same order (true of
SPMD programs calling the same ops on the same kinds of inputs). It runs only where a decision is made — a cache
miss, never on the per-call fast path — and never while torch.compile traces (a recompile happens on one rank
alone); a CUDA graph capture never decides at all. A rank whose calls differ from the others' at the same point
raises `AgreementError`; one that decides alone waits for the group's timeout (``init_process_group(timeout=)``
or ``new_group(timeout=)``), then raises `AgreementError` too. Under agreement a kernel that raises is not failed
over on its own rank (the others would not know): the error reaches the caller.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..base._decision import CHOSEN, ELIGIBLE, Decision, Provenance
from ..base._errors import OpDispatchError

if TYPE_CHECKING:
    from opdispatch.policies._tuned_table import TunedTable

log = logging.getLogger("opdispatch")

ENV_DISTRIBUTED = "OPDISPATCH_DISTRIBUTED"
_ENV_VALUES = ("consistent", "local")

__all__ = ["AgreementError", "ENV_DISTRIBUTED", "GroupAgreement", "SignatureField", "agree_call", "agree_tuned_table",
           "collective_op", "explained", "forget_local", "from_environ", "torchrun_group"]


class AgreeingManager(Protocol):
    """What agreement reads of the manager (`opdispatch.OpManager`, which builds on this module: a protocol, not an
    import): the state's configured implementations, the fast path's bound functions, the agreement in force."""

    @property
    def state(self) -> Any: ...

    @property
    def fast(self) -> dict[Any, Any]: ...

    agreement: GroupAgreement | None


class AgreementError(OpDispatchError, RuntimeError):
    """The ranks of a group could not agree on a decision (or on a tuned table); raised on every rank."""


@dataclass
class _Record:
    """One rank's side of an agreement: small and picklable (it travels through ``all_gather_object``)."""

    rank: int
    op: str
    cls: str  # the call's intrinsic class (dtype, layout, head dims, flags): ranks at one point must share it
    call: str
    chosen: str | None
    decided_by: str
    eligible: list[str]
    statuses: dict[str, str] = field(default_factory=dict)  # impl id -> "status: reasons"
    error: str | None = None  # this rank could not decide (a pin that cannot take the call, nothing fits)


def _group_size(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _gather(group: Any, record: Any, what: str) -> list[Any]:
    """`record` of every rank of `group`, in group-rank order; a collective that fails (a timeout: a rank that
    never joined) becomes an AgreementError that says why."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    records: list[Any] = [None] * size
    try:
        dist.all_gather_object(records, record, group=group)
    except Exception as exc:
        raise AgreementError(
            f"opdispatch could not agree {what} across the {size} ranks of the group: the collective failed "
            f"({type(exc).__name__}: {str(exc)[:300]}). Agreement is collective: every rank of the group must make "
            "the same new decisions in the same order (a rank that decides alone waits for the group's timeout). "
            "Fix: make every rank make the same calls (warm them up on every rank), pin the implementation "
            "(OPDISPATCH_IMPL_<OP> on every rank), or turn agreement off for this code "
            "(`with opdispatch.distributed.local():`)") from exc
    return records


class GroupAgreement:
    """Agreement of a manager's new decisions across one process group (None: the default group)."""

    def __init__(self, group: Any = None, *, require_initialized: bool = True) -> None:
        self.group = group
        # From the env var, a process may decide before `init_process_group` (or never start one): those
        # decisions are local, and explain says so.
        self.require_initialized = require_initialized
        self.agreements = 0  # collectives run (tests, and a check that the fast path never agrees)

    def ready(self) -> bool:
        """Whether a decision made now is agreed (see `_inactive`)."""
        return self._inactive() is None

    def _inactive(self) -> str | None:
        """Why decisions are not agreed now (None: they are)."""
        import torch

        if torch.compiler.is_compiling():
            return "decided while torch.compile traced (a recompile happens on one rank alone): warm the call up " \
                   "eagerly on every rank first, or pin it"
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            if self.require_initialized:
                raise AgreementError(
                    "opdispatch: decisions are agreed across a process group (opdispatch.distributed.consistent()), "
                    "but torch.distributed is not initialised in this process (any more). Fix: initialise it "
                    "(torch.distributed.init_process_group) before deciding, or decide alone from now on with "
                    "opdispatch.distributed.local()")
            return "torch.distributed was not initialised when it was decided"
        return None

    def agree(self, manager: AgreeingManager, op: str, call: Any, decision: Decision) -> Decision:
        """The group's decision for `call`: this rank's `decision` when every rank made the same, else rank 0's
        choice where every rank can run it, with its `agreement` line; AgreementError on every rank when no
        implementation suits them all."""
        agreed = self._agree(manager, op, call, decision, None)
        assert agreed is not None
        return agreed

    def agree_failed(self, manager: AgreeingManager, op: str, call: Any, error: BaseException) -> None:
        """This rank could not decide (`error`: a pin that cannot take the call, ...): take part in the
        collective all the same, so the others do not wait; they then raise AgreementError, and so does this rank
        when the others could decide (the caller re-raises `error` otherwise)."""
        self._agree(manager, op, call, None, error)

    def _agree(self, manager: AgreeingManager, op: str, call: Any, decision: Decision | None,
               error: BaseException | None) -> Decision | None:
        inactive = self._inactive()
        if inactive is not None:
            if decision is not None:
                decision.agreement = f"not agreed: {inactive}"
            return decision
        rank, size = _group_size(self.group)
        if size == 1:
            if decision is not None:
                decision.agreement, decision.agreed = "agreed (a group of one rank)", True
            return decision
        mine = _record(rank, op, call, decision, error)
        self.agreements += 1
        records: list[_Record] = _gather(self.group, mine, f"the decision of {op} for [{mine.call}]")
        classes = {r.cls for r in records}
        if len({r.op for r in records}) > 1 or len(classes) > 1:
            lines = "\n".join(f"  rank {r.rank}: {r.op} [{r.call}]" for r in records)
            raise AgreementError(
                f"{op}: the ranks of the group decided different calls at the same point:\n{lines}\n"
                "Agreement is collective: every rank must make the same new decisions in the same order. Fix: make "
                "every rank call the same ops on inputs of the same kind (dtype, layout, head dims, flags) in the "
                "same order — warm-up calls on every rank — or turn agreement off around rank-specific code "
                "(`with opdispatch.distributed.local():`)")
        choices = {r.chosen for r in records}
        if choices == {None}:  # no rank could decide: each raises its own error, which says why
            return decision
        if len(choices) == 1:
            assert decision is not None
            decision.agreement, decision.agreed = f"agreed across {size} ranks", True
            return decision
        target = records[0].chosen
        if target is not None and all(target in r.eligible for r in records):
            assert decision is not None
            overridden = [r for r in records if r.chosen != target]
            note = "; ".join(f"rank {r.rank} chose {r.chosen}" for r in overridden)
            text = f"{note}, overridden by rank 0's {target} (agreed across {size} ranks)"
            if mine.chosen != target:
                _use(manager, decision, target, text)
            decision.agreement, decision.agreed = text, True
            if rank == 0:
                log.warning("%s: ranks disagreed on [%s]: %s. Make the ranks' policies and environments equal "
                            "to decide alike.", op, mine.call, text)
            return decision
        raise _disagreement(op, records, target)


def _rank_independent(key: Any) -> Any:
    """A call's class as the group compares it: each rank holds its own GPU (cuda:0 on rank 0, cuda:1 on rank 1),
    so devices compare by type."""
    import torch

    if isinstance(key, torch.device):
        return key.type
    if isinstance(key, tuple):
        return tuple(_rank_independent(k) for k in key)
    return key


def _record(rank: int, op: str, call: Any, decision: Decision | None, error: BaseException | None) -> _Record:
    cls = _rank_independent(call.class_key() if hasattr(call, "class_key") else call.signature())
    if decision is None:
        first = str(error).splitlines()[0] if error is not None else "no decision"
        return _Record(rank, op, repr(cls), call.describe(), None, "-", [], error=f"{type(error).__name__}: {first}")
    statuses = {c.impl_id: c.status + (f" ({'; '.join(c.reasons)})" if c.reasons else "")
                for c in decision.candidates}
    eligible = [c.impl_id for c in decision.candidates if c.status in (CHOSEN, ELIGIBLE)]
    return _Record(rank, op, repr(cls), decision.call, decision.chosen_id, str(decision.decided_by), eligible,
                   statuses)


def _use(manager: AgreeingManager, decision: Decision, target: str, text: str) -> None:
    """Make `decision` choose `target` (eligible here), the group's choice."""
    impl = manager.state.implementation(decision.op, target)
    assert impl is not None, f"{target} is eligible here, so it is registered"
    for cand in decision.candidates:
        if cand.impl_id == decision.chosen_id:
            cand.status = ELIGIBLE
            cand.reasons = [f"chosen on this rank; the group uses {target}"]
        elif cand.impl_id == target:
            cand.status = CHOSEN
    decision.chosen = impl
    decision.decided_by = Provenance("distributed", "opdispatch.distributed", note=text)


def _disagreement(op: str, records: list[_Record], target: str | None) -> AgreementError:
    lines = []
    for r in records:
        if r.chosen is None:
            lines.append(f"  rank {r.rank}: no decision — {r.error}")
            continue
        lines.append(f"  rank {r.rank}: {r.chosen} (decided by {r.decided_by})")
        if target is not None and target != r.chosen:
            lines.append(f"    rank 0's {target} here: {r.statuses.get(target, 'not registered')}")
    common = [i for i in records[0].eligible if all(i in r.eligible for r in records)] if records else []
    everywhere = ", ".join(common) if common else "none"
    pin = f"OPDISPATCH_IMPL_{op.upper()}"
    return AgreementError(
        f"{op}: the ranks of the group chose different implementations for [{records[0].call}], and rank 0's "
        f"choice ({target}) cannot run on every rank:\n" + "\n".join(lines) + "\n"
        f"Implementations every rank can run for this call: {everywhere}.\n"
        f"Fix: give every rank the same policy file, env vars (OPDISPATCH_POLICY, OPDISPATCH_DENY, "
        f"OPDISPATCH_PREFER, {pin}) and libraries; or pin one implementation on every rank ({pin}=<id>, or "
        "impl=<id>) from those every rank can run.")


def from_environ(environ: Mapping[str, str]) -> GroupAgreement | None:
    """The agreement ``OPDISPATCH_DISTRIBUTED`` asks for: ``consistent`` (the default group, from when
    torch.distributed is initialised) or ``local``/unset (none); ValueError for another value."""
    value = environ.get(ENV_DISTRIBUTED, "").strip().lower()
    if value in ("", "local"):
        return None
    if value not in _ENV_VALUES:
        raise ValueError(f"{ENV_DISTRIBUTED}={value!r} is not supported; allowed: {', '.join(_ENV_VALUES)} "
                         "(consistent: agree each new decision across the default torch.distributed group)")
    return GroupAgreement(None, require_initialized=False)


def forget_local(manager: AgreeingManager) -> None:
    """Drop the per-call fast path's functions bound to decisions this rank made alone: a hit would skip the
    group's collective for their classes, which the other ranks then wait for. (Cached decisions need nothing:
    `resolve` decides an unagreed one again under agreement.)"""
    fast = manager.fast
    for key, fn in list(fast.items()):
        decision = getattr(fn, "decision", None)
        if decision is None or not decision.agreed:
            fast.pop(key, None)


def explained(manager: AgreeingManager, decision: Decision, agreed: Decision | None) -> None:
    """Give `explain()`'s fresh `decision` the group's verdict: that of the cached (agreed) decision of its class
    — explain never communicates, so a class not decided yet says so."""
    if agreed is not None and not agreed.agreed and agreed.agreement is not None:
        decision.agreement = agreed.agreement  # why it was not agreed (not initialised, compiling)
        return
    if agreed is None or not agreed.agreed or agreed.agreement is None:
        decision.agreement = ("not agreed yet: the group agrees at this class's first call on every rank "
                              "(explain never communicates)")
        return
    target = agreed.chosen_id
    if target is not None and target != decision.chosen_id and any(
            c.impl_id == target and c.status in (CHOSEN, ELIGIBLE) for c in decision.candidates):
        _use(manager, decision, target, agreed.agreement)
    decision.agreement = agreed.agreement


# -- tuned tables -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def torchrun_group(environ: Mapping[str, str]) -> Iterator[int | None]:
    """When this process is one of several ranks launched by torchrun (WORLD_SIZE > 1), join their default group
    (gloo: `opdispatch tune` only exchanges its tables) with this rank's GPU made current (LOCAL_RANK), and yield
    the rank; None for a single process.

    A group it created is destroyed on leaving, after a barrier when no error left the block (no rank tears its
    connections down while another still reads from them): a gloo group left alive at interpreter exit is torn
    down with its worker threads still joinable, which aborts the rank ("terminate called without an active
    exception", SIGABRT) — now and then, as the race at exit goes."""
    if int(environ.get("WORLD_SIZE", "1")) <= 1:
        yield None
        return
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(environ.get("LOCAL_RANK", "0")))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
        if created:  # not after an error: the others may be inside another collective, which would pair with it
            dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


def agree_tuned_table(table: TunedTable, group: Any = None) -> TunedTable:
    """One tuned table for the whole group, from every rank's measurements of the same cases: each
    implementation's time in a bucket is the maximum over ranks of its median (a synchronous step runs at its
    slowest rank's pace), an implementation that failed or could not run on any rank is left out of that bucket
    (its `failed` entry says where), and the buckets are ranked by those times. Collective: every rank calls it
    with its own table; each gets the same result. AgreementError when the ranks' device fingerprints or cases
    differ."""
    from opdispatch.policies._tuned_table import TunedEntry, TunedTable

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return table
    mine: dict[str, Any] = {"fingerprint": table.fingerprint, "op": table.op,
            "entries": [(e.discrete, e.sizes, e.median_us, e.failed, e.shape) for e in table.entries]}
    tables: list[dict[str, Any]] = _gather(group, mine, f"the tuned table of {table.op}")
    for rank, other in enumerate(tables):
        if other["fingerprint"] != table.fingerprint or other["op"] != table.op:
            raise AgreementError(
                f"opdispatch tune: rank {rank} measured {other['op']} on {other['fingerprint']}, rank "
                f"{dist.get_rank(group)} {table.op} on {table.fingerprint}: one table holds one op on one kind of "
                "device. Fix: tune each kind of device in a group of its own, with the same --op")
        if [e[:2] for e in other["entries"]] != [e[:2] for e in mine["entries"]]:
            raise AgreementError(
                f"opdispatch tune: rank {rank} measured other buckets than rank {dist.get_rank(group)}: every rank "
                "must time the same cases. Fix: pass the same --preset/--shapes on every rank")
    entries = []
    for i, (discrete, sizes, _, _, shape) in enumerate(mine["entries"]):
        failed: dict[str, str] = {}
        for rank, other in enumerate(tables):
            failed.update({impl: f"rank {rank}: {why}" for impl, why in other["entries"][i][3].items()})
        everywhere = set.intersection(*(set(other["entries"][i][2]) for other in tables))
        for rank, other in enumerate(tables):  # timed on some ranks only (it cannot run on the others)
            for impl in set(other["entries"][i][2]) - everywhere - set(failed):
                failed[impl] = f"timed on rank {rank} but not on every rank"
        timed = everywhere - set(failed)
        slowest = {impl: max(other["entries"][i][2][impl] for other in tables) for impl in timed}
        order = sorted(slowest, key=slowest.__getitem__)
        entries.append(TunedEntry(discrete, sizes, order, slowest, failed, shape))
    settings = {**table.settings, "ranks": len(tables), "agreed": "max over ranks of each median"}
    return TunedTable(table.fingerprint, entries, op=table.op, source=table.source, created=table.created,
                      settings=settings)


# -- call signatures --------------------------------------------------------------------------------------------

# How each kind of signature field travels: a fixed number of int64 words whatever the value, so that every rank's
# record has one size (a collective of unequal sizes aborts inside gloo).
_WORDS = {"int": 1, "bool": 1, "float": 2, "text": 2, "shape": 5}
_TEXT_BYTES = 8 * _WORDS["text"]
_MAX_DIMS = _WORDS["shape"] - 1
_MAGIC = 0x6F70_6473_6967  # "opdsig": a record of another opdispatch version (other fields) reads as a mismatch
# Every record has this many words whatever its op, so that ranks at different ops' agreements still exchange
# records of one size (and learn that they differ) instead of aborting inside the collective.
_RECORD_WORDS = 64
_HEADER_WORDS = 6  # magic, op, field count, call number, signature hash, rejected
# The ops that agree their calls, by the hash their records carry (each registers at import: every rank knows
# every name).
_OPS: dict[int, str] = {}
# Calls agreed so far per process group (every rank counts its own; agreed records carry the count).
_CALLS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SignatureField:
    """One field of a collective call's signature: its `name` in errors, its `kind` (int, bool, float — None
    allowed —, text of up to 16 bytes, shape of up to 4 dims — None allowed) and the `fix` an error suggests when
    ranks differ in it."""

    name: str
    kind: str
    fix: str


def _encode(kind: str, value: Any) -> list[int]:
    if kind in ("int", "bool"):
        return [int(value)]
    if kind == "float":
        return [0, 0] if value is None else [1, struct.unpack("<q", struct.pack("<d", float(value)))[0]]
    if kind == "text":
        raw = str(value).encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
        return list(struct.unpack(f"<{_WORDS['text']}q", raw))
    dims = [] if value is None else list(value)
    return [len(dims), *(dims + [-1] * _MAX_DIMS)[:_MAX_DIMS]]


def _decode(kind: str, words: list[int]) -> str:
    if kind == "bool":
        return str(bool(words[0]))
    if kind == "int":
        return str(words[0])
    if kind == "float":
        return "None" if not words[0] else repr(struct.unpack("<d", struct.pack("<q", words[1]))[0])
    if kind == "text":
        return repr(struct.pack(f"<{len(words)}q", *words).rstrip(b"\0").decode(errors="replace"))
    if words[0] > _MAX_DIMS:
        return f"a {words[0]}-D tensor"
    return "None" if words[0] == 0 else str(tuple(words[1:1 + words[0]]))


def _signature_hash(values: Any) -> int:
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def collective_op(what: str, fields: tuple[SignatureField, ...]) -> tuple[str, tuple[SignatureField, ...]]:
    """Register an op whose calls are agreed (`agree_call`) under its name `what`, with its signature `fields`;
    returns both, for `agree_call`. Registered at import, so any rank can name the op another rank is at."""
    if _HEADER_WORDS + sum(_WORDS[f.kind] for f in fields) > _RECORD_WORDS:
        raise ValueError(f"{what}: its signature needs more than the {_RECORD_WORDS} words of a call record")
    _OPS[_signature_hash(what)] = what
    return what, fields


def agree_call(group: Any, op: tuple[str, tuple[SignatureField, ...]], values: Mapping[str, Any], *,
               device: Any, rejected: BaseException | None = None) -> int:
    """Agree one call of a collective op (`op`: its name and signature fields, from `collective_op`) across `group`
    before it exchanges anything: the op every rank is at, every rank's signature (`values` of the fields) and its
    count of calls agreed in this group, with one all-gather of a small fixed-size int64 tensor on `device` (the
    CPU for gloo; the rank's accelerator for NCCL). Returns the call's number. Collective: every rank of the group
    calls it at the same point.

    Ranks at different ops (a rank that skipped a backward is at its next forward), or that differ in any field or
    in the count, raise the same AgreementError on every rank, naming each field that differs and each rank's
    value. A rank whose call was `rejected` by its own checks takes part all the same, so the others do not wait:
    they raise an AgreementError naming it (the caller re-raises its own error there).

    What is caught, and what is not, without waiting for a timeout: collectives pair in the order each rank issues
    them, so a rank's extra call pairs with the others' next call. With another signature (other shards, options,
    or a backward recorded on one side only — an evaluation call under ``no_grad`` on one rank) the fields that
    differ are named, on every rank. With the same signature it is indistinguishable from the next call (no record
    a rank can carry tells them apart), so its results pair shards of different steps; where the others never call
    again, it waits for the group's timeout (``init_process_group(timeout=)``) and raises an AgreementError
    saying so — after which gloo has closed the group's connections and NCCL aborts the communicator, so every
    later collective of that group fails too. The call number (counted on every rank before the collective,
    whatever its outcome) numbers the calls in these errors and names a rank whose count went out of step while
    the group stayed usable."""
    import torch
    import torch.distributed as dist

    what, fields = op
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise AgreementError(
            f"{what}: called while a CUDA graph is being captured, but the ranks agree each call with a collective "
            "whose result the host reads, which a capture cannot hold. Fix: call it outside the captured region")
    pg = group if group is not None else dist.group.WORLD
    call = _CALLS.get(pg, 0) + 1
    _CALLS[pg] = call  # counted whatever happens below, on every rank alike
    ordered = [values[f.name] for f in fields]
    words = [_MAGIC, _signature_hash(what), len(fields), call, _signature_hash(ordered), int(rejected is not None)]
    for f, value in zip(fields, ordered):
        words += _encode(f.kind, value)
    words += [0] * (_RECORD_WORDS - len(words))
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    parts = [torch.empty_like(mine) for _ in range(size)]
    try:
        dist.all_gather(parts, mine, group=group)
    except Exception as exc:
        raise AgreementError(
            f"{what}: the ranks of the group could not agree call {call} in this group before exchanging anything: "
            f"the collective failed ({type(exc).__name__}: {str(exc)[:300]}). Every rank of the group must call it "
            "at the same point, the same number of times; a rank that calls it while the others do not waits for "
            "the group's timeout. Fix: call it on every rank of the group (not inside a rank-dependent branch), "
            "the same number of times") from exc
    rows = torch.stack(parts).cpu().tolist()  # on an accelerator, one host sync per call (docs/architecture.md)
    if rejected is not None or all(row == rows[0] for row in rows):
        return call  # a rejected call: the caller raises its own error, which says more than a list of fields
    raise AgreementError(_disagreeing_calls(what, fields, rows))


def _disagreeing_calls(what: str, fields: tuple[SignatureField, ...], rows: list[list[int]]) -> str:
    def by_value(texts: list[str]) -> str:  # "a on ranks 0, 1; b on rank 2"
        groups: dict[str, list[int]] = {}
        for r, text in enumerate(texts):
            groups.setdefault(text, []).append(r)
        return "; ".join(f"{text} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                         for text, rs in groups.items())

    if any(row[0] != _MAGIC for row in rows):
        return (f"{what}: the ranks of the group run different versions of opdispatch (their call records differ in "
                "form), so nothing was exchanged. Fix: install one opdispatch version on every host")
    if len({row[1] for row in rows}) > 1:
        ops = by_value([_OPS.get(row[1], f"an op unknown here (#{row[1]:x})") for row in rows])
        return (f"opdispatch: the {len(rows)} ranks of the group are at different collective calls: {ops}; nothing "
                "was exchanged. Every rank of the group must make the same calls in the same order. Fix: run the "
                "backward on every rank or on none, and call each op the same number of times on every rank (never "
                "inside a rank-dependent branch)")
    if any(row[2] != len(fields) for row in rows):
        return (f"{what}: the ranks of the group run different versions of opdispatch (their call records differ in "
                "form), so nothing was exchanged. Fix: install one opdispatch version on every host")
    lines, fixes = [], []
    rejected = [r for r, row in enumerate(rows) if row[5]]
    if rejected:
        lines.append(f"  rejected by its own checks on rank{'s' if len(rejected) > 1 else ''} "
                     f"{', '.join(map(str, rejected))} (each raises its own error there, which says why)")
        fixes.append("fix the call the error on those ranks names")
    if len({row[3] for row in rows}) > 1:
        lines.append(f"  call number in this group: {by_value([str(row[3]) for row in rows])}")
        fixes.append("call it the same number of times on every rank, never inside a rank-dependent branch (a "
                     "rank's count runs ahead when one of its calls failed on it alone, before or inside the "
                     "collective)")
    offset = _HEADER_WORDS
    for f in fields:
        width = _WORDS[f.kind]
        texts = [_decode(f.kind, row[offset:offset + width]) for row in rows]
        if len({tuple(row[offset:offset + width]) for row in rows}) > 1 and not rejected:
            lines.append(f"  {f.name}: {by_value(texts)}")
            fixes.append(f.fix)
        offset += width
    if not lines:  # only the hash differs: a text field longer than its 16 bytes
        lines.append("  a text field beyond its first 16 bytes")
    return (f"{what}: the {len(rows)} ranks of the group did not make the same call, so nothing was exchanged:\n"
            + "\n".join(lines) + "\nEvery rank of the group must call it at the same point with the same arguments. "
            "Fix: " + "; ".join(dict.fromkeys(fixes)))
