"""nvidia.cudnn_frontend (cuDNN SDPA through the cuDNN frontend's Python graph API) against a fake `cudnn` built
from the published bindings: the graph it builds (dims, strides, dtypes, bounds, scales), one build per signature,
results against a float64 oracle; FP8 with its output scaled and dequantized; selection on a simulated H100."""

from __future__ import annotations

import math
import re

import pytest
import torch

import opdispatch
from opdispatch.vendors.nvidia import CudnnFrontendAttention
from opdispatch.vendors.nvidia import _cudnn_frontend as adapter_module

from tests._adapters_on_cpu import unbound_from_device, device_with_library, meta_qkv, run_on_cpu
from tests.conftest import device_descriptor
from tests.fakes import cudnn_frontend as fake


PLAN_MS = {0: 3.0, 1: 1.0, 2: 2.0}  # the fake timer's milliseconds per plan index: plan 1 is the fastest


def _fake_time_plan(launch, device):
    """The adapter's timer on CPU: runs the plan as often as the CUDA-event timer does and reports PLAN_MS of the
    plan that ran (read from the fake's record, so a timer handed the wrong plan reports the wrong time)."""
    for _ in range(adapter_module._AUTOTUNE_REPS):
        launch()
    return PLAN_MS[fake.executions[-1]["plan"]]


@pytest.fixture
def fake_plans(monkeypatch):
    fake.graphs.clear()
    fake.executions.clear()
    monkeypatch.setattr(fake, "plan_count", 3)
    monkeypatch.setattr(fake, "unbuildable_plans", set())
    monkeypatch.setattr(adapter_module, "_time_plan", _fake_time_plan)


def _fe(monkeypatch, manager, tmp_path, **options):
    return run_on_cpu(monkeypatch, manager, tmp_path, fake.fake_modules(),
                      unbound_from_device(CudnnFrontendAttention, "cudnn_fe"), options={"half": True, **options})


@pytest.fixture
def fe(monkeypatch, basic_manager, tmp_path, fake_plans):
    return _fe(monkeypatch, basic_manager, tmp_path)


