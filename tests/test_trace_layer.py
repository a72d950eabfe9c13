"""benchmarks/trace_layer.py and benchmarks/render_trace.py (issue 34's picture): the layer computes a Llama layer
(against a float64 oracle), the trimmed trace holds one step whose opdispatch ranges nest the ops they ran and link
to their backward nodes, the analysis matches kernels to ranges by correlation on a GPU-shaped trace, and the
renderer draws a PNG of the asked width."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch

from .conftest import REPO


def load(name):
    sys.path.insert(0, str(REPO / "benchmarks"))  # trace_layer imports render_trace as its sibling
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--device", "cpu", "--seq", "12", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--ffn", "24",
        "--warmup", "1"]


def oracle_layer(layer, x):
    """The same Llama layer in float64 torch, written out: RMSNorm, NeoX rotary, causal GQA softmax attention,
    fused residual RMSNorm, SwiGLU."""
    d = {n: getattr(layer, n).detach().double() for n in ("attn_norm", "mlp_norm", "wqkv", "wo", "w_gate_up",
                                                         "w_down", "cos", "sin")}
    x = x.detach().double()
    b, s, hidden = x.shape
    hq, hkv, hd = layer.heads, layer.kv_heads, layer.head_dim

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def rope(t):
        cos, sin = d["cos"][:s, None, :], d["sin"][:s, None, :]
        a, c = t[..., : hd // 2], t[..., hd // 2:]
        return torch.cat([a * cos - c * sin, c * cos + a * sin], dim=-1)

    qkv = rms(x, d["attn_norm"]) @ d["wqkv"].T
    q = rope(qkv[..., : hq * hd].reshape(b, s, hq, hd))
    k = rope(qkv[..., hq * hd: (hq + hkv) * hd].reshape(b, s, hkv, hd))
    v = qkv[..., (hq + hkv) * hd:].reshape(b, s, hkv, hd)
    k, v = (t.repeat_interleave(hq // hkv, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, hidden)
    x = x + attn @ d["wo"].T
    gate, up = (rms(x, d["mlp_norm"]) @ d["w_gate_up"].T).chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ d["w_down"].T


@pytest.mark.parametrize("seq,heads,kv_heads", [(7, 4, 2), (12, 6, 1), (5, 2, 2)])
def test_the_traced_layer_is_a_llama_layer(basic_manager, seq, heads, kv_heads):
    script = load("trace_layer")
    layer = script.Layer(heads=heads, kv_heads=kv_heads, head_dim=8, ffn=20, max_seq=seq, device=torch.device("cpu"),
                         dtype=torch.float32, seed=3)
    with torch.no_grad():  # trained weights are not all-ones: perturb the norms so they count
        layer.attn_norm.add_(torch.linspace(-0.5, 0.5, heads * 8))
        layer.mlp_norm.mul_(torch.linspace(0.5, 1.5, heads * 8))
    x = torch.randn(2, seq, heads * 8, generator=torch.Generator().manual_seed(seq))
    out = layer(x)
    torch.testing.assert_close(out.double(), oracle_layer(layer, x), rtol=2e-5, atol=2e-5)


@pytest.fixture
def traced(basic_manager, tmp_path):
    script = load("trace_layer")
    trace, summary = tmp_path / "trace-cpu.json", tmp_path / "trace-cpu.md"
    assert script.main([*TINY, "--trace", str(trace), "--summary", str(summary)]) == 0
    return script, trace, summary


def test_the_trace_holds_one_step_with_nested_ranges_and_their_backward(traced):
    script, trace, summary = traced
    render = load("render_trace")
    assert trace.stat().st_size < 1_000_000 and not list(trace.parent.glob("*.full.json"))
    data = render.load_trace(trace)
    events = data["traceEvents"]
    steps = [e for e in events if e.get("name") in (script.PROFILED_STEP, script.BIND_STEP)]
    assert [(e["name"], e["ts"]) for e in steps] == [(script.PROFILED_STEP, 0)]  # trimmed to it, rebased
    assert min(e["ts"] for e in events if e.get("ph") == "X") == 0
    a = render.analyse(data)
    assert [r.op for r in a.ranges] == ["rms_norm", "rotary_embedding", "attention", "rms_norm"]
    assert [r.name for r in a.ranges][2] == "opdispatch.attention[cpu.flash]"
    for r in a.ranges:
        assert r.name == f"opdispatch.{r.op}[{r.impl}]" and not r.is_backward
        assert r.ops and all(render._inside(o, r.event) for o in r.ops)  # the aten ops nest under the range
        assert r.backward_nodes, r.name  # and its forward ops link to the autograd nodes that ran their backward
        assert all(n["ts"] > r.event["ts"] + r.event["dur"] for n in r.backward_nodes)
    attention = a.ranges[2]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in {o["name"] for o in attention.top_ops}
    assert any("ScaledDotProductFlashAttentionForCpuBackward0" in n["name"] for n in attention.backward_nodes)
    assert any(o["name"] == "aten::add" for o in a.ranges[3].top_ops)  # the residual add fused into the norm
    # Shapes were recorded; no device work on the CPU, and no flow dangles.
    assert any(o.get("args", {}).get("Input Dims") for o in attention.ops)
    assert not a.device_slices
    flow_ids = [e["id"] for e in events if e.get("cat") == "fwdbwd"]
    assert flow_ids and all(flow_ids.count(i) == 2 for i in flow_ids)
    text = summary.read_text()
    for r in a.ranges:
        assert f"`{r.name}` | {r.op} | {r.impl} |" in text
    assert "0 decisions" in text and "attention 1 calls (1 fast-path hits)" in text


def test_a_gzipped_trace_is_written_and_read_back(basic_manager, tmp_path):
    script, render = load("trace_layer"), load("render_trace")
    trace = tmp_path / "t.json.gz"
    assert script.main([*TINY, "--trace", str(trace)]) == 0
    assert trace.read_bytes()[:2] == b"\x1f\x8b"
    assert len(render.analyse(render.load_trace(trace)).ranges) == 4


@pytest.mark.parametrize("argv,message", [
    (["--heads", "4", "--kv-heads", "3"], "not a multiple of --kv-heads=3"),
    (["--head-dim", "7"], "even head dim"),
    (["--seq", "0"], "--seq=0: must be a positive integer"),
    (["--warmup", "0"], "--warmup=0"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, capsys, argv, message):
    trace = tmp_path / "t.json"
    with pytest.raises(SystemExit):
        load("trace_layer").main(["--device", "cpu", *argv, "--trace", str(trace)])
    assert message in capsys.readouterr().err and not trace.exists()


def gpu_shaped_trace():
    """A Kineto-shaped CUDA trace: the main thread runs a range launching two kernels and an unrelated matmul; the
    autograd thread runs the range's backward node, launching one more; an earlier step's kernel is outside."""
    host, gpu = dict(pid=10, tid=10), dict(pid=0, tid=7)
    bwd = dict(pid=10, tid=11)

    def x(cat, name, ts, dur, where, **args):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=args, **where)

    return {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
        {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
        x("user_annotation", "trace_layer.step", 0, 5, host),
        x("cuda_runtime", "cudaLaunchKernel", 1, 1, host, correlation=1),  # the earlier step's
        x("kernel", "old_kernel", 2, 1, gpu, correlation=1),
        x("user_annotation", "trace_layer.step", 100, 300, host),
        x("user_annotation", "opdispatch.attention[nvidia.flash_attn3]", 110, 40, host),
        x("cpu_op", "flash_attn_3::fwd", 112, 30, host),
        x("cuda_driver", "cuLaunchKernelEx", 115, 5, host, correlation=7),
        x("cuda_runtime", "cudaLaunchKernel", 125, 5, host, correlation=8),
        x("cpu_op", "aten::mm", 160, 20, host),
        x("cuda_runtime", "cudaLaunchKernel", 165, 5, host, correlation=9),
        x("cpu_op", "autograd::engine::evaluate_function: FlashAttnBackward", 250, 50, bwd),
        x("cpu_op", "FlashAttnBackward", 250, 48, bwd),
        x("cuda_runtime", "cudaLaunchKernel", 260, 5, bwd, correlation=12),
        x("kernel", "void flash::flash_fwd_kernel<Ktraits>(Params)", 130, 50, gpu, correlation=7),
        x("kernel", "void at::native::softmax_lse<float>(float*)", 181, 4, gpu, correlation=8),
        x("kernel", "sm90_xmma_gemm_bf16", 186, 30, gpu, correlation=9),
        x("kernel", "void flash::flash_bwd_kernel<K>(P)", 270, 90, gpu, correlation=12),
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": 3, "ts": 112, **host},
        {"ph": "f", "cat": "fwdbwd", "name": "fwdbwd", "id": 3, "ts": 250, "bp": "e", **bwd},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 7, "ts": 115, **host},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 7, "ts": 130, "bp": "e", **gpu},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": 1, **host},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": 2, "bp": "e", **gpu},
    ]}


def test_kernels_are_matched_to_their_range_and_backward_by_correlation(tmp_path):
    script, render = load("trace_layer"), load("render_trace")
    trimmed = script.trim(gpu_shaped_trace())
    names = [e["name"] for e in trimmed["traceEvents"]]
    assert "old_kernel" not in names and names.count("trace_layer.step") == 1
    assert sorted(e["id"] for e in trimmed["traceEvents"] if e.get("cat") == "ac2g") == [7, 7]
    a = render.analyse(trimmed)
    (r,) = a.ranges
    assert (r.op, r.impl) == ("attention", "nvidia.flash_attn3") and a.on_gpu
    assert [k["name"] for k in r.kernels] == ["void flash::flash_fwd_kernel<Ktraits>(Params)",
                                              "void at::native::softmax_lse<float>(float*)"]  # not the matmul's
    assert [n["name"] for n in r.backward_nodes] == ["autograd::engine::evaluate_function: FlashAttnBackward"]
    assert [k["name"] for k in r.backward_kernels] == ["void flash::flash_bwd_kernel<K>(P)"]
    assert render.short_kernel_name(r.kernels[0]["name"]) == "flash::flash_fwd_kernel"
    text = script.summarise(trimmed, ["# t"])
    assert "`flash::flash_fwd_kernel` 50.0<br>`at::native::softmax_lse` 4.0 | `flash::flash_bwd_kernel` 90.0 |" in text
    assert "174.0 µs in 4 kernels/copies; 144.0 µs (83%)" in text
    out = tmp_path / "gpu.png"
    assert render.render(trimmed, out, width_px=1200) [0] == 1200


def test_render_draws_the_cpu_trace_at_the_asked_width(traced, tmp_path):
    _, trace, _ = traced
    render = load("render_trace")
    out = tmp_path / "cpu.png"
    assert render.main([str(trace), "--out", str(out)]) == 0
    from matplotlib import image

    pixels = image.imread(out)
    assert pixels.shape[1] == 1600 and 300 <= pixels.shape[0] <= 1600
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::97]}) > 5  # drawn, not blank


def test_render_refuses_what_it_cannot_draw(tmp_path):
    render = load("render_trace")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        render.load_trace(bad)
    no_ranges = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0,
                                  "dur": 1}]}
    with pytest.raises(ValueError, match="no opdispatch"):
        render.render(no_ranges, tmp_path / "x.png")
    with pytest.raises(ValueError, match="width_px=100"):
        render.render(gpu_shaped_trace(), tmp_path / "x.png", width_px=100)
    assert not (tmp_path / "x.png").exists()
