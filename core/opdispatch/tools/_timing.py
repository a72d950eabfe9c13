"""Timing kernels: the median of repeated calls (CUDA events on GPUs, perf_counter on the CPU), device syncs and a
progress line for long runs. Used by `opdispatch tune` / `bench` (core/opdispatch/tools/_tuning.py)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["NOISY_SPREAD", "Progress", "Spread", "resolve_device", "sync", "time_fn", "time_samples", "usable_device"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, *, warmup: int, reps: int,
            min_rep_seconds: float | None = None) -> float:
    """Median seconds per call of `fn` on `device` (see `time_samples`)."""
    return float(statistics.median(time_samples(fn, device, warmup=warmup, reps=reps,
                                                min_rep_seconds=min_rep_seconds)))


# Timings whose interquartile range exceeds this fraction of their median are reported as noisy: the machine was
# busy (another process, clock scaling) and a ranking within that spread means nothing.
NOISY_SPREAD = 0.10


class Spread(NamedTuple):
    """Seconds per call over the timed reps."""

    min: float
    median: float
    max: float
    iqr: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        ordered = sorted(samples)
        if len(ordered) >= 4:
            q1, _, q3 = statistics.quantiles(ordered, n=4)
        else:
            q1, q3 = ordered[0], ordered[-1]
        return cls(ordered[0], float(statistics.median(ordered)), ordered[-1], q3 - q1)

    @property
    def noisy(self) -> bool:
        return self.iqr > NOISY_SPREAD * self.median


def time_samples(fn: Callable[[], Any], device: torch.device, *, warmup: int, reps: int,
                 min_rep_seconds: float | None = None) -> list[float]:
    """Seconds per call of `fn` on `device` in each of `reps` timed reps (CUDA events on GPUs, perf_counter on
    the CPU).

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
    return samples


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


def usable_device(text: str, flag: str = "--on") -> torch.device:
    """The torch device `text` names, checked to exist here: ValueError saying what is wrong and what to pass."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"{flag} {text!r} is not a torch device; pass e.g. cpu, cuda or cuda:1") from None
    if device.type == "cpu" or device.type == "meta":
        return device
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        build = f"this torch build ({torch.__version__})"
        hint = "install a torch build for it, or leave the flag out to use " + (
            "the CPU" if not torch.cuda.is_available() else "the current CUDA device")
        raise ValueError(f"{flag} {text}: {build} sees no {device.type} device; {hint}")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{flag} {text}: there are {count} {device.type} device(s) (indices 0 to {count - 1})")
    return device