def _oracle(q, k, v, scale, causal, window, bottom_right):
    """float64 (b, s, h, d) attention, independent of the fake's band arithmetic."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=torch.float64)
    offset = sk - sq if bottom_right else 0
    for i in range(sq):
        keys = [j for j in range(sk)
                if not (causal and j > i + offset)
                and (window is None or ((window[0] < 0 or j >= i + offset - window[0])
                                        and (window[1] < 0 or j <= i + offset + window[1])))]
        if not keys:
            continue
        for h in range(hq):
            kh = h // (hq // hk)
            s = torch.einsum("bd,bkd->bk", q[:, i, h], k[:, keys, kh]) * scale
            out[:, i, h] = torch.einsum("bk,bkd->bd", torch.softmax(s, dim=-1), v[:, keys, kh])
    return out


LAYOUT = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.transpose(0, 1)}


@pytest.mark.parametrize("layout,dtype,causal,window,align,heads", [
    ("bshd", torch.bfloat16, False, None, "top_left", (4, 4)),
    ("bhsd", torch.float16, True, None, "bottom_right", (4, 2)),
    ("sbhd", torch.bfloat16, True, (2, 0), "bottom_right", (6, 3)),
    ("bshd", torch.float16, False, (1, 2), "top_left", (2, 1)),
])
def test_bf16_fp16_graphs_have_the_call_s_dims_strides_and_bounds(fe, layout, dtype, causal, window, align, heads):
    gen = torch.Generator().manual_seed(11)
    b, sq, sk, d = 2, 5, 7, 8
    hq, hk = heads
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    to = LAYOUT[layout]
    # non-contiguous layout views: the graph must carry their strides
    out = opdispatch.attention(to(q), to(k), to(v), layout=layout, causal=causal, causal_alignment=align,
                               window=window)
    graph = fake.graphs[-1]
    op = graph.op
    assert op["kind"] == "sdpa" and op["generate_stats"] is False
    assert op["q"].dim == (b, hq, sq, d) and op["k"].dim == (b, hk, sk, d)
    bhsd_q = to(q).permute({"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (1, 2, 0, 3)}[layout])
    assert op["q"].stride == bhsd_q.stride()
    left, right = (window if window is not None else (-1, -1))
    right = 0 if causal else right
    assert op["left_bound"] == (None if left < 0 else left + 1)
    assert op["right_bound"] == (None if right < 0 else right)
    assert op["diagonal_alignment"].value == align and math.isclose(op["attn_scale"], d ** -0.5)
    want = _oracle(q.double(), k.double(), v.double(), d ** -0.5, causal, window, align == "bottom_right")
    got = {"bshd": out, "bhsd": out.transpose(1, 2), "sbhd": out.transpose(0, 1)}[layout]
    assert out.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    # a second call of the signature reuses the graph; another signature builds its own
    runs = len(fake.executions)
    opdispatch.attention(to(q), to(k), to(v), layout=layout, causal=causal, causal_alignment=align, window=window)
    assert len(fake.graphs) == 1 and len(fake.executions) == runs + 1 and fake.executions[-1]["plan"] == 1
    opdispatch.attention(to(q)[:1], to(k)[:1], to(v)[:1], layout=layout, causal=causal, causal_alignment=align,
                         window=window) if layout != "sbhd" else None
    assert len(fake.graphs) == (2 if layout != "sbhd" else 1)


@pytest.mark.parametrize("kind,out_dtype,causal", [
    (torch.float8_e4m3fn, None, True), (torch.float8_e4m3fn, torch.float16, False), (torch.float8_e5m2, None, True)])
def test_fp8_graph_scales_and_the_dequantized_output(fe, kind, out_dtype, causal):
    gen = torch.Generator().manual_seed(12)
    b, s, hq, hk, d = 2, 6, 4, 2, 64
    q, k, v = ((torch.randn(b, s, h, d, generator=gen) * 4).to(kind) for h in (hq, hk, hk))
    qs, ks, vs = (torch.rand((), generator=gen) + 0.1 for _ in range(3))
    out = opdispatch.attention(q, k, v, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs,
                               out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.bfloat16)
    op = fake.graphs[-1].op
    assert op["kind"] == "sdpa_fp8" and fake._TORCH[op["outputs"][0].data_type] == kind  # FP8 out on Hopper
    assert op["descale_q"].dim == (1, 1, 1, 1) and op["q"].dim == (b, hq, s, d)
    pack = fake.executions[-1]["pack"]
    scale_o = pack[op["scale_o"].uid].item()
    v_max = (v.float().abs().max() * vs).item()
    assert math.isclose(scale_o, torch.finfo(kind).max / v_max, rel_tol=1e-6)  # the output uses FP8's range
    assert pack[op["scale_s"].uid].item() * pack[op["descale_s"].uid].item() == 1.0
    want = _oracle(q.double() * qs.double(), k.double() * ks.double(), v.double() * vs.double(), d ** -0.5, causal,
                   None, False)
    # the fake rounds the scaled output to the FP8 kind (as cuDNN's output is): e4m3 2**-4, e5m2 2**-3 relative
    rel = 2 ** -3 if kind == torch.float8_e5m2 else 2 ** -4
    torch.testing.assert_close(out.double(), want, atol=rel * v_max, rtol=rel)


def test_fp8_per_head_descales_and_odd_head_dims_are_refused_with_reasons(fe):
    q = torch.zeros(1, 4, 2, 32, dtype=torch.float8_e4m3fn)
    one = torch.ones(())
    d = opdispatch.explain(q, q, q, q_descale=one, k_descale=one, v_descale=one)
    cand = next(c for c in d.candidates if c.impl_id == "test.cudnn_fe")
    assert any("head_dim = head_dim_v in [64, 128]" in r for r in cand.reasons) and d.chosen_id == "reference.math"
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float8_e4m3fn)
    d = opdispatch.explain(q, q, q, q_descale=torch.ones(1, 2), k_descale=one, v_descale=one)
    cand = next(c for c in d.candidates if c.impl_id == "test.cudnn_fe")
    assert any("per (batch, kv head) not supported" in r for r in cand.reasons)


def test_fp8_on_a_simulated_h100_picks_the_frontend_and_says_why_not_others(tmp_path):
    with_fe = device_with_library(tmp_path, "h100", "cudnn_frontend", "1.32.0")
    q, k, v = (t.to(torch.float8_e4m3fn) for t in meta_qkv())
    one = torch.ones((), device="meta")
    d = opdispatch.explain(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one, device=with_fe)
    assert d.chosen_id == "nvidia.cudnn_frontend"
    cudnn = next(c for c in d.candidates if c.impl_id == "nvidia.cudnn")
    assert any("dtype fp8_e4m3fn not supported" in r for r in cudnn.reasons)
    # without the wheel: the oracle, and explain names the library and the install hint
    d = opdispatch.explain(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one,
                           device=str(device_descriptor("h100")))
    assert d.chosen_id == "reference.math"
    fe_cand = next(c for c in d.candidates if c.impl_id == "nvidia.cudnn_frontend")
    assert any("cudnn_frontend" in r for r in fe_cand.reasons)
    # bf16 calls keep their pick: nvidia.cudnn
    bf = opdispatch.explain(*meta_qkv(), causal=True, device=with_fe)
    assert bf.chosen_id == "nvidia.cudnn"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_calls_are_opt_in_and_explain_says_why(tmp_path, monkeypatch, manager, dtype):
    """bf16/fp16 calls reach the frontend only with its `half` option (a graph per new shape: 0.07-1.0 s on an
    H100): by default a windowed inference call on a simulated H100 with the wheel goes to torch's FA2 and the
    frontend's reason names the option; with the option it is eligible; FP8 is eligible either way."""
    with_fe = device_with_library(tmp_path, "h100", "cudnn_frontend", "1.32.0")
    q, k, v = (t.to(dtype) for t in meta_qkv(sq=4096, sk=4096))
    d = opdispatch.explain(q, k, v, causal=True, window=(1024, 0), device=with_fe)
    fe_cand = next(c for c in d.candidates if c.impl_id == "nvidia.cudnn_frontend")
    assert d.chosen_id == "nvidia.flash" and fe_cand.status == "rejected"
    assert any("half: true" in r and "graph per new shape" in r for r in fe_cand.reasons)
    policy = tmp_path / "half.yaml"
    policy.write_text("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
                      "      nvidia.cudnn_frontend: {half: true}\n    rules:\n      - name: fixed-shape-window\n"
                      "        when: {window: true, requires_grad: false}\n        prefer: [nvidia.cudnn_frontend]\n"
                      "        reason: fixed-shape inference\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    opdispatch.get_manager().reload()
    d = opdispatch.explain(q, k, v, causal=True, window=(1024, 0), device=with_fe)
    assert d.chosen_id == "nvidia.cudnn_frontend" and d.decided_by.rule == "fixed-shape-window"
    one = torch.ones((), device="meta")
    fp8 = [t.to(torch.float8_e4m3fn) for t in meta_qkv()]
    monkeypatch.delenv("OPDISPATCH_POLICY")
    opdispatch.get_manager().reload()
    d = opdispatch.explain(*fp8, causal=True, q_descale=one, k_descale=one, v_descale=one, device=with_fe)
    assert d.chosen_id == "nvidia.cudnn_frontend"


def test_fp8_buffers_are_made_once_per_device_and_stream_and_never_cached_in_capture(fe):
    """Two calls of a signature reuse the constant scalars, the scratch cuDNN writes and the workspace; another
    stream gets its own scratch; during CUDA-graph capture nothing new is cached (a buffer filled in capture holds
    its value only after replay)."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = ((torch.randn(1, 5, h, 64, generator=gen) * 3).to(torch.float8_e4m3fn) for h in (2, 1, 1))
    one = torch.ones(())
    for _ in range(2):
        opdispatch.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one)
    first, second = (fake.executions[i]["pack"] for i in (-2, -1))
    op = fake.graphs[-1].op
    for name in ("scale_s", "descale_s", "scale_o"):
        assert first[op[name].uid] is second[op[name].uid]
    for amax in op["outputs"][2:]:
        assert first[amax.uid] is second[amax.uid]
    graphs = CudnnFrontendAttention()._graphs
    cpu = torch.device("cpu")
    constants, scratch = graphs.fp8_buffers(cpu, stream=1, capturing=False)
    assert graphs.fp8_buffers(cpu, stream=1, capturing=False) == (constants, scratch)
    other = graphs.fp8_buffers(cpu, stream=2, capturing=False)[1]
    assert other is not scratch and other.scale_o.data_ptr() != scratch.scale_o.data_ptr()
    in_capture = graphs.fp8_buffers(cpu, stream=3, capturing=True)[1]
    assert (0, 3) not in graphs.scratch and graphs.fp8_buffers(cpu, 3, False)[1] is not in_capture
    assert graphs.fp8_buffers(torch.device("cpu", 1), 1, capturing=True)[0] is not constants
    assert 1 not in graphs.constants



def _fp8_qkv(seed, b=2, s=6, hq=4, hk=2, d=64, kind=torch.float8_e4m3fn):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(b, s, h, d, generator=gen) * 4).to(kind) for h in (hq, hk, hk))
    descales = tuple(torch.rand((), generator=gen) + 0.1 for _ in range(3))
    return q, k, v, descales


@pytest.mark.parametrize("fp8,unbuildable,want", [
    (True, set(), 1), (False, set(), 1),
    (True, {1}, 2),  # the fastest plan did not build: the fastest of those that did
    (False, {0, 1}, 2),  # cuDNN's first plan did not build either
])
def test_autotune_times_every_built_plan_once_per_signature_and_runs_the_fastest(
        monkeypatch, basic_manager, tmp_path, fake_plans, fp8, unbuildable, want):
    monkeypatch.setattr(fake, "unbuildable_plans", unbuildable)
    _fe(monkeypatch, basic_manager, tmp_path)
    if fp8:
        q, k, v, (qs, ks, vs) = _fp8_qkv(21)
        kw = dict(q_descale=qs, k_descale=ks, v_descale=vs)
        want_out = _oracle(q.double() * qs.double(), k.double() * ks.double(), v.double() * vs.double(), 64 ** -0.5,
                           True, None, False)
        tol = dict(atol=2 ** -4 * (v.float().abs().max() * vs).item(), rtol=2 ** -4)
    else:
        gen = torch.Generator().manual_seed(22)
        q, k, v = (torch.randn(2, 6, h, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
        kw = {}
        want_out = _oracle(q.double(), k.double(), v.double(), 64 ** -0.5, True, None, False)
        tol = dict(atol=2e-2, rtol=2e-2)
    out = opdispatch.attention(q, k, v, causal=True, **kw)
    built = [i for i in range(3) if i not in unbuildable]
    graph = fake.graphs[-1]
    assert graph.plans_built == built and len(fake.graphs) == 1  # build_plans(ALL): every plan that builds
    runs = [e["plan"] for e in fake.executions]
    # per built plan: a warm-up and _AUTOTUNE_REPS timed runs, in index order; then the chosen plan for the call
    per_plan = 1 + adapter_module._AUTOTUNE_REPS
    assert runs == [i for i in built for _ in range(per_plan)] + [want]
    torch.testing.assert_close(out.double(), want_out, **tol)  # the output is the chosen plan's, after tuning
    for _ in range(2):  # later calls: no build, no timing, the chosen plan by index
        out = opdispatch.attention(q, k, v, causal=True, **kw)
    assert [e["plan"] for e in fake.executions[len(runs):]] == [want, want] and len(fake.graphs) == 1
    torch.testing.assert_close(out.double(), want_out, **tol)


def test_autotune_off_builds_cudnn_s_first_plan_and_runs_it(monkeypatch, basic_manager, tmp_path, fake_plans):
    monkeypatch.setattr(fake, "unbuildable_plans", {0})
    _fe(monkeypatch, basic_manager, tmp_path, autotune=False)
    q, k, v, (qs, ks, vs) = _fp8_qkv(23)
    for _ in range(2):
        opdispatch.attention(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs)
    assert fake.graphs[-1].plans_built == [1]  # HEURISTICS_CHOICE: the first that builds, no other
    assert [e["plan"] for e in fake.executions] == [1, 1]


def test_autotune_with_no_plan_running_raises_with_the_fix(monkeypatch, basic_manager, tmp_path, fake_plans,
                                                           caplog):
    """Every plan built but each refuses execution (a cuDNN error at run time): the adapter raises, naming the
    signature, each plan's refusal and the option that turns tuning off (never an unknown plan run instead); the
    manager logs it and the call goes on to the next implementation."""
    _fe(monkeypatch, basic_manager, tmp_path)

    def refuse(self, pack, workspace, index, handle=None, **_):
        raise RuntimeError(f"Plan index {index} did not build.")

    monkeypatch.setattr(fake.pygraph, "execute_plan_at_index", refuse)
    q, k, v, (qs, ks, vs) = _fp8_qkv(24)
    with caplog.at_level("WARNING", logger="opdispatch"):
        opdispatch.attention(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs)
    assert re.search(r"test.cudnn_fe raised RuntimeError: nvidia.cudnn_frontend: no built cuDNN plan ran for "
                     r"layout=bshd .*plan 0: Plan index 0 did not build.*plan 2: Plan index 2 did not build.*"
                     r"autotune: false", caplog.text)
    assert opdispatch.explain(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs).chosen_id != "test.cudnn_fe"


def _quantized(t, kind=torch.float8_e4m3fn):
    """The test's own current scaling: (t as FP8 dequantized back, float64) with descale = amax / fp8_max."""
    descale = t.double().abs().max() / torch.finfo(kind).max
    return (t.double() / descale).to(kind).double() * descale


def _oracle_grads(q, k, v, d_o, causal, window, bottom_right):
    """float64 autograd through the oracle (bshd), independent of the fake's backward formulas."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = _oracle_scored(q, k, v, q.shape[-1] ** -0.5, causal, window, bottom_right)
    out.backward(d_o.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("layout,dtype,causal,window,align,heads", [
    ("bshd", torch.bfloat16, True, None, "top_left", (4, 2)),
    ("bhsd", torch.float16, False, None, "top_left", (2, 2)),
    ("sbhd", torch.bfloat16, True, (3, 0), "bottom_right", (6, 3)),
    ("bshd", torch.bfloat16, False, (2, 1), "top_left", (4, 1)),
])
def test_fp8_dpa_forward_and_backward_against_float64_autograd(monkeypatch, basic_manager, tmp_path, fake_plans,
                                                               layout, dtype, causal, window, align, heads):
    """fp8_dpa: bf16/fp16 q/k/v that require grad, cast to e4m3 inside; the output and dq/dk/dv in the inputs'
    dtype against float64 autograd of the same attention on the FP8-rounded inputs (the test's own quantization).
    The backward graph reads the forward's stats (the fake rebuilds P from them) and its FP8 gradients are
    dequantized by the scales the adapter chose."""
    _fe(monkeypatch, basic_manager, tmp_path, fp8_dpa=True)
    gen = torch.Generator().manual_seed(31)
    b, sq, sk, d = 2, 7, 9, 64
    hq, hk = heads
    sk = sk if align == "bottom_right" else sq
    q, k, v = ((torch.randn(b, s, h, d, generator=gen) * 2).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    d_o = torch.randn(b, sq, hq, d, generator=gen).to(dtype) * 1e-3  # gradients far from 1: scales must adapt
    to = LAYOUT[layout]
    leaves = [to(t).detach().requires_grad_() for t in (q, k, v)]
    out = opdispatch.attention(*leaves, layout=layout, causal=causal, causal_alignment=align, window=window)
    assert out.dtype == dtype and out.requires_grad
    out.backward(to(d_o))
    grads = [{"bshd": g, "bhsd": g.transpose(1, 2), "sbhd": g.transpose(0, 1)}[layout] for g in
             (leaf.grad for leaf in leaves)]
    want_out, *want = _oracle_grads(*(_quantized(t) for t in (q, k, v)), _quantized(d_o), causal, window,
                                    align == "bottom_right")
    got_out = {"bshd": out, "bhsd": out.transpose(1, 2), "sbhd": out.transpose(0, 1)}[layout]
    torch.testing.assert_close(got_out.double(), want_out, atol=2 ** -4 * want_out.abs().max().item(), rtol=2 ** -4)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.dtype == dtype and got.shape == ref.shape, name
        # FP8 output of each gradient (2**-4 relative) and the FP8 o the backward reads: within 2**-3 of the max
        torch.testing.assert_close(got.double(), ref, atol=2 ** -3 * ref.abs().max().item(), rtol=2 ** -3,
                                   msg=lambda m, name=name: f"{name}: {m}")
    backward_graph = next(g for g in fake.graphs if g.op["kind"] == "sdpa_fp8_backward")
    assert backward_graph.op["stats"].dim == (b, hq, sq, 1)
    forward_graph = next(g for g in fake.graphs if g.op["kind"] == "sdpa_fp8")
    assert forward_graph.op["generate_stats"] is True


def test_fp8_dpa_gradient_scales_adapt_and_are_kept_per_signature(monkeypatch, basic_manager, tmp_path,
                                                                   fake_plans):
    """The first backward of a signature cannot know its gradients' range: its run is checked against the amaxes
    and rerun with fitting scales; the next call of the same range runs once; a call whose gradients are 10**4
    larger (they would clip) is rerun again and still right — never a clipped gradient returned."""
    _fe(monkeypatch, basic_manager, tmp_path, fp8_dpa=True, autotune=False)
    gen = torch.Generator().manual_seed(32)
    q, k, v = ((torch.randn(1, 6, 2, 64, generator=gen) * 2).to(torch.bfloat16) for _ in range(3))

    def backward_runs(grad_scale):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        d_o = (torch.randn(1, 6, 2, 64, generator=gen) * grad_scale).to(torch.bfloat16)
        before = sum(e["graph"].op["kind"] == "sdpa_fp8_backward" for e in fake.executions)
        opdispatch.attention(*leaves, causal=True).backward(d_o)
        _, *want = _oracle_grads(*(_quantized(t) for t in (q, k, v)), _quantized(d_o), True, None, False)
        # dq/dk also carry the FP8 o the backward reads (its D = rowsum(dO o) term, absent from the oracle, where
        # dP - D cancels): 2**-2 of the max; dv only its own rounding and the inputs': 2**-3
        for got, ref, bits in zip((leaf.grad for leaf in leaves), want, (2, 2, 3), strict=True):
            torch.testing.assert_close(got.double(), ref, atol=2 ** -bits * ref.abs().max().item(), rtol=0)
        return sum(e["graph"].op["kind"] == "sdpa_fp8_backward" for e in fake.executions) - before

    assert backward_runs(1e-2) == 2  # scales 1 to start: dQ/dK/dV/dP at ~1e-2 use too little of FP8's range
    assert backward_runs(1e-2) == 1  # the kept scales fit
    assert backward_runs(1e2) == 2  # 10**4 larger: would clip, rerun
    assert backward_runs(1e2) == 1


def test_fp8_input_grad_refusal(monkeypatch, basic_manager, tmp_path, fake_plans):
    """An FP8 input that requires grad is refused by the op (autograd would hand it an unscaled FP8 gradient)."""
    _fe(monkeypatch, basic_manager, tmp_path)
    q8 = torch.zeros(1, 4, 2, 64, dtype=torch.float8_e4m3fn, requires_grad=True)
    one = torch.ones(())
    with pytest.raises(ValueError, match="requires grad"):
        opdispatch.attention(q8, q8, q8, q_descale=one, k_descale=one, v_descale=one)



# -- bf16/fp16: additive bias, ALiBi, backward (sdpa_backward) --------------------------------------------------------

def _standard_slopes(heads):
    """ALiBi's slopes (Press et al.; the form HF's BLOOM and cuDNN use), computed here in float64."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-8.0 * i / (2 * n)) for i in range(1, 2 * (heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def _oracle_scored(q, k, v, scale, causal, window, bottom_right, bias=None, slopes=None):
    """float64 attention (bshd) with opdispatch's score terms: + bias (broadcast to (b, h, s_q, s_k)), ALiBi as
    -slope * |i + o - j|; masked keys -inf; a row that sees no key gives zeros. Differentiable in q/k/v/bias."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk, vv = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    offset = sk - sq if bottom_right else 0
    i, j = torch.arange(sq)[:, None] + offset, torch.arange(sk)[None, :]
    if bias is not None:
        scores = scores + bias
    if slopes is not None:
        s = slopes.double().view(-1, hq, 1, 1)
        scores = scores - s * (i - j).abs().double()
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) if window[0] >= 0 else keep
        keep &= (j <= i + window[1]) if window[1] >= 0 else keep
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv)


def _assert_close_scaled(got, want, bits, name):
    torch.testing.assert_close(got.double(), want, atol=2 ** -bits * max(want.abs().max().item(), 1e-3),
                               rtol=2 ** -bits, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout,dtype,causal,window,align,heads,bias_shape,alibi,sq,sk", [
    ("bshd", torch.bfloat16, False, None, "top_left", (4, 2), (2, 4, 6, 9), False, 6, 9),
    ("bhsd", torch.float16, True, None, "top_left", (4, 4), (4, 6, 9), False, 6, 9),       # (h, s_q, s_k)
    ("sbhd", torch.bfloat16, False, (2, 1), "top_left", (6, 3), (2, 1, 1, 9), False, 6, 9),  # per key only
    ("bshd", torch.float16, False, None, "top_left", (2, 1), (6, 1), False, 6, 6),          # per query only
    ("bshd", torch.bfloat16, True, None, "top_left", (6, 2), None, True, 7, 7),             # ALiBi, 6 heads
    ("bhsd", torch.bfloat16, True, (3, 0), "top_left", (4, 2), (1, 1, 5, 8), True, 5, 8),   # both, window
    ("sbhd", torch.float16, True, None, "bottom_right", (4, 1), None, False, 5, 8),         # no bias: BR kept
])
def test_bias_and_alibi_forward_against_float64(fe, layout, dtype, causal, window, align, heads, bias_shape,
                                                alibi, sq, sk):
    """Additive bias of every broadcast pattern and cuDNN's ALiBi (the standard slopes) in the graph, combined
    with layouts, GQA, causal and windows: against the float64 oracle's bias and |i - j| distances."""
    gen = torch.Generator().manual_seed(41)
    b, d = 2, 16
    hq, hk = heads
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=gen).to(dtype) * 2
    slopes = _standard_slopes(hq) if alibi else None
    to = LAYOUT[layout]
    out = opdispatch.attention(to(q), to(k), to(v), layout=layout, causal=causal, causal_alignment=align,
                               window=window, attn_bias=bias, alibi_slopes=slopes)
    op = fake.graphs[-1].op
    assert op["kind"] == "sdpa" and op["use_alibi_mask"] is alibi and (op["bias"] is None) == (bias is None)
    if bias is not None:  # 4-D, batch/head dims kept as 1 or full, query/key dims full
        want_dim = tuple(bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).shape[:2]) + (sq, sk)
        assert op["bias"].dim == want_dim and fake._TORCH[op["bias"].data_type] == dtype
    want = _oracle_scored(q.double(), k.double(), v.double(), d ** -0.5, causal, window, align == "bottom_right",
                          None if bias is None else bias.double(), slopes)
    got = {"bshd": out, "bhsd": out.transpose(1, 2), "sbhd": out.transpose(0, 1)}[layout]
    assert out.dtype == dtype
    _assert_close_scaled(got, want, 6, "out")
    # the bias and ALiBi join the signature: the same q/k/v without them builds another graph
    built = len(fake.graphs)
    opdispatch.attention(to(q), to(k), to(v), layout=layout, causal=causal, causal_alignment=align,
                         window=window)
    assert len(fake.graphs) == built + (1 if bias is not None or alibi else 0)


