"""Reliability figures: bad inputs, valid-but-unusual inputs, malformed policies and injected kernel faults.

Prints one markdown report (``--out`` also writes it). Each section counts what was tried and what the user got:

- bad inputs (the validation cases of tests/test_validation.py and tests/test_fast_path_exactness.py, each cold
  and again after a valid call of the same tensors warmed the fast path): a clear error (the expected exception
  type, its message naming the argument and what is allowed: the tests' regexes), another error, or a result
  (wrong-silent);
- valid-but-unusual calls (random shapes, strided views, dtypes and flags, as tests/test_strided_property.py
  draws them) against a float64 oracle, through every CPU implementation: right, wrong (silently), or refused;
- malformed policies (tests/test_policy_errors.py, tests/test_policy_hostile.py's shapes, and generated
  mutations of the shipped default): a PolicyError with file:line, or accepted;
- kernel faults injected into a registered implementation (raising, out of memory, wrong outputs): what the
  caller sees with the defaults, and with the output guard (OPDISPATCH_CHECK_OUTPUTS=1).

Run: ``python benchmarks/reliability.py [--calls 300] [--out benchmarks/results/reliability-cpu.md]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import opdispatch  # noqa: E402
from opdispatch.base._errors import PolicyError  # noqa: E402


def bad_inputs() -> tuple[list[str], dict[str, int]]:
    from tests import test_fast_path_exactness as fast
    from tests import test_validation as validation

    counts = {"tried": 0, "clear error": 0, "other error": 0, "wrong-silent": 0}
    notes: list[str] = []
    for name, build, exc_type, pattern in validation.BAD_CASES:
        args, kwargs = build()
        for warm in (False, True):
            counts["tried"] += 1
            if warm:  # the same tensors, valid flags: warms the fast path for this signature when it can
                try:
                    opdispatch.attention(*args)
                except Exception:
                    pass
            try:
                opdispatch.attention(*args, **kwargs)
            except exc_type as exc:
                if re.search(pattern, str(exc)):
                    counts["clear error"] += 1
                else:
                    counts["other error"] += 1
                    notes.append(f"{name} ({'warm' if warm else 'cold'}): message {str(exc)[:120]!r}")
            except Exception as exc:
                counts["other error"] += 1
                notes.append(f"{name} ({'warm' if warm else 'cold'}): {type(exc).__name__}: {str(exc)[:120]}")
            else:
                counts["wrong-silent"] += 1
                notes.append(f"{name} ({'warm' if warm else 'cold'}): accepted")
    q = torch.randn(1, 8, 2, 16)
    accepted_by_design = ({"window": [4, 0]}, {"layout": __import__("numpy").str_("bshd")})
    for bad in fast.BAD:
        if bad in accepted_by_design:
            continue
        for warm in (False, True):
            counts["tried"] += 1
            if warm:
                opdispatch.attention(q, q, q, **fast.GOOD)
            try:
                opdispatch.attention(q, q, q, **{**fast.GOOD, **bad})
            except (TypeError, ValueError) as exc:
                key = next(iter(bad))
                counts["clear error" if key in str(exc) else "other error"] += 1
            else:
                counts["wrong-silent"] += 1
                notes.append(f"{bad} ({'warm' if warm else 'cold'}): accepted")
    return notes, counts


def unusual_calls(n: int, seed: int) -> tuple[list[str], dict[str, int]]:
    from hypothesis import given, settings

    from tests import test_strided_property as prop

    counts = {"tried": 0, "right": 0, "wrong-silent": 0, "refused": 0}
    notes: list[str] = []
    manager = opdispatch.get_manager()
    cases: list[dict[str, Any]] = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=seed == 0)
    @given(case=prop.attention_cases())
    def draw(case: dict[str, Any]) -> None:  # hypothesis draws the cases, the same strategy as the test's
        cases.append(case)

    draw()
    for case in cases:
        views, dense = prop.inputs(case)
        kw = prop.kwargs(case)
        for impl in ("cpu.flash", "reference.math", None):
            call = opdispatch.validate_attention(*views, **kw)
            if impl is not None and manager.implementation("attention", impl).not_supported_reasons(
                    call, manager.device_info("cpu")):
                continue
            counts["tried"] += 1
            try:
                prop.check(case, opdispatch.attention(*views, impl=impl, **kw), *dense)
            except AssertionError as exc:
                counts["wrong-silent"] += 1
                notes.append(f"{impl}: {str(exc)[:160]}")
            except Exception as exc:
                counts["refused"] += 1
                notes.append(f"{impl}: refused with {type(exc).__name__}: {str(exc)[:120]}")
            else:
                counts["right"] += 1
    return notes, counts


def _mutations(default: str, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Malformed variants of the shipped default policy: one edit each that makes it invalid."""
    edits = [
        ("version: 1", "version: 2"), ("version: 1", "version: true"),
        ("fallback_on_error: true", "fallback_on_error: 'on'"), ("strict: false", "strict: 0"),
        ("vendor: nvidia", "vendor: nvida"), ("seqlen_q: '<=16'", "seqlen_q: '<=x'"), ("softcap: true", "softcap: 30"),
        ("order:", "ordr:"), ("prefer: [nvidia.flash]", "prefer: nvidia.flash]"),
        ("requires_grad: true", "requires_grad: 'yes'"), ("- nvidia.cudnn", "- nvidia.cudnn.x"),
        ("alibi: true", "alibi: [true]"), ("gqa_ratio: '>1'", "gqa_ratio: '>>1'"),
        ("name: decode-on-flash", "name: ''"), ("- reference.math", "- reference.math\n      - reference.math"),
        ("vendor: nvidia", "vendor: [nvidia, '']"), ("dtype:", "dtyp:"), ("head_dim:", "head_dim: '>=256,<=128' #"),
        ("arch:", "arch: '>=sm90,<sm80' #"),
    ]
    out = []
    for _ in range(n):
        old, new = rng.choice(edits)
        if old not in default:
            continue
        positions = [m.start() for m in re.finditer(re.escape(old), default)]
        at = rng.choice(positions)
        out.append((f"{old!r} -> {new!r}", default[:at] + new + default[at + len(old):]))
    return out


