"""Draw a Chrome/Kineto trace of `benchmarks/trace_layer.py` as a PNG timeline: opdispatch's ranges and the kernels
they launched.

One lane per host thread (the caller's; on CUDA also autograd's backward thread), its ops nested by depth, every
``opdispatch.<op>[<implementation>]`` range coloured by op and labelled; on CUDA one lane per GPU stream with its
kernels, those a range launched in its colour (backward ones hatched), and a band from each range (or the backward
nodes of its forward ops) to its kernels. Needs only matplotlib and the JSON, so a trace taken on a GPU machine is
drawn anywhere:

    python benchmarks/render_trace.py trace-h100.json.gz --out docs/images/trace-h100.png

The trace analysis (ranges, what each launched, forward and backward) is shared with trace_layer.py's summary.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RANGE_PREFIX = "opdispatch."
RANGE_NAME = re.compile(r"^opdispatch\.(?P<op>[A-Za-z0-9_]+)\[(?P<impl>[^\]]+)\](?P<part>\.backward)?$")
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# Slices that end within this many µs of an enclosing one still nest (Kineto rounds ts and dur separately).
NEST_SLACK_US = 0.01


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace (`.json`, or gzipped `.json.gz`), checked to hold `traceEvents`."""
    path = Path(path)
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (a JSON object with a traceEvents list); export one with "
                         "torch.profiler's export_chrome_trace or benchmarks/trace_layer.py")
    return data


def write_trace(data: dict[str, Any], path: str | Path) -> int:
    """Write `data` compactly, gzipped when `path` ends in .gz; returns the bytes written."""
    text = json.dumps(data, separators=(",", ":")).encode()
    blob = gzip.compress(text, mtime=0) if str(path).endswith(".gz") else text
    Path(path).write_bytes(blob)
    return len(blob)


def split_range_name(name: str) -> tuple[str, str, bool] | None:
    """(op, implementation, is_backward) of an opdispatch range's name; None for any other name."""
    m = RANGE_NAME.match(name)
    return (m["op"], m["impl"], bool(m["part"])) if m else None


def _slices(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"]) + float(e["dur"])


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return (inner is not outer and inner["pid"] == outer["pid"] and inner["tid"] == outer["tid"]
            and inner["ts"] >= outer["ts"] and _end(inner) <= _end(outer) + NEST_SLACK_US)


def _correlation(e: dict[str, Any]) -> int | None:
    value = (e.get("args") or {}).get("correlation")
    return int(value) if isinstance(value, (int, float)) else None


@dataclass
class RangeReport:
    """One opdispatch range: the host slice, the ops under it, and the device work it (and its backward) caused.

    On a GPU trace `kernels` are the device slices (kernels, copies, memsets) launched inside the range;
    `backward_kernels` those launched by the autograd nodes of its forward ops. On a CPU trace there are none:
    `top_ops` (the ops directly under the range) and `backward_nodes` are what ran."""

    event: dict[str, Any]
    op: str
    impl: str
    is_backward: bool
    ops: list[dict[str, Any]] = field(default_factory=list)
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    backward_nodes: list[dict[str, Any]] = field(default_factory=list)
    backward_kernels: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.event["name"])


@dataclass
class TraceAnalysis:
    events: list[dict[str, Any]]
    host_slices: list[dict[str, Any]]
    device_slices: list[dict[str, Any]]
    ranges: list[RangeReport]
    thread_names: dict[tuple[Any, Any], str]
    process_labels: dict[Any, str]

    @property
    def on_gpu(self) -> bool:
        return bool(self.device_slices)