@pytest.mark.parametrize("layout,dtype,causal,window,align,heads,bias_shape,bias_grad,alibi,sq,sk", [
    ("bshd", torch.bfloat16, True, None, "top_left", (4, 2), None, False, False, 7, 7),
    ("bhsd", torch.float16, False, None, "top_left", (2, 2), (2, 2, 5, 9), True, False, 5, 9),
    ("sbhd", torch.bfloat16, False, (2, 1), "top_left", (6, 3), (1, 6, 5, 9), True, False, 5, 9),
    ("bshd", torch.float16, True, (3, 0), "bottom_right", (4, 1), None, False, False, 5, 9),
    ("bshd", torch.bfloat16, True, None, "top_left", (4, 2), (2, 1, 1, 7), True, True, 7, 7),   # per key, ALiBi
    ("bhsd", torch.bfloat16, True, (2, 0), "top_left", (8, 2), (7, 1), False, True, 7, 7),    # per query, frozen
])
def test_half_backward_against_float64_autograd(monkeypatch, basic_manager, tmp_path, fake_plans, layout, dtype,
                                                causal, window, align, heads, bias_shape, bias_grad, alibi, sq, sk):
    """bf16/fp16 q/k/v (and a bias) that require grad: the forward graph writes the stats, sdpa_backward reads
    them (the fake rebuilds P from them) with the forward's bias, ALiBi and bounds; dq/dk/dv and the bias's
    gradient (summed over the dims it broadcasts over, in its own shape) against float64 autograd."""
    _fe(monkeypatch, basic_manager, tmp_path)
    gen = torch.Generator().manual_seed(42)
    b, d = 2, 16
    hq, hk = heads
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=gen).to(dtype)
    slopes = _standard_slopes(hq) if alibi else None
    d_o = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    to = LAYOUT[layout]
    leaves = [to(t).detach().requires_grad_() for t in (q, k, v)]
    bias_leaf = None if bias is None else bias.detach().requires_grad_(bias_grad)
    out = opdispatch.attention(*leaves, layout=layout, causal=causal, causal_alignment=align, window=window,
                               attn_bias=bias_leaf, alibi_slopes=slopes)
    assert out.dtype == dtype and out.requires_grad
    out.backward(to(d_o))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_bias = None if bias is None else bias.double().requires_grad_(bias_grad)
    want_out = _oracle_scored(*ref, d ** -0.5, causal, window, align == "bottom_right", ref_bias, slopes)
    want_out.backward(d_o.double())
    back = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.transpose(0, 1)}[layout]
    _assert_close_scaled(back(out), want_out.detach(), 6, "out")
    for name, leaf, r in zip(("dq", "dk", "dv"), leaves, ref, strict=True):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape
        _assert_close_scaled(back(leaf.grad), r.grad, 5, name)
    if bias_grad:
        assert bias_leaf.grad.shape == bias.shape and bias_leaf.grad.dtype == dtype
        _assert_close_scaled(bias_leaf.grad, ref_bias.grad, 5, "dbias")
    elif bias_leaf is not None:
        assert bias_leaf.grad is None
    backward = next(g for g in fake.graphs if g.op["kind"] == "sdpa_backward")
    assert backward.op["stats"].dim == (b, hq, sq, 1) and backward.op["use_alibi_mask"] is alibi
    assert (backward.op["dBias"] is not None) == bias_grad
    assert next(g for g in fake.graphs if g.op["kind"] == "sdpa").op["generate_stats"] is True
    # a second backward of the signature reuses its graph
    graphs = len(fake.graphs)
    leaves = [to(t).detach().requires_grad_() for t in (q, k, v)]
    opdispatch.attention(*leaves, layout=layout, causal=causal, causal_alignment=align, window=window,
                         attn_bias=bias_leaf, alibi_slopes=slopes).backward(to(d_o))
    assert len(fake.graphs) == graphs


