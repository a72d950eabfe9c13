"""Measured autotune for any op with a tuning description (`OpSpec.tuning`): time every eligible implementation
on each case (a call signature without data) and keep the ranking per shape bucket in a tuned table
(policies/opdispatch/policies/_tuned_table.py) that a policy references with ``autotune: <path>``.

The op's spec says what a case is, its presets and how a call falls into a bucket; this module times
(core/opdispatch/tools/_timing.py) and writes the table with the device's fingerprint
(core/opdispatch/base/_fingerprint.py).
`opdispatch tune` and `opdispatch bench` (core/opdispatch/tools/_bench.py) are its command line.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..base._cases import (ALL, TuningCase, grid, known_fields, load_cases, preset, preset_names, random_tensor,
                          tuning_of)
from ..base._fingerprint import device_fingerprint
from ._timing import Progress, Spread, resolve_device, time_samples

if TYPE_CHECKING:
    from opdispatch.policies._tuned_table import TunedTable

__all__ = ["ALL", "Measurement", "TuningCase", "grid", "known_fields", "load_cases", "measure", "preset",
           "preset_names", "random_tensor", "tune", "tuning_of"]

# -- measuring -------------------------------------------------------------------------------------------------

@dataclass
class Measurement:
    """The timings of one case: each timed implementation's spread over the reps (its median is `seconds`),
    failures, the policy's pick, the bucket."""

    case: TuningCase
    call: str
    spreads: dict[str, Spread]
    failed: dict[str, str]
    skipped: dict[str, str]
    pick: str | None
    flops: float
    features: tuple[tuple[Any, ...], tuple[int, ...]] | None = None

    @property
    def seconds(self) -> dict[str, float]:
        """Median seconds per call of each timed implementation."""
        return {impl_id: spread.median for impl_id, spread in self.spreads.items()}

    def noisy(self) -> list[str]:
        """The implementations whose timings here spread too widely to rank (`Spread.noisy`)."""
        return [impl_id for impl_id, spread in self.spreads.items() if spread.noisy]

    @property
    def fastest(self) -> str | None:
        ranking = self.ranking()
        return ranking[0] if ranking else None

    def ranking(self) -> list[str]:
        return sorted(self.spreads, key=lambda impl_id: self.spreads[impl_id].median)

    def tflops(self, impl_id: str) -> float:
        return self.flops / self.spreads[impl_id].median / 1e12

    @property
    def regret(self) -> float | None:
        """time(pick) / time(fastest) - 1, or None when the pick was not timed."""
        fastest = self.fastest
        if self.pick is None or self.pick not in self.spreads or fastest is None:
            return None
        return self.spreads[self.pick].median / self.spreads[fastest].median - 1.0


def _matches_filter(impl_id: str, patterns: Sequence[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(impl_id, p) for p in patterns)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _runner(impl: Any, call: Any, inputs: dict[str, Any], requires_grad: bool) -> Callable[[], Any]:
    """What one timed rep runs: the forward, or forward + backward into every input that requires grad (with
    random output gradients, drawn once)."""
    if not requires_grad:
        return lambda: impl.run(call)
    leaves = [t for t in _tensors(list(inputs.values())) if t.requires_grad]
    grads = [torch.randn_like(t) for t in _tensors(impl.run(call)) if t.requires_grad]

    def step() -> None:
        outs = [t for t in _tensors(impl.run(call)) if t.requires_grad]
        torch.autograd.grad(outs, leaves, grads, allow_unused=True)

    return step


def measure(cases: Sequence[TuningCase], *, op: str = "attention", manager: Any = None,
            device: torch.device | str | None = None, impls: Sequence[str] | None = None, warmup: int = 3,
            reps: int = 10, progress: bool = True, seed: int = 0) -> list[Measurement]:
    """Time every eligible implementation of `op` (matching the `impls` globs) on each case.

    Each case gets fresh random inputs shared by its implementations; an implementation that raises is recorded
    under `failed` and left out of the ranking. `pick` is what the manager's policy chooses today.
    """
    import opdispatch
    from ..base._errors import OpDispatchError

    tuning = tuning_of(op)
    manager = manager or opdispatch.get_manager()
    manager.ensure_initialized()
    device = resolve_device(device)
    info = manager.device_info(device)
    registered = [r.impl for r in manager.registry.for_op(op) if _matches_filter(r.impl.id, impls)]
    # One progress step per case, naming what is timed: implementations that cannot run here print nothing per
    # case (the commands summarise them once).
    bar = Progress(len(cases), progress)
    generator = torch.Generator(device=device).manual_seed(seed)
    results = []
    try:
        for case in cases:
            inputs = case.inputs(device, generator)
            call = tuning.validate(**inputs)
            try:
                pick = manager.resolve(op, call).chosen_id
            except OpDispatchError:
                pick = None
            spreads: dict[str, Spread] = {}
            failed: dict[str, str] = {}
            skipped: dict[str, str] = {}
            runnable = []
            for impl in registered:
                reason = manager.availability(impl, info)
                if reason is None:
                    reasons = impl.not_supported_reasons(call, info)
                    reason = "; ".join(reasons) if reasons else None
                if reason is not None:
                    skipped[impl.id] = reason
                else:
                    runnable.append(impl)
            bar.step(f"{case.describe()}: " + (", ".join(i.id for i in runnable) or "nothing can run it here"))
            for impl in runnable:
                try:
                    run = _runner(impl, call, inputs, case.requires_grad)
                    spreads[impl.id] = Spread.of(time_samples(run, device, warmup=warmup, reps=reps))
                except Exception as exc:  # a kernel that fails on this shape is not a candidate for it
                    failed[impl.id] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results.append(Measurement(case, call.describe(), spreads, failed, skipped, pick, case.flops(),
                                       tuning.bucket(call)))
            del inputs, call
    finally:
        bar.close()
    return results


def tune(cases: Sequence[TuningCase], *, op: str = "attention", manager: Any = None,
         device: torch.device | str | None = None, impls: Sequence[str] | None = None, warmup: int = 3,
         reps: int = 10, progress: bool = True, seed: int = 0) -> TunedTable:
    """Measure `cases` of `op` on this device and return the tuned table (save it with `.save(path)`)."""
    import opdispatch

    manager = manager or opdispatch.get_manager()
    results = measure(cases, op=op, manager=manager, device=device, impls=impls, warmup=warmup, reps=reps,
                      progress=progress, seed=seed)
    return tuned_table(results, op=op, manager=manager, device=device, impls=impls, warmup=warmup, reps=reps)


def tuned_table(results: Sequence[Measurement], *, op: str, manager: Any, device: torch.device | str | None,
                impls: Sequence[str] | None, warmup: int, reps: int) -> TunedTable:
    """The tuned table of `measure`'s results (what `tune` returns)."""
    from opdispatch.policies._tuned_table import TunedEntry, TunedTable

    info = manager.device_info(resolve_device(device))
    entries = []
    for m in results:
        if not m.seconds or m.features is None:
            continue
        discrete, sizes = m.features
        entries.append(TunedEntry(discrete, sizes, m.ranking(), {i: s * 1e6 for i, s in m.seconds.items()},
                                  m.failed, m.case.describe()))
    return TunedTable(device_fingerprint(info), entries, op=op, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      settings={"warmup": warmup, "reps": reps, "impls": list(impls) if impls else ["*"]})