def _outermost(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cpu_ops = [o for o in ops if o.get("cat") == "cpu_op"]
    return [o for o in cpu_ops if not any(_inside(o, other) for other in cpu_ops)]


def analyse(data: dict[str, Any]) -> TraceAnalysis:
    """Every opdispatch range of the trace with the ops under it, its kernels (matched to the launches under it by
    their correlation id), and its backward: the autograd nodes that torch.profiler's forward-backward flows link
    to the range's forward ops, with their ops and kernels."""
    events = data["traceEvents"]
    slices = _slices(events)
    host = [e for e in slices if e.get("cat") in HOST_CATEGORIES]
    device = [e for e in slices if e.get("cat") in DEVICE_CATEGORIES]
    by_correlation: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in device:
        c = _correlation(e)
        if c is not None:
            by_correlation[c].append(e)
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in host:
        by_thread[(e["pid"], e["tid"])].append(e)

    def under(outer: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in by_thread[(outer["pid"], outer["tid"])] if _inside(e, outer)]

    def launched(host_events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        found = [k for e in host_events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                 for k in by_correlation.get(_correlation(e) or -1, [])]
        return sorted({id(k): k for k in found}.values(), key=lambda k: k["ts"])

    # Forward-backward flows: 's' at a forward op's start, 'f' inside the backward node run for it.
    flow_start: dict[Any, dict[str, Any]] = {}
    flow_end: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e.get("cat") == "fwdbwd" and e.get("ph") in ("s", "f"):
            (flow_start if e["ph"] == "s" else flow_end)[e["id"]] = e

    def backward_node(point: dict[str, Any]) -> dict[str, Any] | None:
        enclosing = [e for e in by_thread[(point["pid"], point["tid"])]
                     if e["ts"] <= point["ts"] <= _end(e) and e.get("cat") == "cpu_op"]
        nodes = [e for e in enclosing if str(e["name"]).startswith(BACKWARD_NODE)]
        pool = nodes or [e for e in enclosing if e["ts"] == point["ts"]]
        return min(pool, key=lambda e: e["ts"]) if pool else None

    reports = []
    for e in host:
        parts = split_range_name(str(e["name"])) if e.get("cat") == "user_annotation" else None
        if parts is None:
            continue
        report = RangeReport(e, *parts)
        report.ops = under(e)
        report.top_ops = _outermost(report.ops)
        report.kernels = launched(report.ops)
        starts = {(o["pid"], o["tid"], o["ts"]) for o in report.ops if o.get("cat") == "cpu_op"}
        nodes: dict[int, dict[str, Any]] = {}
        for flow_id, s in flow_start.items():
            f = flow_end.get(flow_id)
            if f is not None and (s["pid"], s["tid"], s["ts"]) in starts:
                node = backward_node(f)
                if node is not None:
                    nodes[id(node)] = node
        report.backward_nodes = sorted(nodes.values(), key=lambda n: n["ts"])
        below = [o for n in report.backward_nodes for o in [n, *under(n)]]
        report.backward_kernels = launched(below)
        reports.append(report)
    reports.sort(key=lambda r: r.event["ts"])

    thread_names: dict[tuple[Any, Any], str] = {}
    process_labels: dict[Any, str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "thread_name":
            thread_names[(e["pid"], e["tid"])] = str((e.get("args") or {}).get("name", ""))
        elif e.get("name") == "process_labels":
            process_labels[e["pid"]] = str((e.get("args") or {}).get("labels", ""))
    return TraceAnalysis(events, host, device, reports, thread_names, process_labels)


def short_kernel_name(name: str, width: int = 70) -> str:
    """A kernel's name without `void `, its template arguments and its parameter list, at most `width` chars."""
    name = re.sub(r"^void ", "", name)
    out, depth = [], 0
    for ch in name:  # drop everything inside <...> and (...)
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    short = "".join(out).strip() or name
    return short if len(short) <= width else short[: width - 1] + "…"


# ---------------------------------------------------------------------------------------------------------- drawing

OP_COLOURS = {"attention": "#d62728", "rms_norm": "#1f77b4", "rotary_embedding": "#2ca02c"}
SPARE_COLOURS = ("#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
OTHER = "#c7c7c7"


def _colour(op: str, assigned: dict[str, str]) -> str:
    if op not in assigned:
        assigned[op] = OP_COLOURS.get(op) or SPARE_COLOURS[len(assigned) % len(SPARE_COLOURS)]
    return assigned[op]


def _depths(events: list[dict[str, Any]]) -> dict[int, int]:
    """Each slice's nesting depth on its thread (0 = outermost)."""
    depth: dict[int, int] = {}
    stack: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and not _inside(e, stack[-1]):
            stack.pop()
        depth[id(e)] = len(stack)
        stack.append(e)
    return depth


def render(data: dict[str, Any], out: str | Path, *, width_px: int = 1600, dpi: int = 100,
           title: str | None = None, max_depth: int = 4) -> tuple[int, int]:
    """Draw `data` (a Chrome trace) to the PNG `out`, `width_px` wide; returns the image's (width, height)."""
    if width_px < 400:
        raise ValueError(f"width_px={width_px}: too narrow to label the ranges; use 400 or more (1600 is the default)")
    if max_depth < 1:
        raise ValueError(f"max_depth={max_depth}: must be at least 1 (the outermost host ops)")
    a = analyse(data)
    if not a.ranges:
        raise ValueError("the trace holds no opdispatch.<op>[<implementation>] range: was it recorded with "
                         "opdispatch's profiler ranges (torch.profiler active while calls were dispatched)?")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    shown_host = [e for e in a.host_slices if e.get("cat") in ("cpu_op", "user_annotation")]
    t0 = min(float(e["ts"]) for e in shown_host + a.device_slices)
    t1 = max(_end(e) for e in shown_host + a.device_slices)
    span_us = (t1 - t0) or 1.0
    scale = 1e-3  # µs -> ms on the axis
    span = span_us * scale

    def x(ts: float) -> float:
        return (ts - t0) * scale

    host_threads = sorted({(e["pid"], e["tid"]) for e in shown_host},
                          key=lambda t: min(e["ts"] for e in shown_host if (e["pid"], e["tid"]) == t))
    streams = sorted({(e["pid"], e["tid"]) for e in a.device_slices}, key=str)
    depth = _depths(shown_host)
    thread_depth = {t: min(max_depth, 1 + max(depth[id(e)] for e in shown_host if (e["pid"], e["tid"]) == t))
                    for t in host_threads}
    row_h, gap, label_h = 0.8, 0.9, 0.9
    label_rows = min(len(a.ranges), 4)
    # Lanes from the top: the labels, each host thread (a row per depth), each GPU stream, room for the legend.
    lanes: dict[tuple[Any, Any], float] = {}
    y = label_rows * label_h + 0.3
    for t in host_threads:
        lanes[t] = y
        y += thread_depth[t] * row_h + gap
    for s in streams:
        lanes[s] = y
        y += 2 * row_h + gap
    height_units = y + 1.6
    height_px = int(70 * height_units + 110)
    fig, ax = plt.subplots(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    fig.subplots_adjust(left=0.14, right=0.99, top=1 - 45 / height_px, bottom=55 / height_px)
    px_per_ms = width_px * 0.85 / (span * 1.02)
    char_px = 6.2  # at fontsize 7.5 and 100 dpi

    def boxed_text(x0: float, width_ms: float, y_mid: float, text: str, colour: str = "black") -> None:
        if width_ms * px_per_ms > 8 * char_px:  # only where a few characters fit; clipped to the box
            fits = int(width_ms * px_per_ms / char_px) - 1
            ax.text(x0 + 3 / px_per_ms, y_mid, text if len(text) <= fits else text[: fits - 1] + "…",
                    va="center", ha="left", fontsize=7.5, color=colour, clip_on=True)

    assigned: dict[str, str] = {}
    for r in a.ranges:
        _colour(r.op, assigned)
    kernel_owner: dict[int, tuple[RangeReport, bool]] = {}
    host_owner: dict[int, tuple[RangeReport, str]] = {}  # 'range', 'under' (an op under it) or 'backward'
    for r in a.ranges:
        for k in r.kernels:
            kernel_owner[id(k)] = (r, False)
        for k in r.backward_kernels:
            kernel_owner.setdefault(id(k), (r, True))
        host_owner[id(r.event)] = (r, "range")
        for o in r.ops:
            host_owner.setdefault(id(o), (r, "under"))
    for r in a.ranges:
        for n in r.backward_nodes:
            for o in [n, *(e for e in shown_host if _inside(e, n))]:
                host_owner.setdefault(id(o), (r, "backward"))

    for e in shown_host:
        d = depth[id(e)]
        if d >= max_depth:
            continue
        top = lanes[(e["pid"], e["tid"])] + d * row_h
        owner = host_owner.get(id(e))
        hatch, edge = None, "none"
        if owner is None:
            colour, alpha = OTHER, 0.8
        elif owner[1] == "range":
            colour, alpha, edge = assigned[owner[0].op], 0.95, "black"
        elif owner[1] == "under":
            colour, alpha = assigned[owner[0].op], 0.4
        else:
            colour, alpha, hatch = assigned[owner[0].op], 0.4, "///"
        width = max(e["dur"] * scale, 1e-5)
        ax.add_patch(Rectangle((x(e["ts"]), top), width, row_h * 0.9, facecolor=colour, alpha=alpha, hatch=hatch,
                               edgecolor=edge, linewidth=0.6))
        if owner is None or owner[1] != "range":  # ranges are labelled above
            boxed_text(x(e["ts"]), width, top + row_h * 0.45, str(e["name"]).removeprefix(BACKWARD_NODE))
    for e in a.device_slices:
        top = lanes[(e["pid"], e["tid"])]
        owned = kernel_owner.get(id(e))
        colour = assigned[owned[0].op] if owned else OTHER
        width = max(e["dur"] * scale, 1e-5)
        ax.add_patch(Rectangle((x(e["ts"]), top), width, 2 * row_h * 0.9, facecolor=colour,
                               hatch="///" if owned and owned[1] else None, edgecolor="white", linewidth=0.3,
                               alpha=0.9))
        boxed_text(x(e["ts"]), width, top + row_h * 0.9, short_kernel_name(str(e["name"])))

    # Bands from a range (or its backward nodes) down to the span of the kernels it launched.
    def band(host_events: list[dict[str, Any]], kernels: list[dict[str, Any]], colour: str) -> None:
        if not host_events or not kernels:
            return
        h = host_events[0]
        h_bottom = lanes[(h["pid"], h["tid"])] + (depth[id(h)] + 0.9) * row_h
        k_top = lanes[(kernels[0]["pid"], kernels[0]["tid"])]
        hx0, hx1 = x(min(e["ts"] for e in host_events)), x(max(_end(e) for e in host_events))
        kx0, kx1 = x(min(k["ts"] for k in kernels)), x(max(_end(k) for k in kernels))
        ax.add_patch(Polygon([(hx0, h_bottom), (hx1, h_bottom), (kx1, k_top), (kx0, k_top)], closed=True,
                             facecolor=colour, alpha=0.15, edgecolor=colour, linewidth=0.6))

    for r in a.ranges:
        band([r.event], r.kernels, assigned[r.op])
        band(r.backward_nodes, r.backward_kernels, assigned[r.op])

    # Labels above the host lanes: each in the row where it lands nearest its range, with a leader line to it.
    row_free = [-0.02 * span] * label_rows
    for r in a.ranges:
        cx = x(r.event["ts"] + r.event["dur"] / 2)
        half = (len(r.name) * 6.6 + 12) / px_per_ms / 2  # fontsize 8.5 in a padded box
        lefts = [min(max(cx - half, free), span * 1.01 - 2 * half) for free in row_free]
        row = min(range(label_rows), key=lambda i: (abs(lefts[i] + half - cx), i))
        left = lefts[row]
        row_free[row] = left + 2 * half + 6 / px_per_ms
        ly = row * label_h + label_h / 2
        top = lanes[(r.event["pid"], r.event["tid"])] + depth[id(r.event)] * row_h
        colour = assigned[r.op]
        ax.plot([left + half, cx], [ly + label_h * 0.3, top], color=colour, linewidth=0.8)
        ax.text(left + half, ly, r.name, ha="center", va="center", fontsize=8.5,
                bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=colour, linewidth=0.9))

    ticks, names = [], []
    for t in host_threads:
        ticks.append(lanes[t] + thread_depth[t] * row_h / 2)
        names.append("host: " + (a.thread_names.get(t) or f"thread {t[1]}"))
    for s in streams:
        ticks.append(lanes[s] + row_h)
        label = a.process_labels.get(s[0]) or f"device {s[0]}"
        names.append(f"{label}: {a.thread_names.get(s) or f'stream {s[1]}'}")
    ax.set_yticks(ticks, names, fontsize=8.5)
    ax.set_ylim(height_units, 0)
    ax.set_xlim(-0.01 * span, span * 1.01)
    ax.set_xlabel("ms from the profiled step's first event", fontsize=9)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    what = "and its kernels" if a.on_gpu else "and the ops under it"
    legend = [Patch(facecolor=assigned[op], label=f"opdispatch.{op}[…] {what}") for op in assigned]
    legend += [Patch(facecolor="white", edgecolor="black", hatch="///", label="its backward (autograd nodes"
                     + (", kernels)" if a.on_gpu else ")")),
               Patch(facecolor=OTHER, label="other ops" + (" and kernels" if a.on_gpu else ""))]
    ax.legend(handles=legend, loc="lower right", fontsize=8, ncols=min(3, len(legend)), framealpha=0.95)
    other = data.get("otherData") or {}
    ax.set_title(title or str(other.get("title") or "opdispatch ranges in a torch.profiler trace"), fontsize=10.5)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    from matplotlib import image

    h, w = image.imread(out).shape[:2]
    return int(w), int(h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a Chrome trace from benchmarks/trace_layer.py (.json or .json.gz)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--width", type=int, default=1600, help="image width in pixels (default 1600)")
    ap.add_argument("--title", default=None, help="the figure's title (default: the trace's otherData.title)")
    ap.add_argument("--max-depth", type=int, default=4, help="host op nesting levels drawn (default 4)")
    args = ap.parse_args(argv)
    w, h = render(load_trace(args.trace), args.out, width_px=args.width, title=args.title, max_depth=args.max_depth)
    print(f"wrote {args.out} ({w}x{h} px)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