def test_a_row_the_bias_blinds_gives_zeros_and_no_gradient(fe):
    """A query whose every key the bias sets to -inf (a keyless row: data, no selection sees it): output zeros
    and zero gradients from it, as the oracle's convention (cuDNN's fp16_ref.py zeroes such rows too)."""
    gen = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)
    bias[..., 2, :] = float("-inf")
    out = opdispatch.attention(q, k, v, attn_bias=bias)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
    out.backward(torch.ones_like(out))
    assert torch.equal(q.grad[:, 2], torch.zeros_like(q.grad[:, 2])) and torch.isfinite(k.grad).all()
    want = _oracle_scored(*(t.detach().double() for t in (q, k, v)), 16 ** -0.5, False, None, False, bias.double())
    _assert_close_scaled(out.detach(), want, 6, "out")


def _reasons(call_kwargs, qkv, device=None):
    d = opdispatch.explain(*qkv, device=device, **call_kwargs)
    return d, next(c for c in d.candidates if c.impl_id in ("test.cudnn_fe", "nvidia.cudnn_frontend"))


def test_bias_and_alibi_refusals_say_why(fe):
    """What cuDNN refuses is refused at selection with its reason: ALiBi without causal, ALiBi or a bias with a
    bottom-right diagonal, bias/ALiBi on FP8, a gradient for the slopes, a backward of one query and one key."""
    gen = torch.Generator().manual_seed(44)
    q, k = (torch.randn(1, s, 4, 16, generator=gen).to(torch.bfloat16) for s in (3, 5))
    slopes = _standard_slopes(4)
    _, cand = _reasons(dict(alibi_slopes=slopes), (q, k, k))
    assert any("ALiBi needs causal masking" in r for r in cand.reasons)
    bias = torch.zeros(3, 5)
    for extra in (dict(attn_bias=bias), dict(alibi_slopes=slopes)):
        _, cand = _reasons(dict(causal=True, causal_alignment="bottom_right", **extra), (q, k, k))
        assert any("bottom-right diagonal" in r and "without bias and ALiBi" in r for r in cand.reasons), extra
    # equal lengths: both alignments are one computation (canonicalized to top-left): taken
    d, cand = _reasons(dict(causal=True, causal_alignment="bottom_right", alibi_slopes=slopes), (q, q, q))
    assert d.chosen_id == "test.cudnn_fe"
    d, cand = _reasons(dict(causal=True, alibi_slopes=slopes.clone().requires_grad_()),
                       (q.clone().requires_grad_(), q, q))
    assert any("no gradient for alibi_slopes" in r for r in cand.reasons)
    one = torch.randn(1, 1, 4, 16, generator=gen).to(torch.bfloat16)
    d, cand = _reasons({}, (one.clone().requires_grad_(), one, one))
    assert any("s_q = s_kv = 1" in r for r in cand.reasons) and cand.status == "rejected"
    with torch.no_grad():
        assert _reasons({}, (one, one, one))[0].chosen_id == "test.cudnn_fe"
    q8 = torch.zeros(1, 4, 2, 64, dtype=torch.float8_e4m3fn)
    unit = torch.ones(())
    _, cand = _reasons(dict(attn_bias=torch.zeros(4, 4), q_descale=unit, k_descale=unit, v_descale=unit),
                       (q8, q8, q8))
    assert any("FP8 SDPA takes no attn_bias" in r for r in cand.reasons)