def malformed_policies(seed: int) -> tuple[list[str], dict[str, int]]:
    from opdispatch.policies import load_policy
    from opdispatch.policies._policy import default_policy_path
    from tests import test_policy_errors as errors

    texts = [(name, text) for name, text, *_ in errors.CASES]
    texts += [("alias bomb", "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefg", "bcdefgh"))),
              ("recursive alias", "ops: &o\n  attention:\n    x: *o\n"), ("deep", "a: " + "[" * 3000 + "]" * 3000),
              ("NUL byte", "version: 1\n\0\n"), ("set order", "ops:\n  attention:\n    order: !!set {a.b, c.d}\n")]
    default = default_policy_path().read_text()
    texts += [(f"default with {edit}", t) for edit, t in _mutations(default, random.Random(seed), 120)]
    counts = {"tried": 0, "PolicyError with file:line": 0, "other error": 0, "accepted": 0}
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, text) in enumerate(texts):
            path = Path(tmp) / f"p{i}.yaml"
            path.write_bytes(text.encode("utf-8", "surrogatepass"))
            counts["tried"] += 1
            try:
                load_policy(path, environ={})
            except PolicyError as exc:
                if re.match(re.escape(str(path)) + r":\d+: ", str(exc)):
                    counts["PolicyError with file:line"] += 1
                else:
                    counts["other error"] += 1
                    notes.append(f"{name}: no line: {str(exc)[:120]}")
            except Exception as exc:
                counts["other error"] += 1
                notes.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
            else:
                counts["accepted"] += 1
                notes.append(f"{name}: accepted")
    return notes, counts


