"""The `opdispatch` command: list, explain, doctor, demo (and policy tools)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..base._errors import OpDispatchError

# Only what a command needs is imported, inside it: `--help`, `--version` and argument errors never import torch
# (seconds); `list`, `explain`, `policy lint` and the rest load the plugins, which do.
if TYPE_CHECKING:
    import torch

    from ..base._device import resolve_device

    from ..engine._current import get_manager
    from ..ops._attention import validate_attention
    from ..base._dtypes import dtype_from_name
    from ..base._device import DeviceInfo
    from ..base._ops import known_ops
    from ..ops._rms_norm import validate_rms_norm
    from ..ops._rotary import validate_rotary_embedding


def _import_runtime() -> None:
    """Bind the names above for real (the commands use them as module globals); run once arguments parsed."""
    import torch

    from ..base._device import resolve_device

    from ..engine._current import get_manager
    from ..ops._attention import validate_attention
    from ..base._dtypes import dtype_from_name
    from ..base._ops import known_ops
    from ..ops._rms_norm import validate_rms_norm
    from ..ops._rotary import validate_rotary_embedding

    globals().update(torch=torch, get_manager=get_manager, resolve_device=resolve_device,
                     dtype_from_name=dtype_from_name, validate_attention=validate_attention, known_ops=known_ops,
                     validate_rms_norm=validate_rms_norm, validate_rotary_embedding=validate_rotary_embedding)


def _ints(text: str, count: int | None = None, what: str = "value", minimum: int | None = None) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be comma-separated integers") from None
    if count is not None and len(values) != count:
        raise argparse.ArgumentTypeError(f"{what} {text!r} needs {count} comma-separated integers")
    if minimum is not None and any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(f"{what} {text!r}: every value must be at least {minimum}")
    return values


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum} (leave the flag out for the "
                                             "default)")
        return value

    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def _device_arg(args: argparse.Namespace) -> DeviceInfo:
    manager = get_manager()
    if args.device:
        info = resolve_device(args.device)
        assert info is not None
        return info
    return manager.device_info(_local_torch_device())


def _local_torch_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# -- list ------------------------------------------------------------------------------------------------------

def cmd_list(args: argparse.Namespace) -> int:
    manager = get_manager()
    manager.ensure_initialized()
    if args.op is not None and args.op not in known_ops():
        raise ValueError(f"--op {args.op!r} is not an op; known ops: {', '.join(known_ops())}")
    device = _device_arg(args)
    from ..base._table import format_fields, format_table, terminal_width
    from opdispatch.policies._plan import standing_plan

    width = terminal_width(args.wide)
    policy = manager.policy
    for line in format_fields([("device", device.describe()), ("policy", f"{policy.source} (hash {policy.hash})"),
                               ("rank", "each op's implementations in the order its policy ranks them before any "
                                        "`when:` rule applies (`opdispatch explain` shows a call's); denied last")],
                              width=width):
        print(line)
    for op in sorted({r.impl.op for r in manager.registry} if args.op is None else {args.op}):
        by_id = {r.impl.id: r for r in manager.registry.for_op(op)}
        plan = standing_plan(policy, op, list(by_id))
        # (id, rank cell, what the policy says of it): a pin first, then the order, the denied ones last.
        pinned = plan.pin[0] if plan.pin is not None and plan.pin[0] in by_id else None
        ranked = [] if pinned is None or plan.pin is None else [
            (pinned, "pin", f"pinned by {plan.pin[1].source}; ")]
        ranked += [(impl_id, str(n), "") for n, (impl_id, _) in
                   enumerate((entry for entry in plan.order if entry[0] != pinned), 1)]
        ranked += [(impl_id, "-", f"denied by {prov.short(impl_id)}; ") for impl_id, prov in plan.denied.items()
                   if impl_id != pinned]  # a pin outranks a deny, as in dispatch
        rows = [(f"{op}:", "rank", "priority", "origin", "available")]
        for impl_id, rank, said in ranked:
            registered = by_id[impl_id]
            impl = registered.impl
            reason = manager.availability(impl, device)
            if reason is not None:
                # Also say which libraries are missing, with their install hints, even when the device rules it out.
                missing = [r.unmet_reason(device) for r in impl.requires]
                extra = [m for m in missing if m and m not in reason]
                if extra:
                    reason = "; ".join([reason, *extra])
            origin = str(registered.origin) if args.wide else registered.origin.plugin
            rows.append((f"  {impl.id}", rank, str(impl.priority), origin,
                         said + ("yes" if reason is None else f"no: {reason}")))
        print()
        for line in format_table(rows, width=width):
            print(line)
    if args.verbose:
        for registered in manager.registry:
            print(f"\n{registered.impl.id}: {registered.impl.description}")
            for key, value in registered.impl.describe_capabilities().items():
                print(f"  {key}: {value}")
    failed = [r for r in manager.plugins if r.status == "failed"]
    for record in failed:
        print(f"\n! {record.describe()}")
    return 0


# -- explain ---------------------------------------------------------------------------------------------------

def _explain_call_args(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    b, s, h, d = _ints(args.shape, 4, "--shape", minimum=1)
    dtype = dtype_from_name(args.dtype)
    hkv = args.kv_heads or h
    sk = args.seqlen_k or s
    dv = args.head_dim_v or d
    dev = "meta" if args.device else device_type
    grad = args.grad
    kw: dict[str, Any] = dict(causal=args.causal, causal_alignment=args.causal_alignment, softcap=args.softcap,
                              dropout_p=args.dropout, return_lse=args.lse, deterministic=args.deterministic)
    if args.window:
        kw["window"] = tuple(_ints(args.window, 2, "--window"))
    if args.varlen:
        layout = "thd"
        q = torch.empty(b * s, h, d, dtype=dtype, device=dev, requires_grad=grad)
        k = torch.empty(b * sk, hkv, d, dtype=dtype, device=dev, requires_grad=grad)
        v = torch.empty(b * sk, hkv, dv, dtype=dtype, device=dev, requires_grad=grad)
        cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
        # Equal lengths are self-attention: one tensor, as validation makes of equal values it can read.
        cu_k = cu_q if sk == s else torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=dev)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=s, max_seqlen_k=sk)
    else:
        layout = args.layout
        from ..ops._attention import LAYOUT_DIMS

        def shape(s_: int, h_: int, d_: int) -> tuple[int, ...]:
            sizes = [0] * 4
            for size, at in zip((b, s_, h_, d_), LAYOUT_DIMS[layout]):
                sizes[at] = size
            return tuple(sizes)

        q = torch.empty(shape(s, h, d), dtype=dtype, device=dev, requires_grad=grad)
        k = torch.empty(shape(sk, hkv, d), dtype=dtype, device=dev, requires_grad=grad)
        v = torch.empty(shape(sk, hkv, dv), dtype=dtype, device=dev, requires_grad=grad)
    if args.alibi:
        kw["alibi_slopes"] = torch.empty(h, dtype=torch.float32, device=dev)
    if args.mask:
        kw["attn_mask"] = torch.ones(s, sk, dtype=torch.bool, device=dev)
    if args.bias:
        kw["attn_bias"] = torch.empty(s, sk, dtype=dtype if dtype.itemsize > 1 else torch.float32, device=dev)
    if dtype.itemsize == 1:  # FP8 (`--dtype fp8_e4m3`): one descale per tensor, bf16 out
        kw.update(q_descale=torch.ones((), device=dev), k_descale=torch.ones((), device=dev),
                  v_descale=torch.ones((), device=dev))
    kw.update(q=q, k=k, v=v, layout=layout)
    return kw


def _rms_norm_call(args: argparse.Namespace, dev: str) -> Any:
    tokens, hidden = _ints(args.shape, 2, "--shape (TOKENS,HIDDEN for rms_norm)", minimum=1)
    dtype = dtype_from_name(args.dtype)
    x = torch.empty(tokens, hidden, dtype=dtype, device=dev, requires_grad=args.grad)
    weight = None if args.no_weight else torch.empty(hidden, dtype=dtype, device=dev, requires_grad=args.grad)
    residual = torch.empty(tokens, hidden, dtype=dtype, device=dev) if args.residual else None
    return validate_rms_norm(x, weight, 1e-6, residual)


def _rotary_call(args: argparse.Namespace, dev: str) -> Any:
    b, s, h, d = _ints(args.shape, 4, "--shape", minimum=1)
    dtype = dtype_from_name(args.dtype)
    hkv = args.kv_heads or h
    rotary_dim = args.rotary_dim or d
    cos = torch.empty(max(s, args.max_positions), rotary_dim // 2, dtype=torch.float32, device=dev)
    kw: dict[str, Any] = dict(interleaved=args.interleaved, check_values=False)
    if args.varlen:
        q = torch.empty(b * s, h, d, dtype=dtype, device=dev, requires_grad=args.grad)
        k = torch.empty(b * s, hkv, d, dtype=dtype, device=dev, requires_grad=args.grad)
        kw.update(layout="thd", cu_seqlens=torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev),
                  max_seqlen=s)
    else:
        q = torch.empty(b, s, h, d, dtype=dtype, device=dev, requires_grad=args.grad)
        k = torch.empty(b, s, hkv, d, dtype=dtype, device=dev, requires_grad=args.grad)
    if args.positions:
        kw["positions"] = torch.zeros(q.shape[:-2], dtype=torch.int64, device=dev)
    return validate_rotary_embedding(q, k, cos, cos, **kw)


def _attention_call(args: argparse.Namespace, dev: str) -> Any:
    kw = _explain_call_args(args, dev)
    return validate_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), check_values=False, **kw)


# How `explain --op` builds a call of each op from the command line (meta tensors on a simulated device).
_EXPLAIN_CALLS = {"attention": _attention_call, "rms_norm": _rms_norm_call, "rotary_embedding": _rotary_call}


def cmd_explain(args: argparse.Namespace) -> int:
    manager = get_manager()
    device = _device_arg(args)
    dev = device.type if not device.simulated else "meta"
    call = _EXPLAIN_CALLS[args.op](args, dev)
    decision = manager.explain(args.op, call, device=device, impl=args.impl)
    if args.json:
        print(json.dumps(decision.to_dict(), indent=2, default=str))
    else:
        from ..base._table import terminal_width

        print(decision.format(width=terminal_width(args.wide)))
    return 0 if decision.chosen is not None else 1


# -- doctor ----------------------------------------------------------------------------------------------------

def cmd_doctor(args: argparse.Namespace) -> int:
    manager = get_manager()
    manager.ensure_initialized()
    device = _device_arg(args)
    try:
        policy = manager.policy
        policy_line, broken = f"{policy.source} (hash {policy.hash})", False
    except OpDispatchError as exc:  # a broken policy is what doctor is for: report it, then the rest
        policy_line, broken = f"BROKEN — {exc}", True
    print(f"opdispatch {__import__('opdispatch').__version__}, torch {torch.__version__}, python "
          f"{sys.version.split()[0]}")
    print(f"device:  {device.describe()}")
    for name, version in sorted(device.libraries.items()):
        print(f"  {name} {version}")
    print(f"policy:  {policy_line}")
    env = {k: v for k, v in os.environ.items() if k.startswith("OPDISPATCH_")}
    print("env:     " + (", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "no OPDISPATCH_* variables"))
    print(f"fast path: {_fast_path_line()}")
    print("plugins:")
    status = 1 if broken else 0
    for record in manager.plugins:
        print(f"  - {record.describe()}")
        if record.impl_ids:
            print(f"      implementations: {', '.join(record.impl_ids)}")
        if record.status == "failed":
            status = 1
            if args.verbose and record.traceback:
                print("      " + record.traceback.replace("\n", "\n      "))
    print("implementations:")
    for registered in manager.registry:
        # With a broken policy there are no configured implementations: ask the registered ones, without options.
        reason = (registered.impl.availability(device) if broken
                  else manager.availability(registered.impl, device))
        print(f"  - {registered.impl.id}: {'available' if reason is None else 'unavailable: ' + reason}")
    return status


def _fast_path_line() -> str:
    from ..base import _native

    try:
        return _native.status().describe()
    except OpDispatchError as exc:  # OPDISPATCH_FAST_PATH=compiled that cannot load, or an unknown mode
        return f"BROKEN — {exc}"


def cmd_build(args: argparse.Namespace) -> int:
    """Compile the per-call fast path for this Python and torch (cached), then say which path is active."""
    from ..base import _native

    try:
        path = _native.build(verbose=args.verbose)
    except OpDispatchError as exc:
        print(f"opdispatch build: {exc}", file=sys.stderr)
        return 1
    _native.reset_status()  # this process decided before the build: decide again
    print(f"built: {path}")
    print(f"fast path: {_fast_path_line()} — new processes take it from import")
    return 0


# -- demo ------------------------------------------------------------------------------------------------------

def demo_calls(device: torch.device) -> list[tuple[str, dict[str, Any]]]:
    """A set of calls a model would make: prefill, decode, GQA, window, softcap, varlen, masks, training."""
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape: int, dtype: torch.dtype = low, grad: bool = False) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    lengths = [5, 17, 64, 3]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    total = sum(lengths)
    return [
        ("prefill, causal, GQA 4:1", dict(q=t(2, 256, 16, 64), k=t(2, 256, 4, 64), v=t(2, 256, 4, 64), causal=True)),
        ("decode, 1 query over a 512-token cache", dict(q=t(4, 1, 8, 128), k=t(4, 512, 8, 128),
                                                          v=t(4, 512, 8, 128), causal=True,
                                                          causal_alignment="bottom_right")),
        ("bhsd layout, bidirectional", dict(q=t(2, 8, 128, 64), k=t(2, 8, 128, 64), v=t(2, 8, 128, 64),
                                            layout="bhsd")),
        ("sliding window (64, 0)", dict(q=t(1, 300, 8, 64), k=t(1, 300, 8, 64), v=t(1, 300, 8, 64), causal=True,
                                        window=(64, 0))),
        ("softcap 30", dict(q=t(2, 128, 8, 64), k=t(2, 128, 8, 64), v=t(2, 128, 8, 64), causal=True,
                            softcap=30.0)),
        ("varlen, 4 uneven sequences", dict(q=t(total, 8, 64), k=t(total, 2, 64), v=t(total, 2, 64), layout="thd",
                                            cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)),
        ("boolean padding mask + lse", dict(q=t(2, 64, 4, 32), k=t(2, 80, 4, 32), v=t(2, 80, 4, 32),
                                            attn_mask=torch.rand(2, 1, 64, 80, generator=gen).to(device) > 0.2,
                                            return_lse=True)),
        ("training step (fp32, backward)", dict(q=t(2, 64, 4, 64, dtype=torch.float32, grad=True),
                                                k=t(2, 64, 4, 64, dtype=torch.float32, grad=True),
                                                v=t(2, 64, 4, 64, dtype=torch.float32, grad=True), causal=True)),
    ]


def demo_other_ops(device: torch.device) -> list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """Calls of the other ops a transformer block makes: (title, op, positional args, keyword args)."""
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(1)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=low)

    theta = torch.arange(4096, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, 64, 2) / 64)
    cos, sin = theta.cos().float().to(device), theta.sin().float().to(device)
    return [
        ("rms_norm + residual add", "rms_norm", (t(64, 1024), 1 + 0.1 * t(1024), 1e-6, t(64, 1024)), {}),
        ("rotary_embedding, GQA, decode offsets", "rotary_embedding", (t(4, 1, 16, 64), t(4, 1, 4, 64), cos, sin),
         {"seqlen_offsets": torch.tensor([7, 100, 512, 4000], device=device)}),
    ]


def _upcast(kw: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in kw.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "alibi_slopes":
            value = value.detach().double().requires_grad_(value.requires_grad)
        out[key] = value
    return out


def _why(decision: Any) -> str:
    return "-" if decision.decided_by is None else decision.decided_by.short(decision.chosen_id)


def cmd_demo(args: argparse.Namespace) -> int:
    import opdispatch

    from ._timing import usable_device

    device = usable_device(args.on) if args.on else _local_torch_device()
    manager = get_manager()
    info = manager.device_info(device)
    print(f"opdispatch demo on {info.describe()}")
    print(f"policy: {manager.policy.source} (hash {manager.policy.hash})")
    print(f"per-call fast path: {_fast_path_line()}\n")
    failures = 0
    for title, kw in demo_calls(device):
        decision = opdispatch.explain(**kw)
        start = time.perf_counter()
        result = opdispatch.attention(**kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        out = result[0] if isinstance(result, tuple) else result
        ref_kw = _upcast(kw)
        expected = opdispatch.attention(**ref_kw, impl="reference.math")
        ref_out = expected[0] if isinstance(expected, tuple) else expected
        tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}.get(out.dtype, 1e-6)
        err = (out.double() - ref_out).abs().max().item()
        ok = err <= tol * max(1.0, ref_out.abs().max().item())
        if isinstance(result, tuple):
            lse_err = (result[1].double() - expected[1]).abs().max().item()
            ok = ok and lse_err <= tol * 10
        if out.requires_grad:
            grad_out = torch.randn_like(out)
            grads = torch.autograd.grad(out, [kw["q"], kw["k"], kw["v"]], grad_out)
            ref_grads = torch.autograd.grad(ref_out, [ref_kw["q"], ref_kw["k"], ref_kw["v"]], grad_out.double())
            gerr = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads))
            ok = ok and gerr <= tol * 10
            err = max(err, gerr)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {title:<40} -> {decision.chosen_id:<16} "
              f"max|err| {err:.2e} (tol {tol:g}) {elapsed:7.2f} ms   [{_why(decision)}]")
        if args.verbose:
            print("    " + str(decision).replace("\n", "\n    "))
    others = demo_other_ops(device)
    for title, op, positional, kw in others:
        decision = getattr(opdispatch, f"explain_{op}")(*positional, **kw)
        start = time.perf_counter()
        result = getattr(opdispatch, op)(*positional, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        wide = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in positional)
        expected = getattr(opdispatch, op)(*wide, **kw, impl=f"reference.{op}")
        outs = result if isinstance(result, tuple) else (result,)
        refs = expected if isinstance(expected, tuple) else (expected,)
        tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}.get(outs[0].dtype, 1e-6)
        err = max((o.double() - r).abs().max().item() for o, r in zip(outs, refs))
        ok = err <= tol * max(1.0, max(r.abs().max().item() for r in refs))
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {title:<40} -> {decision.chosen_id:<16} "
              f"max|err| {err:.2e} (tol {tol:g}) {elapsed:7.2f} ms   [{_why(decision)}]")
        if args.verbose:
            print("    " + str(decision).replace("\n", "\n    "))
    total = len(demo_calls(device)) + len(others)
    print(f"\n{total - failures} passed, {failures} failed")
    return 1 if failures else 0


# -- policy tools ----------------------------------------------------------------------------------------------

def cmd_policy_lint(args: argparse.Namespace) -> int:
    from opdispatch.policies._lint import lint_policy_file

    manager = get_manager()
    manager.ensure_initialized()
    device = resolve_device(args.device) if args.device else None
    ids = {op: [r.impl.id for r in manager.registry.for_op(op)] for op in manager.registry.ops()}
    impls = {op: {r.impl.id: r.impl for r in manager.registry.for_op(op)} for op in manager.registry.ops()}
    status = 0
    for path in args.files:
        findings = lint_policy_file(path, ids, device, impls)
        for finding in findings:
            print(finding)
        if findings:
            status = 1
        else:
            print(f"{path}: ok")
    return status


def cmd_policy_show(args: argparse.Namespace) -> int:
    policy = get_manager().policy
    print(f"policy {policy.source} (hash {policy.hash})")
    print(f"settings: {policy.settings.model_dump()}")
    env = policy.env
    if env.pins or env.prefer or env.deny:
        print(f"env: pins={dict(env.pins)} prefer={list(env.prefer)} deny={list(env.deny)}")
    for layer in policy.layers:
        print(f"\n# {layer.source}\n{layer.text.rstrip()}")
    return 0


# -- ops -------------------------------------------------------------------------------------------------------

def ops_markdown() -> str:
    """Every registered op: its front door's arguments (from the op's one definition) and its `when:` keys."""
    from ..engine._current import get_manager
    from ..base._ops import known_ops, op_spec

    get_manager().ensure_initialized()  # plugins may register ops
    parts = ["# Ops\n", "Generated by `opdispatch ops` from each op's argument definition (`OpSpec.arguments`); "
             "`tests/test_arguments.py` checks that this file is current.\n"]
    for name in known_ops():
        spec = op_spec(name)
        parts.append(f"## `{name}`\n\n{spec.description}.\n")
        if spec.arguments is not None:
            parts.append(f"`opdispatch.{spec.arguments.call_text()}`\n\n{spec.arguments.markdown()}\n")
        keys = ", ".join(f"`{k}` ({kind})" for k, kind in spec.features.items())
        parts.append(f"Policy `when:` keys of `ops.{name}` besides the device keys: {keys}.\n")
    return "\n".join(parts)


def cmd_validate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ._validate import run_validation
    from opdispatch.policies._policy import user_quarantine_path

    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout} must be a positive number of seconds")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs} must be at least 1")
    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget {args.budget} must be a positive number of seconds (or leave it out: no limit)")
    from ._timing import usable_device

    device = str(usable_device(args.on)) if args.on else str(_local_torch_device())
    quarantine = None if args.no_quarantine else Path(args.quarantine) if args.quarantine else user_quarantine_path()
    impls = [i.strip() for i in args.impl.split(",") if i.strip()] if args.impl else None
    code = run_validation(impls, device, timeout=args.timeout, quick=args.quick, quarantine_path=quarantine,
                          report_md=Path(args.report) if args.report else None,
                          report_json=Path(args.json) if args.json else None, stream=sys.stdout, jobs=args.jobs,
                          replace=args.replace, budget=args.budget, split=args.split)
    if quarantine is not None and code != 2:
        print(f"policies read {quarantine} from now on (`opdispatch explain` shows what it denies)")
    return code


def cmd_ops(args: argparse.Namespace) -> int:
    print(ops_markdown(), end="")
    return 0


def cmd_stubs(args: argparse.Namespace) -> int:
    from ._stubs import init_stub

    print(init_stub(), end="")
    return 0


# -- entry point -----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opdispatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"opdispatch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="implementations, their availability and origin")
    p.add_argument("--device", metavar="DESCRIPTOR",
                   help="simulate a device from a YAML descriptor: a path, or a name of configs/devices/*.yaml such "
                        "as h100 (default: this machine's device)")
    p.add_argument("--op", default=None, metavar="OP",
                   help="only this op, e.g. attention, rms_norm, rotary_embedding (default: every registered op)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also print each implementation's declared capabilities (default: off)")
    p.add_argument("--wide", action="store_true", help="no wrapping; origins in full (default: wrap to the "
                                                       "terminal's width)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("ops", help="the registered ops: arguments and policy `when:` keys (markdown, docs/ops.md)")
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("stubs", help="the typing stub of `import opdispatch`, generated from the ops' argument "
                                     "definitions (core/opdispatch/__init__.pyi: "
                                     "`opdispatch stubs > core/opdispatch/__init__.pyi`)")
    p.set_defaults(func=cmd_stubs)

    p = sub.add_parser("explain", help="which implementation a call would use, and why",
                       description="Which implementation a call would use, and why: every registered candidate "
                                   "with its status and what decided it. The call is built from the flags below "
                                   "(empty tensors: nothing runs); each op reads the flags that apply to it. "
                                   "Exit status 0 when an implementation is chosen, 1 when none can take the "
                                   "call, 2 for a bad argument.")
    p.add_argument("--op", default="attention", choices=sorted(_EXPLAIN_CALLS),
                   help="the op: %(choices)s (default: %(default)s); each reads the flags that apply to it")
    p.add_argument("--shape", required=True, metavar="B,S,H,D",
                   help="required. attention and rotary_embedding: B,S,H,D of q (batch, seqlen_q, q heads, head "
                        "dim); rms_norm: TOKENS,HIDDEN of x. Every value at least 1")
    p.add_argument("--kv-heads", type=_positive, default=None, metavar="N",
                   help="heads of k and v, dividing H (GQA/MQA); default: H")
    p.add_argument("--seqlen-k", type=_positive, default=None, metavar="N",
                   help="attention: keys per sequence (seqlen_k); default: S")
    p.add_argument("--head-dim-v", type=_positive, default=None, metavar="N",
                   help="attention: head dim of v; default: D")
    p.add_argument("--dtype", default="bf16", metavar="DTYPE",
                   help="the inputs' dtype: fp16, bf16, fp32, fp64 (also half, float, double; fp8_e4m3fn, "
                        "fp8_e5m2 where torch has them); default: %(default)s")
    p.add_argument("--layout", default="bshd", choices=["bshd", "bhsd", "sbhd"],
                   help="attention: the dimension order of q, k, v: %(choices)s (default: %(default)s); "
                        "--varlen packs as thd instead")
    p.add_argument("--varlen", action="store_true",
                   help="attention and rotary_embedding: pack as thd, B sequences of S tokens with cu_seqlens "
                        "(default: off)")
    p.add_argument("--causal", action="store_true", help="attention: causal masking (default: off)")
    p.add_argument("--causal-alignment", default="top_left", choices=["top_left", "bottom_right"],
                   help="attention, with --causal and S != S_k: where the causal diagonal sits: %(choices)s "
                        "(default: %(default)s; bottom_right for decode over a cache)")
    p.add_argument("--window", default=None, metavar="LEFT,RIGHT",
                   help="attention: a sliding window of LEFT keys before and RIGHT after each query, -1 = "
                        "unbounded on that side (e.g. --window 64,0); default: no window")
    p.add_argument("--softcap", type=float, default=0.0, metavar="X",
                   help="attention: tanh soft cap of the scores, X >= 0 (e.g. 30); default: %(default)s, no cap")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="attention: dropout probability in [0, 1); default: %(default)s")
    p.add_argument("--alibi", action="store_true", help="attention: with ALiBi slopes, one per q head "
                                                        "(default: off)")
    p.add_argument("--mask", action="store_true", help="attention: with a boolean (S, S_k) mask (default: off)")
    p.add_argument("--bias", action="store_true", help="attention: with an additive (S, S_k) bias in --dtype "
                                                       "(default: off)")
    p.add_argument("--lse", action="store_true", help="attention: also return the log-sum-exp (default: off)")
    p.add_argument("--grad", action="store_true", help="inputs require grad: a training call, which needs the "
                                                       "backward too (default: off, inference)")
    p.add_argument("--deterministic", action="store_true", help="attention: require a deterministic backward "
                                                                "(default: off)")
    p.add_argument("--residual", action="store_true", help="rms_norm: with the fused residual add (default: off)")
    p.add_argument("--no-weight", action="store_true", help="rms_norm: without a weight (default: with one)")
    p.add_argument("--rotary-dim", type=_positive, default=None, metavar="N",
                   help="rotary_embedding: rotated channels, even, at most D (default: D)")
    p.add_argument("--interleaved", action="store_true", help="rotary_embedding: GPT-J pairs (0,1),(2,3)... "
                                                              "(default: off, GPT-NeoX halves)")
    p.add_argument("--positions", action="store_true", help="rotary_embedding: explicit per-token positions "
                                                            "(default: off, positions 0..S-1)")
    p.add_argument("--max-positions", type=_positive, default=4096, metavar="N",
                   help="rotary_embedding: rows of the cos/sin caches (default: %(default)s; at least S is used)")
    p.add_argument("--impl", default=None, metavar="ID",
                   help="pin an implementation id, as impl= would (e.g. cpu.flash; `opdispatch list` names "
                        "them); default: the policy decides")
    p.add_argument("--device", metavar="DESCRIPTOR",
                   help="simulate a device from a YAML descriptor: a path, or a name of configs/devices/*.yaml "
                        "such as h100 or mi300x (default: this machine's device)")
    p.add_argument("--json", action="store_true", help="print the decision as JSON (default: a table)")
    p.add_argument("--wide", action="store_true", help="one line per candidate, provenance in full (default: wrap "
                                                       "to the terminal's width)")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("doctor", help="device, plugins (with load errors), policy")
    p.add_argument("--device", metavar="DESCRIPTOR",
                   help="simulate a device from a YAML descriptor: a path, or a name of configs/devices/*.yaml such "
                        "as h100 (default: this machine's device)")
    p.add_argument("--verbose", "-v", action="store_true", help="print plugin tracebacks (default: off)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("build", help="compile the per-call fast path (a C++ extension against torch's headers; "
                                     "cached per Python, torch and C++ ABI)")
    p.add_argument("--verbose", "-v", action="store_true", help="show the compiler's output")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("policy", help="policy tools: lint, show")
    policy_sub = p.add_subparsers(dest="policy_command", required=True)
    lint = policy_sub.add_parser("lint", help="unknown ids, rules that never match or are shadowed, schema errors")
    lint.add_argument("files", nargs="+", help="policy YAML files")
    lint.add_argument("--device", metavar="DESCRIPTOR",
                      help="also report rules that never match on this device descriptor, a path or a name of "
                           "configs/devices/*.yaml (default: no device, only what holds on every one)")
    lint.set_defaults(func=cmd_policy_lint)
    show = policy_sub.add_parser("show", help="the active policy layers, settings and env overrides")
    show.set_defaults(func=cmd_policy_show)

    p = sub.add_parser("demo", help="dispatch a set of attention calls on this device and check each result")
    p.add_argument("--on", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--verbose", "-v", action="store_true", help="print every decision table (default: off)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("validate", help="run each implementation's conformance matrix in its own process against "
                                        "the float64 reference; write a quarantine and a report")
    p.add_argument("--impl", default=None, help="comma-separated ids (default: every available one but the reference)")
    p.add_argument("--on", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one case may take before its worker is "
                                                               "killed (default 120: first calls compile kernels)")
    p.add_argument("--quick", action="store_true", help="a sampled matrix (one pairwise covering array over the "
                                                        "factors, dtypes taking turns, edge rows in one dtype; under "
                                                        "a minute per implementation on a CPU) instead of the full "
                                                        "one (three arrays with dtype a factor, edge rows per dtype)")
    p.add_argument("--replace", action="store_true", help="start the quarantine file over instead of merging: by "
                                                          "default only the rules of the implementations validated "
                                                          "here, on this device and these versions, are rewritten")
    p.add_argument("--quarantine", default=None, help="where to write the quarantine (default: OPDISPATCH_QUARANTINE "
                                                      "or ~/.cache/opdispatch/quarantine.yaml, which policies read)")
    p.add_argument("--no-quarantine", action="store_true", help="write no quarantine file")
    p.add_argument("--jobs", type=_positive, default=1, help="implementations validated at once, each in its own "
                                                           "worker (default 1; on a GPU they share its memory)")
    p.add_argument("--split", type=_positive, default=1, help="worker processes per implementation, each running "
                                                            "a share of its cases (default 1): kernels that compile "
                                                            "per new shape (Triton, torch.flex) spend a cold run "
                                                            "compiling, one CPU core per worker")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: no limit); when "
                                                             "they run out the cases left are reported 'not run' "
                                                             "and the reports and quarantine are written with what "
                                                             "ran (a job runner's timeout would lose it all)")
    p.add_argument("--report", default=None, help="also write the markdown report here")
    p.add_argument("--json", default=None, help="also write the JSON report (every case) here")
    p.set_defaults(func=cmd_validate)

    add_perf_commands(sub)
    from ._observe_cli import add_observe_commands  # stats, decisions (opdispatch.tools._observe_cli)

    add_observe_commands(sub)
    return parser


# -- performance: tune, bench (their commands are in opdispatch.tools._bench) -----------------------------------------

def _bench() -> Any:
    from . import _bench

    return _bench


def add_perf_commands(sub: Any) -> None:
    """Register `tune` and `bench` on the `opdispatch` argument parser's subcommands (without importing torch:
    --op and --preset are checked when the command runs, against the registered ops)."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--op", default="attention", help="the op to time (default: attention; any op with a "
                       "tuning description: attention, rms_norm, rotary_embedding)")
        p.add_argument("--preset", default="all",
                       help="call signatures to time, from the op's presets (default: all; attention: decode, "
                            "prefill, training, all)")
        p.add_argument("--shapes", default=None, help="YAML file of call signatures instead of a preset")
        p.add_argument("--impl", action="append", default=[], help="only these implementation ids/globs "
                       "(repeatable)")
        p.add_argument("--on", default=None, help="torch device (default: cuda if available, else cpu)")
        p.add_argument("--warmup", type=_non_negative, default=3, help="untimed calls first (default 3)")
        p.add_argument("--reps", type=_positive, default=10, help="timed reps; the median is reported, with the "
                                                                 "min, max and interquartile range (default 10)")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    p = sub.add_parser("tune", help="time every eligible implementation per shape bucket; write a tuned table")
    common(p)
    p.add_argument("--out", required=True, help="the tuned table to write (YAML); a policy names it with "
                                                "`ops.<op>.autotune: FILE`")
    p.add_argument("--device-only", action="store_true",
                   help="only implementations specific to this device type (skip portable ones like reference)")
    p.set_defaults(func=lambda args: _bench().cmd_tune(args))

    p = sub.add_parser("bench", help="an op's shapes on this device: markdown + PNG of TFLOP/s, pick, regret")
    common(p)
    p.add_argument("--out-dir", required=True, help="folder for the .md and .png (created if missing)")
    p.set_defaults(func=lambda args: _bench().cmd_bench(args))


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("opdispatch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--window -1,0` as `--window=-1,0` (any flag of `_NEGATIVE_OK`): argparse would take "-1,0" for an option
    and say the flag lacks a value, instead of letting the flag's own check say what is allowed."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _NEGATIVE_OK and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


_NEGATIVE_OK = ("--window", "--shape", "--warmup", "--reps", "--max-positions", "--rotary-dim", "--softcap",
                "--dropout", "--kv-heads", "--seqlen-k", "--head-dim-v", "--jobs", "--timeout")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    _import_runtime()
    try:
        return int(args.func(args))
    except (OpDispatchError, ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        print(f"opdispatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `opdispatch list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