def test_alibi_slopes_other_than_cudnn_s_and_long_queries_are_refused_at_run_time(fe, caplog):
    """cuDNN's ALiBi has fixed slopes (written into its workspace) and the call's are data: slopes that differ
    are refused when the call runs (one host read), never computed with cuDNN's; so is a window over more queries
    than keys. The manager logs why and the call goes to the next implementation, whose result is right."""
    gen = torch.Generator().manual_seed(45)
    q = torch.randn(1, 6, 4, 16, generator=gen).to(torch.bfloat16)
    slopes = _standard_slopes(4) * 1.5
    with caplog.at_level("INFO", logger="opdispatch"):
        out = opdispatch.attention(q, q, q, causal=True, alibi_slopes=slopes)
    assert re.search(r"cuDNN's ALiBi uses the standard slopes for 4 heads", caplog.text)
    assert not any(g.op["use_alibi_mask"] for g in fake.graphs)
    want = _oracle_scored(q.double(), q.double(), q.double(), 16 ** -0.5, True, None, False, slopes=slopes)
    _assert_close_scaled(out, want, 6, "fallback out")
    k = torch.randn(1, 4, 4, 16, generator=gen).to(torch.bfloat16)
    caplog.clear()
    with caplog.at_level("INFO", logger="opdispatch"):
        out = opdispatch.attention(q, k, k, window=(2, 2))
    assert "only with seqlen_q <= seqlen_k" in caplog.text
    _assert_close_scaled(out, _oracle_scored(q.double(), k.double(), k.double(), 16 ** -0.5, False, (2, 2), False),
                         6, "fallback window")


def test_cudnn_s_alibi_slopes_match_the_published_formula():
    """The adapter's copy of get_alibi_slope against the fake's and the paper's (power of two and not)."""
    for heads in (1, 2, 4, 6, 8, 12, 16, 40):
        mine = torch.tensor(adapter_module._cudnn_alibi_slopes(heads))
        torch.testing.assert_close(mine, _standard_slopes(heads), rtol=1e-6, atol=0)
        torch.testing.assert_close(mine, torch.tensor(fake.alibi_slopes(heads), dtype=torch.float32), rtol=1e-6,
                                   atol=0)


def test_half_backward_head_dims_by_architecture(tmp_path):
    """sdpa_backward's head dims: up to 256 on Hopper, 128 elsewhere (a simulated A100 refuses 192 with grad,
    the H100 takes it)."""
    policy = tmp_path / "half.yaml"
    policy.write_text("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
                      "      nvidia.cudnn_frontend: {half: true}\n")
    fresh = opdispatch.OpManager()  # its own manager: the policy never reaches other tests' state
    fresh.set_policy(str(policy))
    previous = opdispatch.set_manager(fresh)
    try:
        q, k, v = meta_qkv(d=192, grad=True)
        for device, refused in (("a100", True), ("h100", False)):
            with_fe = device_with_library(tmp_path, device, "cudnn_frontend", "1.32.0")
            _, cand = _reasons({}, (q, k, v), device=with_fe)
            assert any("head dims up to 128 on sm8x" in r for r in cand.reasons) == refused, (device, cand.reasons)
    finally:
        opdispatch.set_manager(previous)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed_oracle(q, k, v, lens_q, lens_k, causal, window, bottom_right):
    """float64 thd attention, one dense oracle call per sequence (a sequence's rows see only its own keys);
    differentiable in the packed q/k/v."""
    d = q.shape[-1]
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(lens_q, lens_k, strict=True):
        outs.append(_oracle_scored(q[None, cq:cq + nq], k[None, ck:ck + nk], v[None, ck:ck + nk], d ** -0.5, causal,
                                   window, bottom_right)[0])
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


