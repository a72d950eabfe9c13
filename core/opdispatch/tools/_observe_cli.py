"""`opdispatch stats` and `opdispatch decisions export|diff` (registered on the `opdispatch` command by
`add_observe_commands`; torch is imported only when a command runs)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_observe_commands"]


def add_observe_commands(sub: Any) -> None:
    p = sub.add_parser("stats", help="usage statistics of this process (a running job's: OPDISPATCH_STATS=1 prints "
                                     "them to stderr at exit)")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON instead of a table")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("decisions", help="a decision lockfile: export the decisions of a set of calls, or diff a "
                                         "file against this host (replay one with OPDISPATCH_DECISIONS=FILE)")
    decisions = p.add_subparsers(dest="decisions_command", required=True)
    export = decisions.add_parser("export", help="decide a set of calls (like `tune`: --preset or --shapes) and "
                                                 "write every decided class to FILE")
    export.add_argument("file", help="the lockfile to write (YAML)")
    export.add_argument("--op", action="append", default=[], help="op(s) to decide (repeatable; default: "
                                                                  "attention)")
    export.add_argument("--preset", default="all", help="call signatures from the op's presets (default: all)")
    export.add_argument("--shapes", default=None, help="YAML file of call signatures instead of a preset (one --op)")
    _device_args(export)
    export.set_defaults(func=cmd_decisions_export)
    diff = decisions.add_parser("diff", help="the classes of FILE that would decide differently here, or whose "
                                             "implementation is gone or changed version (exit status 1 if any)")
    diff.add_argument("file", help="a lockfile written by `opdispatch decisions export`")
    _device_args(diff)
    diff.set_defaults(func=cmd_decisions_diff)


def _device_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--on", default=None, help="torch device (default: cuda if available, else cpu)")
    group.add_argument("--device", default=None, help="simulate a device from a YAML descriptor (calls without "
                                                      "data)")


def _device(args: argparse.Namespace) -> Any:
    import torch

    from ..base._device import resolve_device

    from ..engine._current import get_manager

    if args.device:
        return resolve_device(args.device)
    if args.on:
        from ._timing import usable_device

        return get_manager().device_info(usable_device(args.on))
    local = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return get_manager().device_info(local)


def cmd_stats(args: argparse.Namespace) -> int:
    from ..engine._current import stats

    snapshot = stats()
    print(json.dumps(snapshot.to_dict(), indent=2) if args.json else snapshot.format())
    return 0


def cmd_decisions_export(args: argparse.Namespace) -> int:
    import torch

    from ..engine._current import get_manager
    from ..engine._decisions_lock import _entry, write_lock
    from ._tuning import load_cases, preset

    ops = args.op or ["attention"]
    if args.shapes and len(ops) != 1:
        raise ValueError(f"--shapes describes the calls of one op; got --op {', '.join(ops)}")
    info = _device(args)
    manager = get_manager()
    where = torch.device("meta") if info.simulated else torch.device(info.type, info.index or 0)
    entries: dict[Any, Any] = {}
    undecided = []
    from ..base._decision import NoImplementationError, PinnedImplementationError
    from ._tuning import tuning_of

    for op in ops:  # every input is checked before anything is written
        cases = load_cases(args.shapes, op) if args.shapes else preset(args.preset, info.type, op)
        tuning = tuning_of(op)
        for case in cases:
            call = tuning.validate(**case.inputs(where, None))
            try:
                decision = manager.resolve(op, call, device=info)
            except (NoImplementationError, PinnedImplementationError) as exc:
                undecided.append(f"{case.describe()}: {str(exc).splitlines()[0]}")
                continue
            entry = _entry(decision, case.to_dict())
            entries.setdefault(entry.key, entry)
    if not entries:
        raise ValueError("no call of the set could be decided on this device; nothing written:\n  "
                         + "\n  ".join(undecided))
    write_lock(args.file, list(entries.values()), info, manager.policy)
    print(f"wrote {len(entries)} decided class(es) of {', '.join(ops)} on {info.describe()} to {args.file}")
    for line in undecided:
        print(f"not decided (no implementation can take it here): {line}", file=sys.stderr)
    return 0


def cmd_decisions_diff(args: argparse.Namespace) -> int:
    from ..engine._current import diff_decisions
    from ..engine._decisions_lock import load_lock

    lock = load_lock(args.file)
    info = _device(args)
    drift = diff_decisions(args.file, device=info)
    compared = [e for e in lock.entries if e.device_type == info.type]
    print(f"{args.file}: {len(lock.entries)} recorded class(es), {len(compared)} for {info.type} compared on "
          f"{info.describe()}")
    if lock.fingerprint:
        from ..base._fingerprint import device_fingerprint

        now = device_fingerprint(info)
        changed = [f"{k}: {lock.fingerprint.get(k, 'absent')} -> {now.get(k, 'absent')}"
                   for k in sorted(set(lock.fingerprint) | set(now)) if lock.fingerprint.get(k) != now.get(k)]
        if changed:
            print("fingerprint differs: " + "; ".join(changed))
    if not drift:
        print("no drift: every compared class decides as recorded")
        return 0
    print(f"{len(drift)} class(es) drifted:")
    for d in drift:
        print(f"  - {d.describe()}")
    return 1