def kernel_faults() -> tuple[list[str], list[tuple[str, str, str]]]:
    """Inject faults into an implementation the policy puts first; what does the caller get?"""
    from typing import ClassVar

    from opdispatch import AttentionCaps, AttentionImpl
    from opdispatch.policies import parse_policy

    faults = {
        "raises RuntimeError": lambda call: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access")),
        "raises NotImplementedError": lambda call: (_ for _ in ()).throw(NotImplementedError("head_dim 72")),
        "raises out of memory": lambda call: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")),
        "returns None": lambda call: None,
        "returns a list": lambda call: [call.q],
        "returns the wrong shape": lambda call: call.q[..., :1].clone(),
        "returns the wrong dtype": lambda call: call.q.double(),
        "returns NaN everywhere": lambda call: torch.full_like(call.q, float("nan")),
        "corrupts q, then raises": lambda call: (call.q.mul_(0.0), (_ for _ in ()).throw(RuntimeError("late")))[1],
    }
    rows = []
    q = torch.randn(1, 8, 2, 16)
    want = opdispatch.attention(q, q, q, impl="reference.math")
    for guard in ("", "1"):
        for name, fault in faults.items():
            class Faulty(AttentionImpl):
                vendor: ClassVar[str] = "faulty"
                name: ClassVar[str] = "kernel"
                caps: ClassVar[AttentionCaps] = AttentionCaps(
                    dtypes=frozenset({torch.float32}), gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}),
                    causal=True, causal_alignments=frozenset({"top_left"}))

                def run(self, call, _fault=fault):
                    return _fault(call)

            os.environ.pop("OPDISPATCH_CHECK_OUTPUTS", None)
            if guard:
                os.environ["OPDISPATCH_CHECK_OUTPUTS"] = guard
            manager = opdispatch.OpManager()
            previous = opdispatch.set_manager(manager)
            try:
                manager.register_impl(Faulty())
                manager.set_policy(parse_policy("ops: {attention: {order: [faulty.kernel, cpu.flash]}}", "<p>"))
                x = q.clone()
                try:
                    out = opdispatch.attention(x, x, x)
                except Exception as exc:
                    seen = f"{type(exc).__name__}: {str(exc)[:70]}"
                    survived = "clear error"
                else:
                    ok = isinstance(out, torch.Tensor) and out.shape == want.shape and out.dtype == want.dtype and \
                        torch.allclose(out, want, atol=1e-5) if isinstance(out, torch.Tensor) else False
                    survived = "right result (fell back)" if ok else "WRONG result passed through"
                    seen = "result" if ok else f"got {type(out).__name__}" + (
                        f" {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else "")
            finally:
                opdispatch.set_manager(previous)
                os.environ.pop("OPDISPATCH_CHECK_OUTPUTS", None)
            rows.append(("guard on" if guard else "defaults", name, f"{survived} ({seen})"))
    return [], rows


def plugin_faults() -> list[tuple[str, str]]:
    """Faulty third-party plugins next to the built-ins: is each refused clearly while dispatch goes on?"""
    import importlib.metadata
    import types
    from opdispatch import AttentionCaps, AttentionImpl
    from opdispatch.plugins import ENTRY_POINT_GROUP

    def impl(vendor: str, caps: Any = None, name: str = "x") -> Any:
        attrs: dict[str, Any] = {"vendor": vendor, "name": name, "run": lambda self, call: call.q,
                                 "caps": caps or AttentionCaps(
                                     dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd", "bhsd", "sbhd"}),
                                     causal=True, causal_alignments=frozenset({"top_left"}))}
        return type(f"{vendor}_x", (AttentionImpl,), attrs)()

    def module(name: str, impls: list[Any] = (), hook: str = "opdispatch_impls", **attrs: Any) -> Any:
        mod = types.ModuleType(name)
        fn = opdispatch.hookimpl(lambda: list(impls))
        fn.__name__ = hook
        setattr(mod, hook, fn)
        for k, v in attrs.items():
            setattr(mod, k, v)
        return mod

    tmp = Path(tempfile.mkdtemp())
    (tmp / "rel_hangs.py").write_text("import time\ntime.sleep(60)\n")
    (tmp / "rel_raises.py").write_text("raise ImportError('libvendor.so: cannot open shared object file')\n")
    sys.path.insert(0, str(tmp))

    def probe_raises(device: Any) -> Any:
        raise RuntimeError("driver query failed")

    probe = module("rel_probe")
    probe_raises.__name__ = "opdispatch_probe_device"
    probe.opdispatch_probe_device = opdispatch.hookimpl(probe_raises)
    faults = {
        "registers a built-in id (nvidia.cudnn)": module("rel_rogue", [impl("nvidia", name="cudnn")],
                                                         OPDISPATCH_NAMESPACES=("nvidia",)),
        "registers outside its namespace": module("rel_outside", [impl("other")]),
        "second implementation refused": module("rel_half", [impl("acme"), impl("acme", caps="not caps")]),
        "misspelt hook opdispatch_impl": module("rel_typo", [impl("acme")], hook="opdispatch_impl"),
        "plugin API 3": module("rel_api", [impl("acme")], OPDISPATCH_PLUGIN_API=3),
        "hook raises": module("rel_hook", [], hook="opdispatch_impls"),
        "import hangs": "rel_hangs",
        "import raises": "rel_raises",
        "probe raises": probe,
    }
    def hook_raises() -> Any:
        raise RuntimeError("bad caps")

    hook_raises.__name__ = "opdispatch_impls"
    faults["hook raises"].opdispatch_impls = opdispatch.hookimpl(hook_raises)
    rows = []
    for what, mod in faults.items():
        name = mod if isinstance(mod, str) else mod.__name__
        if not isinstance(mod, str):
            sys.modules[name] = mod
        eps = [*importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
               importlib.metadata.EntryPoint(name="acme", value=name, group=ENTRY_POINT_GROUP)]
        manager = opdispatch.OpManager(entry_points=eps, environ={"OPDISPATCH_PLUGIN_TIMEOUT": "1"})
        previous = opdispatch.set_manager(manager)
        try:
            q = torch.randn(1, 4, 2, 8)
            out = opdispatch.attention(q, q, q)
            manager._probe_with_plugins(torch.device("meta"))
            record = next(r for r in manager.plugins if r.name == "acme")
            builtin_ok = manager.registry.get("attention", "nvidia.cudnn").origin.plugin == "nvidia"
            survived = out.shape == q.shape and builtin_ok and (record.status == "failed" or what == "probe raises")
            rows.append((what, f"{'survived' if survived else 'NOT SURVIVED'}: plugin {record.status}"
                               f"{' at ' + str(record.stage) if record.stage else ''}: "
                               f"{(record.error or '').splitlines()[0][:110]}"))
        finally:
            opdispatch.set_manager(previous)
    return rows


# -- hostile KV-cache indices (flash_attn_with_kvcache: dense, paged, cache_batch_idx, cache_leftpad) ----------

def _kv_hostile_cases() -> list[tuple[str, dict[str, Any]]]:
    """(name, the call's hostile arguments) over every index argument: negative, past the cache, wrapping int64,
    float and bool, an append that overflows."""
    i32 = torch.int32
    cases: list[tuple[str, dict[str, Any]]] = []
    for name, lens in (("negative", [-1, 2]), ("past capacity", [3, 17]), ("int64 2**32+5", [2**32 + 5, 1]),
                       ("int64 -2**32", [-2**32, 1]), ("at capacity with an append", [16, 1]),
                       ("append overflows by one", [15, 0])):
        dtype = torch.int64 if "int64" in name else i32
        for form in ("dense", "paged"):
            cases.append((f"cache_seqlens {name} ({form})", {"cache_seqlens": torch.tensor(lens, dtype=dtype),
                                                              "paged": form == "paged", "append": 2
                                                              if "overflows" in name else 1}))
    cases += [("cache_seqlens float", {"cache_seqlens": torch.tensor([1.0, 2.0])}),
              ("cache_seqlens bool", {"cache_seqlens": torch.tensor([True, False])}),
              ("cache_seqlens python float", {"cache_seqlens": 1.5}),
              ("cache_seqlens python negative int", {"cache_seqlens": -3})]
    for name, rows in (("negative", [-1, 0]), ("past the rows", [0, 3]), ("int64 2**32+1", [2**32 + 1, 0]),
                       ("float", [0.0, 1.0]), ("bool", [True, False])):
        dtype = torch.float32 if name == "float" else torch.bool if name == "bool" else \
            torch.int64 if "int64" in name else i32
        cases.append((f"cache_batch_idx {name}", {"cache_batch_idx": torch.tensor(rows, dtype=dtype)}))
    for name, pages in (("negative page", [[0, -1], [2, 3]]), ("page past the pool", [[0, 1], [2, 99]]),
                        ("int64 page 2**32", [[0, 2**32], [2, 3]]), ("float table", [[0.0, 1.0], [2.0, 3.0]])):
        dtype = torch.float32 if "float" in name else torch.int64 if "int64" in name else i32
        cases.append((f"block_table {name}", {"paged": True, "block_table": torch.tensor(pages, dtype=dtype),
                                             "cache_seqlens": torch.tensor([9, 12], dtype=i32)}))  # reads both
    # sequence 0 ends at 4 + 1 appended: a leftpad of 5 leaves it empty (allowed), 7 is past its end
    for name, pad in (("negative", [-2, 0]), ("past the end", [7, 0]), ("float", [0.0, 1.0])):
        dtype = torch.float32 if name == "float" else i32
        cases.append((f"cache_leftpad {name}", {"cache_leftpad": torch.tensor(pad, dtype=dtype),
                                               "cache_seqlens": torch.tensor([4, 3], dtype=i32)}))
    return cases


def kv_cache_indices() -> tuple[list[str], dict[str, int]]:
    """Each hostile index through `compat.flash_attn.flash_attn_with_kvcache`, with new keys appended: a clear
    error (naming the argument) with the caches bit-identical to before, a partial write (raised after writing),
    or wrong-silent (returned normally)."""
    from opdispatch.compat import flash_attn as fa

    counts = {"tried": 0, "clear error, nothing written": 0, "other error, nothing written": 0,
              "partial write": 0, "wrong-silent": 0}
    notes: list[str] = []
    gen = torch.Generator().manual_seed(0)
    for name, case in _kv_hostile_cases():
        case = dict(case)
        paged, append = case.pop("paged", False), case.pop("append", 1)
        if paged:  # 2 sequences x 2 pages of 8 keys in a pool of 4 pages
            k_cache, v_cache = (torch.randn(4, 8, 2, 8, generator=gen) for _ in range(2))
            case.setdefault("block_table", torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
        else:  # 2 sequences of 16 keys (3 rows when cache_batch_idx picks them)
            rows = 3 if "cache_batch_idx" in case else 2
            k_cache, v_cache = (torch.randn(rows, 16, 2, 8, generator=gen) for _ in range(2))
        case.setdefault("cache_seqlens", torch.tensor([4, 3], dtype=torch.int32))
        q = torch.randn(2, 1, 4, 8, generator=gen)
        k_new, v_new = (torch.randn(2, append, 2, 8, generator=gen) for _ in range(2))
        before = (k_cache.clone(), v_cache.clone())
        counts["tried"] += 1
        try:
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, causal=True, **case)
        except Exception as exc:
            untouched = torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
            argument = next((a for a in ("cache_seqlens", "cache_batch_idx", "block_table", "cache_leftpad")
                             if a in case and a in str(exc)), None)
            if not untouched:
                counts["partial write"] += 1
                notes.append(f"{name}: raised {type(exc).__name__} after writing into the cache")
            elif argument is not None or ("append" in str(exc) or "overflow" in str(exc)):
                counts["clear error, nothing written"] += 1
            else:
                counts["other error, nothing written"] += 1
                notes.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
        else:
            counts["wrong-silent"] += 1
            notes.append(f"{name}: accepted")
    return notes, counts


# -- quarantine files that are not what they should be ---------------------------------------------------------

def quarantine_files() -> list[tuple[str, str]]:
    """OPDISPATCH_QUARANTINE pointing at a malformed file, a FIFO, a directory, binary data…: a call still
    dispatches (in a fresh process, given 60 s) and a WARNING names the file; never a hang or an error."""
    import subprocess

    probe = ("import torch, opdispatch; q = torch.randn(1, 4, 2, 8); "
             "out = opdispatch.attention(q, q, q, causal=True); print('DISPATCHED', tuple(out.shape))")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        def write(name: str, data: bytes) -> str:
            path = Path(tmp) / name
            path.write_bytes(data)
            return str(path)

        fifo = Path(tmp) / "fifo.yaml"
        os.mkfifo(fifo)
        (Path(tmp) / "dir.yaml").mkdir()
        targets = {
            "a FIFO": str(fifo),
            "a directory": str(Path(tmp) / "dir.yaml"),
            "YAML syntax error": write("syntax.yaml", b"version: 1\nops: {attention: [\n"),
            "schema error (deny is a string)": write("schema.yaml", b"version: 1\nextends: none\nops:\n  attention:\n"
                                                     b"    rules:\n      - name: q\n        deny: cpu.flash\n"),
            "binary data": write("binary.yaml", bytes(range(256)) * 4),
            "empty file": write("empty.yaml", b""),
            "a rule for an unknown implementation": write(
                "unknown.yaml", b"version: 1\nextends: none\nops:\n  attention:\n    rules:\n      - name: q\n"
                b"        deny: [nobody.kernel]\n        reason: test\n"),
        }
        for what, path in targets.items():
            env = {**os.environ, "OPDISPATCH_QUARANTINE": path}
            try:
                done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                      timeout=60, cwd=tmp)
            except subprocess.TimeoutExpired:
                rows.append((what, "HUNG (no dispatch in 60 s)"))
                continue
            warned = [line for line in done.stderr.splitlines() if path in line]  # logging's bare last resort
            if done.returncode != 0 or "DISPATCHED" not in done.stdout:
                tail = (done.stderr.strip().splitlines() or ["?"])[-1][:110]
                rows.append((what, f"STOPPED DISPATCH: {tail}"))
            else:
                rows.append((what, "dispatched" + (f"; warning: {warned[0].strip()[:110]}" if warned else
                                                   "; no warning")))
    return rows