@pytest.mark.parametrize("dtype,heads,lens_q,lens_k,causal,window,align", [
    # self-attention (one cu_seqlens), GQA, a sequence of length 0
    (torch.bfloat16, (4, 2), [3, 0, 5, 2], None, True, None, "top_left"),
    # more queries than keys in one sequence, fewer in another: bottom-right leaves keyless rows (zeros)
    (torch.float16, (6, 3), [2, 5, 1], [6, 3, 4], True, None, "bottom_right"),
    # a window, top-left; a sequence with queries and no key at all
    (torch.bfloat16, (2, 1), [4, 1, 3], [2, 5, 0], False, (2, 1), "top_left"),
    # causal window, bottom-right, unequal both ways
    (torch.float16, (4, 4), [5, 2], [3, 7], True, (3, 0), "bottom_right"),
])
def test_thd_forward_and_backward_as_ragged_graphs_against_float64(
        monkeypatch, basic_manager, tmp_path, fake_plans, dtype, heads, lens_q, lens_k, causal, window, align):
    """Packed varlen (thd) is cuDNN's padded graph with ragged offsets: dims (batch, heads, max_seqlen, dim) with
    the packing's strides, offsets cu_seqlens * token stride (int64 elements), seq_len_q/kv int32 (b, 1, 1, 1), the
    padding mask; the backward as well (max_total_seq_len rounded up to 64). Output and gradients against a float64
    per-sequence oracle (the fake reads and writes only each sequence's rows through its offsets)."""
    _fe(monkeypatch, basic_manager, tmp_path)
    gen = torch.Generator().manual_seed(46)
    hq, hk = heads
    d = 16
    self_attention = lens_k is None
    lens_k = lens_q if self_attention else lens_k
    cu_q = _cu(lens_q)
    cu_k = cu_q if self_attention else _cu(lens_k)
    tq, tk = sum(lens_q), sum(lens_k)
    if self_attention:  # q/k/v slices of one packed qkv projection: a token stride of (hq + 2 hk) d
        qkv = torch.randn(tq, hq + 2 * hk, d, generator=gen).to(dtype)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    else:
        q = torch.randn(tq, hq, d, generator=gen).to(dtype)
        k, v = (torch.randn(tk, hk, d, generator=gen).to(dtype) for _ in range(2))
    d_o = torch.randn(tq, hq, d, generator=gen).to(dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    kwargs = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, causal_alignment=align,
                  window=window)
    out = opdispatch.attention(*leaves, **kwargs)
    out.backward(d_o)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    bottom_right = align == "bottom_right" and not self_attention
    want = _packed_oracle(*ref, lens_q, lens_k, causal, window, bottom_right)
    want.backward(d_o.double())
    assert out.dtype == dtype and out.shape == (tq, hq, d)
    _assert_close_scaled(out.detach(), want.detach(), 6, "out")
    for name, leaf, r in zip(("dq", "dk", "dv"), leaves, ref, strict=True):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype
        _assert_close_scaled(leaf.grad, r.grad, 5, name)
    forward = next(g for g in fake.graphs if g.op["kind"] == "sdpa")
    backward = next(g for g in fake.graphs if g.op["kind"] == "sdpa_backward")
    b, max_q, max_k = len(lens_q), max(lens_q), max(lens_k)
    # the forward reads q/k/v in their packing; the backward compact copies (h d per token: cuDNN 9.19's ragged
    # backward mis-addresses packed strides, benchmarks/results/h100-ce56e4a/cudnn_thd_probe-h100.md)
    for op, q_step, k_step in ((forward.op, q.stride(0), k.stride(0)), (backward.op, hq * d, hk * d)):
        assert op["use_padding_mask"] is True
        assert op["q"].dim == (b, hq, max_q, d) and op["q"].stride == (max_q * q_step, d, q_step, 1)
        assert op["k"].dim == (b, hk, max_k, d) and op["k"].stride == (max_k * k_step, d, k_step, 1)
        assert all(op[n].ragged_offset is not None for n in ("q", "k", "v"))
        assert op["seq_len_q"].dim == (b, 1, 1, 1) and op["seq_len_q"].data_type is fake.data_type.INT32
    assert forward.op["outputs"][0].ragged_offset is not None and forward.op["generate_stats"] is True
    assert all(t.ragged_offset is not None for t in backward.op["outputs"])
    assert backward.op["max_total_seq_len_q"] == max(64, -(-tq // 64) * 64)
    pack = next(e["pack"] for e in fake.executions if e["graph"] is forward)
    offsets = {t.uid: pack[t.ragged_offset.uid].reshape(-1) for t in (forward.op["q"], forward.op["k"])}
    assert offsets[forward.op["q"].uid].tolist() == (cu_q.long() * q.stride(0)).tolist()  # elements
    assert offsets[forward.op["k"].uid].tolist() == (cu_k.long() * k.stride(0)).tolist()
    assert pack[forward.op["seq_len_kv"].uid].reshape(-1).tolist() == lens_k
    # other lengths of the same batch and longest lengths reuse the graphs; a longer sequence builds new ones
    graphs = len(fake.graphs)
    swapped_q = list(reversed(lens_q))
    swapped_k = swapped_q if self_attention else list(reversed(lens_k))
    cu_q2 = _cu(swapped_q)
    cu_k2 = cu_q2 if self_attention else _cu(swapped_k)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out2 = opdispatch.attention(*leaves, **{**kwargs, "cu_seqlens_q": cu_q2, "cu_seqlens_k": cu_k2})
    out2.backward(d_o)
    assert len(fake.graphs) == graphs
    want2 = _packed_oracle(q.double(), k.double(), v.double(), swapped_q, swapped_k, causal, window, bottom_right)
    _assert_close_scaled(out2.detach(), want2, 6, "out (other lengths)")
    longer = torch.randn(max_q + 1, hq, d, generator=gen).to(dtype)
    one = _cu([max_q + 1])
    with torch.no_grad():
        opdispatch.attention(longer, longer[:, :hk], longer[:, :hk], layout="thd", cu_seqlens_q=one,
                             cu_seqlens_k=one, causal=causal, window=window)
    assert len(fake.graphs) == graphs + 1


def test_thd_refusals_say_why(fe):
    """FP8 and ALiBi with thd are refused at selection with the reason; dense calls are unaffected."""
    cu = _cu([3, 2])
    q = torch.zeros(5, 4, 16, dtype=torch.bfloat16)
    _, cand = _reasons(dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                            alibi_slopes=_standard_slopes(4)), (q, q, q))
    assert any("ALiBi with packed varlen (thd)" in r for r in cand.reasons)
    q8 = torch.zeros(5, 2, 64, dtype=torch.float8_e4m3fn)
    unit = torch.ones(())
    _, cand = _reasons(dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, q_descale=unit, k_descale=unit,
                            v_descale=unit), (q8, q8, q8))
    assert any("thd) is built here for bf16/fp16 only" in r for r in cand.reasons)
    d, _ = _reasons(dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu), (q, q, q))
    assert d.chosen_id == "test.cudnn_fe"


