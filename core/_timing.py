"""Timing kernels: the median of repeated calls (CUDA events on GPUs, perf_counter on the CPU), device syncs and a
progress line for long runs. Used by `opdispatch tune` / `bench` (core/_tuning.py)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Progress", "resolve_device", "sync", "time_fn"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, *, warmup: int, reps: int,
            min_rep_seconds: float | None = None) -> float:
    """Median seconds per call of `fn` on `device` (CUDA events on GPUs, perf_counter on the CPU).

    Calls that take less than `min_rep_seconds` are repeated inside one timed rep (the count is calibrated
    during warm-up), so launch jitter does not dominate tiny kernels.
    """
    cuda = device.type == "cuda"
    if min_rep_seconds is None:
        min_rep_seconds = 1e-3 if cuda else 2e-4
    for _ in range(max(warmup, 1)):
        fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    estimate = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(1000, math.ceil(min_rep_seconds / estimate)))
    samples = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
                  for _ in range(reps)]
        for begin, end in events:
            begin.record()
            for _ in range(inner):
                fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [begin.elapsed_time(end) / 1e3 / inner for begin, end in events]
    else:
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - start) / inner)
    return float(statistics.median(samples))


class Progress:
    """A one-line progress bar on stderr (a plain line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool, stream: Any = None) -> None:
        self.total, self.enabled, self.done = max(total, 1), enabled, 0
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 28
        filled = int(width * self.done / self.total)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to time on: the given one, else the current CUDA device if there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