# -- context-parallel calls on which the ranks disagree --------------------------------------------------------

def _cp_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of tests/_distributed_worker.py running only its context-parallel disagreement scenarios."""
    from tests import _distributed_worker as worker

    worker.SCENARIOS = [worker.cp_mismatch, worker.cp_twice]
    worker.main(rank, world, port, out_dir)


def context_parallel_mismatches() -> list[tuple[str, str]]:
    """Three gloo ranks (CPU); one rank's call differs in one way (shard length, heads, head_dim, dtype, batch,
    causal, scale, sharding, mode, a gradient, a call it rejects itself, an unshard of another length, a
    skipped backward, an extra call): what every rank got. Survived = the same clear error on every rank (no
    abort, no timeout), and an agreed call afterwards still right."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    world = 3
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(_cp_rank, args=(world, port, out), nprocs=world, join=True, start_method="spawn")
        except Exception as exc:  # a rank died (an abort inside gloo): what the family exists to catch
            return [("every mismatch", f"CRASHED: {type(exc).__name__}: {str(exc)[:110]}")]
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    mismatch = [r["cp_mismatch"] for r in ranks]
    for kind in [k for k in mismatch[0] if k not in ("after", "calls")]:
        got = [m[kind] for m in mismatch]
        if any("crashed" in g for g in got if isinstance(g, dict)):
            rows.append((kind, "CRASHED on a rank"))
            continue
        types = {g["type"] for g in got}
        if None in types:
            rows.append((kind, "WRONG-SILENT: a rank returned normally"))
        elif kind == "rejected":  # the rejecting rank raises its own error, the others name it
            rows.append((kind, "clear error on every rank: " + ", ".join(sorted(t for t in types if t))))
        elif len({g["message"] for g in got}) == 1:
            lines = got[0]["message"].splitlines()
            field = next((line.strip() for line in lines[1:] if line.startswith("  ")), lines[0])  # what differs
            rows.append((kind, f"the same {got[0]['type']} on every rank: {field[:100]}"))
        else:
            rows.append((kind, "DIFFERENT errors on the ranks: " + "; ".join(g["type"] for g in got)))
    after = max(max(m["after"].values()) for m in mismatch)
    rows.append(("an agreed call after all of them", ("right" if after < 1e-10 else "WRONG") +
                 f" (max error {after:.1e} against one process in float64)"))
    twice = [r["cp_twice"] for r in ranks]
    later = [t["extra"] if rank == 0 else t["later"] for rank, t in enumerate(twice)]
    rows.append(("one rank calls once more (the others' next call differs)",
                 "clear error on every rank" if all(g and g.get("type") for g in later) else
                 "NOT DETECTED: " + json.dumps(later)[:110]))
    return rows