def test_the_fake_validates_padding_and_ragged_offsets_as_cudnn_does():
    """The fake refuses what cuDNN's validate refuses (sdpa_support_surface.h): ragged offsets without the padding
    mask, a padding mask without both lengths, lengths without the mask, max_total_seq_len without ragged tensors,
    a paged cache without lengths, paged_attention_max_seq_len_kv without page tables."""
    def graph_with(ragged=False, **sdpa_kwargs):
        g = fake.pygraph(io_data_type=fake.data_type.HALF)
        q, k, v = (g.tensor(uid=i, dim=(2, 2, 4, 8), stride=(64, 8, 16, 1), data_type=fake.data_type.HALF)
                   for i in (1, 2, 3))
        if ragged:
            q.set_ragged_offset(g.tensor(uid=9, dim=(3, 1, 1, 1), stride=(1, 1, 1, 1),
                                         data_type=fake.data_type.INT64))
        g.sdpa(q, k, v, generate_stats=False, **sdpa_kwargs)
        return g

    def lengths(g):
        return {n: g.tensor(uid=u, dim=(2, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fake.data_type.INT32)
                for n, u in (("seq_len_q", 7), ("seq_len_kv", 8))}

    with pytest.raises(fake.cudnnGraphNotSupportedError, match="Ragged offsets are only supported with padding"):
        graph_with(ragged=True).validate()
    with pytest.raises(RuntimeError, match="Padding mask requires seq_len_q and seq_len_kv"):
        graph_with(use_padding_mask=True).validate()
    g = fake.pygraph(io_data_type=fake.data_type.HALF)
    with pytest.raises(RuntimeError, match="needs to be set only if padding mask is enabled"):
        graph_with(**lengths(g)).validate()
    with pytest.raises(fake.cudnnGraphNotSupportedError, match="Paged caches can only be used"):
        graph_with(paged_attention_k_table=object()).validate()
    with pytest.raises(fake.cudnnGraphNotSupportedError, match="no need to explicitly set max kv"):
        graph_with(paged_attention_max_seq_len_kv=8).validate()
    g = fake.pygraph(io_data_type=fake.data_type.HALF)
    t = {n: g.tensor(uid=i, dim=(2, 2, 4, 8), stride=(64, 8, 16, 1), data_type=fake.data_type.HALF)
         for i, n in enumerate(("q", "k", "v", "o", "dO"), start=1)}
    stats = g.tensor(uid=6, dim=(2, 2, 4, 1), stride=(8, 4, 1, 1), data_type=fake.data_type.FLOAT)
    g.sdpa_backward(**t, stats=stats, max_total_seq_len_q=64)
    with pytest.raises(fake.cudnnGraphNotSupportedError, match="max_total_seq_len_q is only supported with packed"):
        g.validate()


def _paged_case(gen, dtype, b, sq, hq, hk, d, page, pages_per_seq, used):
    """q (b, sq, hq, d), page pools with one extra unused page, a shuffled block table, seqused_k = used."""
    num_pages = b * pages_per_seq + 1
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    k_pool, v_pool = (torch.randn(num_pages, page, hk, d, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(num_pages, generator=gen)[:b * pages_per_seq].view(b, pages_per_seq).int()
    return q, k_pool, v_pool, table, torch.tensor(used, dtype=torch.int32)


def _paged_oracle(q, k_pool, v_pool, table, used, causal, window, bottom_right):
    """float64 per sequence: its keys are its pages in table order, the first used[b] of them."""
    outs = []
    for b, n in enumerate(used.tolist()):
        keys = k_pool[table[b].long()].reshape(-1, *k_pool.shape[2:])[:n]
        values = v_pool[table[b].long()].reshape(-1, *v_pool.shape[2:])[:n]
        outs.append(_oracle_scored(q[b:b + 1].double(), keys[None].double(), values[None].double(),
                                   q.shape[-1] ** -0.5, causal, window, bottom_right))
    return torch.cat(outs)


@pytest.mark.parametrize("layout,dtype,sq,heads,used,causal,window,align", [
    ("bshd", torch.bfloat16, 1, (4, 2), [40, 0, 64], False, None, "top_left"),      # decode; an empty cache
    ("bhsd", torch.float16, 3, (4, 4), [33, 2, 64], True, None, "bottom_right"),     # chunked prefill, keyless rows
    ("bshd", torch.bfloat16, 3, (6, 2), [64, 5, 31], True, (4, 0), "bottom_right"),  # causal window, GQA
    ("sbhd", torch.float16, 2, (2, 1), [10, 64, 1], False, (1, 1), "top_left"),     # window, top-left
])
def test_paged_kv_forward_against_float64(fe, layout, dtype, sq, heads, used, causal, window, align):
    """A paged K/V cache is cuDNN's paged graph: the pools as (num_pages, heads, page_size, dim) views, the block
    table as paged_attention_k/v_table (b, 1, max_pages, 1) int32, paged_attention_max_seq_len_kv the table's
    capacity, the padding mask with seq_len_q = the queries and seq_len_kv = seqused_k (bottom-right counts from
    the fill). Against a float64 oracle over each sequence's gathered keys; one graph for any fill and table."""
    gen = torch.Generator().manual_seed(47)
    hq, hk = heads
    b, d, page, per_seq = 3, 16, 32, 2
    q, k_pool, v_pool, table, used_t = _paged_case(gen, dtype, b, sq, hq, hk, d, page, per_seq, used)
    to = LAYOUT[layout]
    kwargs = dict(layout=layout, causal=causal, causal_alignment=align, window=window)
    out = opdispatch.attention(to(q), k_pool, v_pool, seqused_k=used_t, block_table=table, **kwargs)
    back = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.transpose(0, 1)}[layout]
    want = _paged_oracle(q, k_pool, v_pool, table, used_t, causal, window, align == "bottom_right")
    assert out.dtype == dtype
    _assert_close_scaled(back(out), want, 6, "out")
    op = fake.graphs[-1].op
    assert op["kind"] == "sdpa" and op["use_padding_mask"] is True
    assert op["k"].dim == (k_pool.shape[0], hk, page, d) and op["k"].stride == k_pool.permute(0, 2, 1, 3).stride()
    assert op["page_table_k"].dim == (b, 1, per_seq, 1) and op["page_table_k"].data_type is fake.data_type.INT32
    assert op["max_seq_len_kv"] == per_seq * page
    pack = fake.executions[-1]["pack"]
    assert pack[op["seq_len_kv"].uid].reshape(-1).tolist() == used
    assert pack[op["seq_len_q"].uid].reshape(-1).tolist() == [sq] * b
    # another fill and another table reuse the graph
    graphs = len(fake.graphs)
    used2 = torch.tensor([64, 17, 0], dtype=torch.int32)
    table2 = table.flip(0).contiguous()
    out2 = opdispatch.attention(to(q), k_pool, v_pool, seqused_k=used2, block_table=table2, **kwargs)
    assert len(fake.graphs) == graphs
    _assert_close_scaled(back(out2), _paged_oracle(q, k_pool, v_pool, table2, used2, causal, window,
                                                   align == "bottom_right"), 6, "out (other fill)")


def test_paged_kv_entries_past_the_fill_never_reach_cudnn(fe):
    """Block-table entries past a sequence's fill may hold anything (-1 padding, ids past the pools): cuDNN gets
    page 0 there (whether its paged load reads them is undocumented), the used entries as given; the output is
    the oracle's over the used pages."""
    gen = torch.Generator().manual_seed(50)
    hq, hk, d, page, per_seq = 4, 2, 16, 32, 3
    used = [40, 0, 96]
    q, k_pool, v_pool, table, used_t = _paged_case(gen, torch.bfloat16, 3, 1, hq, hk, d, page, per_seq, used)
    hostile = table.clone()
    hostile[0, 2], hostile[1, :] = -1, k_pool.shape[0] + 7  # past the fills: row 0 uses 2 pages, row 1 none
    out = opdispatch.attention(q, k_pool, v_pool, seqused_k=used_t, block_table=hostile, causal=True,
                               causal_alignment="bottom_right")
    _assert_close_scaled(out, _paged_oracle(q, k_pool, v_pool, table, used_t, True, None, True), 6, "out")
    op, pack = fake.graphs[-1].op, fake.executions[-1]["pack"]
    given = pack[op["page_table_k"].uid].reshape(3, per_seq)
    assert given.tolist() == [[*table[0, :2].tolist(), 0], [0, 0, 0], table[2].tolist()]


def test_paged_kv_with_packed_queries(fe):
    """thd queries (cu_seqlens_q, ragged q/o) over a paged cache (seq_len_kv = seqused_k): both at once."""
    gen = torch.Generator().manual_seed(48)
    hq, hk, d, page = 4, 2, 16, 32
    lens_q, used = [2, 0, 3], [35, 7, 64]
    q_dense, k_pool, v_pool, table, used_t = _paged_case(gen, torch.bfloat16, 3, 3, hq, hk, d, page, 2, used)
    q = torch.cat([q_dense[i, :n] for i, n in enumerate(lens_q)])
    out = opdispatch.attention(q, k_pool, v_pool, layout="thd", cu_seqlens_q=_cu(lens_q), seqused_k=used_t,
                               block_table=table, causal=True, causal_alignment="bottom_right")
    rows = []
    for i, n in enumerate(lens_q):  # bottom-right per sequence: n queries end at its last used key
        rows.append(_paged_oracle(q_dense[i:i + 1, :n], k_pool, v_pool, table[i:i + 1], used_t[i:i + 1], True,
                                  None, True)[0])
    _assert_close_scaled(out, torch.cat(rows), 6, "out")
    op = fake.graphs[-1].op
    assert op["q"].ragged_offset is not None and op["k"].ragged_offset is None and op["page_table_v"] is not None


def test_paged_kv_refusals_say_why(fe):
    """Page sizes off the claimed multiple, a gradient, and FP8 over a paged cache are refused with reasons."""
    gen = torch.Generator().manual_seed(49)
    q, k_pool, v_pool, table, used = _paged_case(gen, torch.bfloat16, 2, 1, 4, 2, 16, 16, 2, [10, 20])
    _, cand = _reasons(dict(seqused_k=used, block_table=table), (q, k_pool, v_pool))
    assert any("page size 16 is not a multiple of 32" in r for r in cand.reasons)
    q, k_pool, v_pool, table, used = _paged_case(gen, torch.bfloat16, 2, 1, 4, 2, 16, 64, 2, [10, 20])
    _, cand = _reasons(dict(seqused_k=used, block_table=table), (q.requires_grad_(), k_pool, v_pool))
    assert any("paged K/V cache is forward only" in r for r in cand.reasons)
    unit = torch.ones(())
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q.detach(), k_pool, v_pool))
    _, cand = _reasons(dict(seqused_k=used, block_table=table, q_descale=unit, k_descale=unit, v_descale=unit),
                       (q8, k8, v8))
    assert any("paged K/V cache is built here for bf16/fp16 only" in r for r in cand.reasons)
    with torch.no_grad():
        d, _ = _reasons(dict(seqused_k=used, block_table=table), (q.detach(), k_pool, v_pool))
    assert d.chosen_id == "test.cudnn_fe"


def _dense_cache_oracle(q, k_cache, v_cache, used, causal, window, bottom_right):
    """float64 per sequence over its first used[b] cache rows (bshd)."""
    return torch.cat([_oracle_scored(q[b:b + 1].double(), k_cache[b:b + 1, :n].double(),
                                     v_cache[b:b + 1, :n].double(), q.shape[-1] ** -0.5, causal, window,
                                     bottom_right) for b, n in enumerate(used.tolist())])


