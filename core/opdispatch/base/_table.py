"""Plain-text tables for the command line: columns padded to their widest cell, the last column wrapped to fit
a terminal's width (`--wide` turns wrapping off)."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

# The narrowest the wrapped column gets beside the others; on a terminal too narrow for that, the last column goes
# on its own indented lines under each row.
MIN_WRAPPED = 40
STACKED_INDENT = 4


def terminal_width(wide: bool = False) -> int | None:
    """The width to wrap tables to: the terminal's (COLUMNS, else 100 off a terminal), or None with `wide`."""
    return None if wide else shutil.get_terminal_size((100, 24)).columns


def format_table(rows: Sequence[Sequence[str]], *, width: int | None = None, rule: bool = False) -> list[str]:
    """Lines of `rows` (the first is the header): every column but the last padded to its widest cell; the last
    wrapped so that each line fits `width` (None: never wrapped), continuation lines indented to its column.
    `rule` draws a line of dashes under the header."""
    if not rows:
        return []
    fixed = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(fixed)]
    indent = sum(widths) + 2 * fixed
    stacked = width is not None and width - indent < MIN_WRAPPED
    if stacked:
        indent = STACKED_INDENT
    room = None if width is None else width - indent
    table = list(rows)
    if rule:
        table.insert(1, tuple("-" * w for w in widths) + ("-" * min(7, max(len(r[-1]) for r in rows)),))
    lines = []
    for n, r in enumerate(table):
        lead = "".join(r[i].ljust(widths[i]) + "  " for i in range(fixed))
        last = r[-1]
        parts = textwrap.wrap(last, room, break_on_hyphens=False) if room and len(last) > room else [last]
        if stacked and n > (1 if rule else 0):  # a body row: the last column under it, if it says anything
            lines.append(lead.rstrip())
            if last not in ("", "-"):
                lines.extend(" " * indent + part for part in parts)
            continue
        lines.append((lead + parts[0]).rstrip() if not stacked else (lead + last).rstrip()[:width])
        if not stacked:
            lines.extend(" " * indent + part for part in parts[1:])
    return lines


def format_fields(fields: Sequence[tuple[str, str]], *, width: int | None = None) -> list[str]:
    """Header lines `label:  value`, the values aligned and wrapped like a table's last column (continuation lines
    indented to the values; never narrower than `MIN_WRAPPED`). None: one line per field, all of it."""
    indent = max((len(label) for label, _ in fields), default=0) + 3  # the colon and two spaces
    room = None if width is None else max(width - indent, MIN_WRAPPED)
    lines = []
    for label, value in fields:
        parts = textwrap.wrap(value, room, break_on_hyphens=False) if room and len(value) > room else [value]
        lines.append(f"{label}:".ljust(indent) + parts[0])
        lines.extend(" " * indent + part for part in parts[1:])
    return lines