# -- the breaker's scope: one failing signature does not demote a whole class ----------------------------------

def breaker_scope() -> list[tuple[str, str]]:
    """A kernel that fails at one sequence length only: which calls still reach it after the failure."""
    from typing import ClassVar

    from opdispatch import AttentionCaps, AttentionImpl
    from opdispatch.policies import parse_policy

    class FailsAt(AttentionImpl):
        vendor: ClassVar[str] = "flaky"
        name: ClassVar[str] = "kernel"
        caps: ClassVar[AttentionCaps] = AttentionCaps(
            dtypes=frozenset({torch.float32}), gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}),
            causal=True, causal_alignments=frozenset({"top_left"}))
        failing: ClassVar[set[int]] = set()
        ran: ClassVar[list[int]] = []

        def run(self, call: Any) -> Any:
            if call.seqlen_q in self.failing:
                raise RuntimeError(f"kernel fault at seqlen {call.seqlen_q}")
            self.ran.append(call.seqlen_q)
            return torch.nn.functional.scaled_dot_product_attention(call.bhsd(call.q), call.bhsd(call.k),
                                                                    call.bhsd(call.v), is_causal=call.causal)

    manager = opdispatch.OpManager()
    previous = opdispatch.set_manager(manager)
    rows = []
    try:
        manager.register_impl(FailsAt())
        manager.set_policy(parse_policy("ops: {attention: {order: [flaky.kernel, cpu.flash]}}", "<p>"))

        def call(n: int) -> str:
            FailsAt.ran.clear()
            q = torch.randn(1, 4, n, 8).transpose(1, 2)
            want = torch.nn.functional.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3, is_causal=True)
            out = opdispatch.attention(q, q, q, causal=True)
            right = torch.allclose(out.transpose(1, 2), want, atol=1e-5)
            return ("flaky.kernel" if FailsAt.ran else "the next candidate") + ("" if right else " (WRONG result)")

        FailsAt.failing = {7}
        rows.append(("seqlen 7 fails (first failure)", call(7)))
        rows.append(("seqlen 9, same class, after it", call(9)))
        rows.append(("seqlen 7 again", call(7)))
        FailsAt.failing = {7, 11}
        rows.append(("seqlen 11 fails (a second distinct signature)", call(11)))
        rows.append(("seqlen 9 after failures on two signatures", call(9)))
    finally:
        opdispatch.set_manager(previous)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=150, help="valid-but-unusual cases drawn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = ["# opdispatch reliability (cpu)", "",
             f"- opdispatch {opdispatch.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
             f"{platform.machine()}", ""]
    sections = (("Bad inputs (cold and warm)", bad_inputs()),
                ("Valid-but-unusual calls vs a float64 oracle", unusual_calls(args.calls, args.seed)),
                ("Malformed policy files", malformed_policies(args.seed)))
    for title, (notes, counts) in sections:
        lines += [f"## {title}", "", "| " + " | ".join(counts) + " |", "|" + "--:|" * len(counts),
                  "| " + " | ".join(str(v) for v in counts.values()) + " |", ""]
        lines += [f"- {n}" for n in notes[:20]] + ([""] if notes else [])
    _, rows = kernel_faults()
    lines += ["## Kernel faults injected (the faulty kernel first in the order, cpu.flash next)", "",
              "| mode | fault | what the caller got |", "|---|---|---|"]
    lines += [f"| {m} | {f} | {s} |" for m, f, s in rows]
    survived = sum(1 for _, _, s in rows if not s.startswith("WRONG"))
    lines += ["", f"Survived (a right result or a clear error): {survived} of {len(rows)}.", ""]
    plugin_rows = plugin_faults()
    lines += ["## Plugin faults injected (a third-party plugin `acme` beside the built-ins; dispatch must go on)", "",
              "| fault | what happened |", "|---|---|"] + [f"| {f} | {s} |" for f, s in plugin_rows]
    survived = sum(1 for _, s in plugin_rows if s.startswith("survived"))
    lines += ["", f"Survived: {survived} of {len(plugin_rows)}.", "",
              "Kernels that abort, hang or return wrong results under `opdispatch validate`: "
              "tests/test_validate.py (each costs one case; the rest run in a fresh worker).", ""]
    notes, counts = kv_cache_indices()
    lines += ["## Hostile KV-cache indices (flash_attn_with_kvcache, an append each; caches compared bit for bit)", "",
              "| " + " | ".join(counts) + " |", "|" + "--:|" * len(counts),
              "| " + " | ".join(str(v) for v in counts.values()) + " |", ""]
    lines += [f"- {n}" for n in notes[:30]] + ([""] if notes else [])
    rows2 = quarantine_files()
    lines += ["## Quarantine files (OPDISPATCH_QUARANTINE; a fresh process makes one call)", "",
              "| the file | what happened |", "|---|---|"] + [f"| {w} | {r} |" for w, r in rows2]
    ok = sum(1 for _, r in rows2 if r.startswith("dispatched"))
    lines += ["", f"Dispatch went on: {ok} of {len(rows2)}.", ""]
    rows_cp = context_parallel_mismatches()
    lines += ["## Context-parallel calls on which the ranks disagree (3 gloo ranks on the CPU)", "",
              "| what differs | what the ranks got |", "|---|---|"] + [f"| {w} | {r} |" for w, r in rows_cp]
    ok = sum(1 for _, r in rows_cp if not r.startswith(("CRASHED", "WRONG", "DIFFERENT", "NOT")))
    lines += ["", f"Survived (the same clear error on every rank, or right): {ok} of {len(rows_cp)}.", ""]
    rows3 = breaker_scope()
    lines += ["## The breaker's scope (a kernel failing at one sequence length, cpu.flash next)", "",
              "| call | served by |", "|---|---|"] + [f"| {w} | {r} |" for w, r in rows3]
    lines += [""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