@pytest.mark.parametrize("layout,dtype,sq,heads,used,causal,window,align", [
    ("bshd", torch.bfloat16, 1, (4, 2), [40, 0, 64], True, None, "bottom_right"),    # decode; an empty cache
    ("bhsd", torch.float16, 3, (4, 4), [33, 2, 64], True, None, "bottom_right"),     # chunked prefill, keyless rows
    ("bshd", torch.bfloat16, 3, (6, 2), [64, 5, 31], True, (4, 0), "bottom_right"),  # causal window, GQA
    ("sbhd", torch.float16, 2, (2, 1), [10, 64, 1], False, (1, 1), "top_left"),      # window, top-left
    ("bshd", torch.bfloat16, 70, (2, 1), [64, 3, 17], False, None, "top_left"),      # more queries than capacity
])
def test_dense_kv_cache_forward_against_float64(monkeypatch, basic_manager, tmp_path, fake_plans, layout, dtype, sq,
                                                heads, used, causal, window, align):
    """A dense cache (batch, capacity, heads, dim) with seqused_k is cuDNN's padding-mask graph over the cache as it
    is (seq_len_q = the queries, seq_len_kv = seqused_k; bottom-right counts from each fill), taken without the
    `half` option (its graph holds for every fill): against a float64 oracle over each sequence's used rows, and one
    graph for every fill."""
    _fe(monkeypatch, basic_manager, tmp_path, half=False)
    gen = torch.Generator().manual_seed(51)
    hq, hk = heads
    b, d, cap = 3, 16, 64
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(b, cap, hk, d, generator=gen).to(dtype) for _ in range(2))
    used_t = torch.tensor(used, dtype=torch.int32)
    to = LAYOUT[layout]
    kwargs = dict(layout=layout, causal=causal, causal_alignment=align, window=window)
    assert opdispatch.explain(to(q), to(k_cache), to(v_cache), seqused_k=used_t, **kwargs).chosen_id \
        == "test.cudnn_fe"
    out = opdispatch.attention(to(q), to(k_cache), to(v_cache), seqused_k=used_t, **kwargs)
    want = _dense_cache_oracle(q, k_cache, v_cache, used_t, causal, window, align == "bottom_right")
    assert out.dtype == dtype
    _assert_close_scaled(LAYOUT[layout](out), want, 6, "out")
    op = fake.graphs[-1].op
    assert op["kind"] == "sdpa" and op["use_padding_mask"] is True and op["page_table_k"] is None
    assert op["k"].dim == (b, hk, cap, d) and op["k"].ragged_offset is None and op["max_seq_len_kv"] is None
    pack = fake.executions[-1]["pack"]
    assert pack[op["seq_len_kv"].uid].reshape(-1).tolist() == used
    assert pack[op["seq_len_q"].uid].reshape(-1).tolist() == [sq] * b
    graphs = len(fake.graphs)
    used2 = torch.tensor([64, 17, 0], dtype=torch.int32)
    out2 = opdispatch.attention(to(q), to(k_cache), to(v_cache), seqused_k=used2, **kwargs)
    assert len(fake.graphs) == graphs, "another fill must reuse the graph"
    _assert_close_scaled(LAYOUT[layout](out2), _dense_cache_oracle(q, k_cache, v_cache, used2, causal, window,
                                                                   align == "bottom_right"), 6, "out (other fill)")


def test_dense_kv_cache_refusals_say_why(monkeypatch, basic_manager, tmp_path, fake_plans):
    """Over a dense cache: a gradient, FP8, and thd keys with seqused_k and no block table are refused with
    reasons; bf16 calls that are no KV cache still need `half` (the option kv_cache: false: the test below)."""
    _fe(monkeypatch, basic_manager, tmp_path, half=False)
    gen = torch.Generator().manual_seed(52)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(torch.bfloat16)
    cache = torch.randn(2, 64, 2, 16, generator=gen).to(torch.bfloat16)
    used = torch.tensor([10, 64], dtype=torch.int32)
    _, cand = _reasons(dict(seqused_k=used), (q.clone().requires_grad_(), cache, cache))
    assert any("K/V cache (seqused_k) is forward only" in r for r in cand.reasons)
    unit = torch.ones(())
    q8, c8 = q.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn)
    _, cand = _reasons(dict(seqused_k=used, q_descale=unit, k_descale=unit, v_descale=unit), (q8, c8, c8))
    assert any("K/V cache (seqused_k) is built here for bf16/fp16 only" in r for r in cand.reasons)
    packed = cache.reshape(128, 2, 16)
    _, cand = _reasons(dict(layout="thd", cu_seqlens_q=_cu([1, 1]), cu_seqlens_k=_cu([64, 64]), max_seqlen_q=1,
                            max_seqlen_k=64, seqused_k=used), (q.reshape(2, 4, 16), packed, packed))
    assert any("thd) keys with seqused_k and no block_table" in r for r in cand.reasons)
    _, cand = _reasons(dict(causal=True), (q, cache, cache))
    assert any("half: true" in r for r in cand.reasons)


def test_kv_cache_option_off_refuses_kv_cache_calls_with_the_fix(monkeypatch, basic_manager, tmp_path, fake_plans):
    """kv_cache: false takes KV-cache calls off the frontend (the reason names the fix) unless `half` takes every
    bf16/fp16 call."""
    _fe(monkeypatch, basic_manager, tmp_path, half=False, kv_cache=False)
    q = torch.randn(2, 1, 4, 16).to(torch.bfloat16)
    cache = torch.randn(2, 64, 2, 16).to(torch.bfloat16)
    call = dict(seqused_k=torch.tensor([10, 64], dtype=torch.int32))
    d, cand = _reasons(call, (q, cache, cache))
    assert d.chosen_id != "test.cudnn_fe" and any("kv_cache: true" in r for r in cand.reasons)
    both = tmp_path / "half-only.yaml"
    both.write_text("version: 1\nops:\n  attention:\n    order: ['test.*', cpu.flash, reference.math]\n"
                    "    options:\n      test.cudnn_fe: {half: true, kv_cache: false}\n")
    basic_manager.set_policy(both)
    assert _reasons(call, (q, cache, cache))[0].chosen_id == "test.cudnn_fe"


def test_kv_cache_decode_rule_on_a_simulated_h100(tmp_path, manager):
    """The default policy's kv-cache-decode-on-cudnn-frontend: with the wheel, a decode step of batch >= 8 over a
    dense or a 32-key-paged cache goes to the frontend by that rule; batch 1, 16-key pages (not a multiple of 32),
    chunked prefill (more than one query), a gradient, or no wheel keep torch's FA2 (decode-on-flash)."""
    with_fe = device_with_library(tmp_path, "h100", "cudnn_frontend", "1.32.0")
    meta = dict(device="meta", dtype=torch.bfloat16)

    def explain(sq=1, page=None, grad=False, device=with_fe, b=8):
        q = torch.empty(b, sq, 32, 128, requires_grad=grad, **meta)
        used = torch.empty(b, dtype=torch.int32, device="meta")
        if page is None:
            kv = torch.empty(b, 4096, 8, 128, **meta)
            return opdispatch.explain(q, kv, kv, seqused_k=used, causal=True, causal_alignment="bottom_right",
                                      device=device)
        kv = torch.empty(b * 4096 // page, page, 8, 128, **meta)
        table = torch.empty(b, 4096 // page, dtype=torch.int32, device="meta")
        return opdispatch.explain(q, kv, kv, seqused_k=used, block_table=table, causal=True,
                                  causal_alignment="bottom_right", device=device)

    for page in (None, 32, 256):
        for b in (8, 32):
            d = explain(page=page, b=b)
            assert d.chosen_id == "nvidia.cudnn_frontend", (page, b, d.chosen_id)
            assert d.decided_by.rule == "kv-cache-decode-on-cudnn-frontend"
        assert explain(page=page, b=1).chosen_id == "nvidia.flash"
    assert explain(page=16).chosen_id == "nvidia.flash"
    assert explain(sq=5, page=32).chosen_id != "nvidia.cudnn_frontend"
    assert explain(grad=True).chosen_id != "nvidia.cudnn_frontend"
    assert explain(device=str(device_descriptor("h100"))).chosen_id == "nvidia.flash"


def test_built_graphs_are_released_before_the_interpreter_exits(fe):
    """The frontend's graphs are nanobind objects: held at shutdown, each is reported as a leak. The exit hook
    empties every instance's caches; a later call builds again and computes the same."""
    gen = torch.Generator().manual_seed(53)
    q, k = (torch.randn(1, 4, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    impl = fe.registry.get("attention", "test.cudnn_fe").impl
    first = opdispatch.attention(q, k, k, causal=True)
    assert impl._graphs.graphs and impl._graphs in set(adapter_module._LIVE_GRAPHS)
    adapter_module._release_at_exit()
    assert not impl._graphs.graphs and not impl._graphs.handles
    built = len(fake.graphs)
    torch.testing.assert_close(opdispatch.attention(q, k, k, causal=True), first, rtol=0, atol=0)
    assert len(fake.graphs) == built + 1
