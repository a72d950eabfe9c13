"""FP8 attention with an FP8 output (out_dtype float8_e4m3fn/e5m2 quantized by out_scale, as TransformerEngine's
fp8_mha keeps FP8 across attention) and out_amax: the reference against a float64 oracle quantized the same way,
every validation error, nvidia.cudnn_frontend against its fake, and explain on a simulated H100."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import opdispatch
from opdispatch.vendors.nvidia import CudnnFrontendAttention
from opdispatch.vendors.nvidia import _cudnn_frontend as adapter_module

from tests._adapters_on_cpu import device_with_library, meta_qkv, run_on_cpu, unbound_from_device
from tests.fakes import cudnn_frontend as fake

F8, E5 = torch.float8_e4m3fn, torch.float8_e5m2
LAYOUT = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2).contiguous(),
          "sbhd": lambda t: t.transpose(0, 1).contiguous()}
BACK = {"bshd": lambda t: t, "bhsd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.transpose(0, 1)}


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """float64 (b, s, h, d) attention of dequantized inputs, top-left causal; GQA by h // (hq / hk)."""
    hq, hk = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v)


def _saturated(real: torch.Tensor, scale: float, kind: torch.dtype) -> torch.Tensor:
    """The oracle's quantization, written independently of the op: real * scale clipped to FP8's largest finite,
    then rounded to `kind` (the cast is exact on in-range float64 values' nearest FP8)."""
    top = torch.finfo(kind).max
    return torch.clamp(real * scale, min=-top, max=top).to(kind)


def _inputs(seed: int, kind: torch.dtype, b: int = 2, sq: int = 5, sk: int = 7, heads: tuple[int, int] = (4, 2),
            d: int = 16):
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    q, k, v = ((torch.randn(b, s, h, d, generator=gen) * 3).to(kind) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    qs, ks, vs = (torch.rand((), generator=gen) * 0.5 + 0.05 for _ in range(3))
    return q, k, v, (qs, ks, vs)


@pytest.mark.parametrize("layout,kind,causal,headroom,scale_shape", [
    ("bshd", F8, False, 0.5, ()),      # in range: plain rounding
    ("bhsd", F8, True, 3.0, (1,)),     # 3x the range: the largest values saturate (never NaN)
    ("sbhd", E5, True, 0.9, ()),
    ("bshd", E5, False, 4.0, (1,)),
])
def test_reference_fp8_output_and_amax_match_the_quantized_float64_oracle(layout, kind, causal, headroom,
                                                                          scale_shape):
    q, k, v, (qs, ks, vs) = _inputs(hash((layout, causal)) % 2**31, kind)
    want = _oracle(q.double() * qs.double(), k.double() * ks.double(), v.double() * vs.double(), causal)
    amax_true = want.abs().max().item()
    scale = headroom * torch.finfo(kind).max / amax_true  # headroom > 1: some outputs beyond FP8's range
    out_scale = torch.full(scale_shape, scale, dtype=torch.float32)
    out_amax = torch.full((), -1.0)
    to = LAYOUT[layout]
    out = opdispatch.attention(to(q), to(k), to(v), layout=layout, causal=causal, q_descale=qs, k_descale=ks,
                               v_descale=vs, out_dtype=kind, out_scale=out_scale, out_amax=out_amax,
                               impl="reference.math")
    got = BACK[layout](out)
    assert out.dtype == kind and got.shape == want.shape
    assert not torch.isnan(got.float()).any()
    # amax: of the float32 output, before the scale (float32 compute: a relative 1e-5 of float64's)
    assert abs(out_amax.item() - amax_true) <= 1e-5 * amax_true
    expected = _saturated(want, float(out_scale.reshape(())), kind).double()
    # float32 compute may land on the neighbouring FP8 value at a rounding boundary: one FP8 step at most
    step = 2.0 ** -(3 if kind == F8 else 2)
    torch.testing.assert_close(got.double(), expected, rtol=step, atol=2.0 ** -6)
    if headroom > 1:
        assert (got.double().abs() == torch.finfo(kind).max).any()  # saturated, where torch's bare cast gives NaN
    # dequantized, the output is the real one within FP8's rounding (where not saturated)
    inside = want.abs() * scale < torch.finfo(kind).max
    torch.testing.assert_close((got.double() / scale)[inside], want[inside], rtol=step, atol=1e-3 / scale)


def test_out_amax_with_a_bf16_output_and_return_lse():
    q, k, v, (qs, ks, vs) = _inputs(3, F8, heads=(2, 2))
    want = _oracle(q.double() * qs.double(), k.double() * ks.double(), v.double() * vs.double(), True)
    out_amax = torch.zeros(1)
    out, lse = opdispatch.attention(q, k, v, causal=True, q_descale=qs, k_descale=ks, v_descale=vs,
                                    out_amax=out_amax, return_lse=True, impl="reference.math")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 2, 5)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=2 ** -8)
    assert abs(out_amax.item() - want.abs().max().item()) <= 1e-5 * want.abs().max().item()


def _fp8_call_args(**overrides):
    q, k, v, (qs, ks, vs) = _inputs(5, F8, heads=(2, 2))
    args = dict(q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=F8, out_scale=torch.ones(()),
                out_amax=torch.zeros(()))
    args.update(overrides)
    return q, k, v, args


@pytest.mark.parametrize("overrides,error,words", [
    (dict(out_scale=None), ValueError, ["out_dtype=torch.float8_e4m3fn needs out_scale", "shape () or (1,)"]),
    (dict(out_dtype=None), ValueError, ["out_scale given but out_dtype is torch.bfloat16", "out_dtype=torch.float8"]),
    (dict(out_dtype=torch.float16), ValueError, ["out_scale given but out_dtype is torch.float16"]),
    (dict(out_scale=1.0), TypeError, ["out_scale must be a torch.Tensor", "float"]),
    (dict(out_scale=torch.ones((), dtype=torch.float64)), TypeError, ["out_scale must be float32"]),
    (dict(out_scale=torch.ones(2)), ValueError, ["out_scale has shape (2,)", "allowed: () or (1,)"]),
    (dict(out_scale=torch.ones(1, 1)), ValueError, ["out_scale has shape (1, 1)"]),
    (dict(out_scale=torch.ones((), device="meta")), ValueError, ["out_scale is on meta but q is on cpu"]),
    (dict(out_scale=torch.zeros(())), ValueError, ["out_scale=0.0 is not a finite positive factor"]),
    (dict(out_scale=torch.tensor(-2.0)), ValueError, ["out_scale=-2.0"]),
    (dict(out_scale=torch.tensor(float("inf"))), ValueError, ["out_scale=inf"]),
    (dict(out_scale=torch.tensor(float("nan"))), ValueError, ["out_scale=nan"]),
    (dict(out_scale=torch.ones((), requires_grad=True)), ValueError, ["out_scale requires grad", "detach"]),
    (dict(out_amax=torch.zeros((), dtype=torch.bfloat16)), TypeError, ["out_amax must be float32"]),
    (dict(out_amax=torch.zeros(1, 1)), ValueError, ["out_amax has shape (1, 1)"]),
    (dict(out_amax=torch.zeros((), device="meta")), ValueError, ["out_amax is on meta"]),
    (dict(out_amax=torch.zeros((), requires_grad=True)), ValueError, ["out_amax requires grad", "in place"]),
    (dict(out_amax=[0.0]), TypeError, ["out_amax must be a torch.Tensor"]),
    (dict(out_dtype=torch.int8), ValueError, ["out_dtype=torch.int8 is not an FP8 call's output",
                                              "torch.float8_e4m3fn"]),
])
def test_fp8_output_validation_errors_say_what_and_how_to_fix(overrides, error, words):
    q, k, v, args = _fp8_call_args(**overrides)
    amax = args["out_amax"]
    before = amax.clone() if isinstance(amax, torch.Tensor) and amax.device.type != "meta" else None
    with pytest.raises(error) as info:
        opdispatch.attention(q, k, v, **args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    if before is not None:  # nothing written before the inputs are checked
        assert torch.equal(amax, before)


def test_out_amax_sharing_an_input_s_memory_is_refused_unwritten():
    q, k, v, args = _fp8_call_args()
    args["out_amax"] = args["v_descale"]
    before = args["v_descale"].clone()
    with pytest.raises(ValueError, match="out_amax shares memory with v_descale"):
        opdispatch.attention(q, k, v, **args)
    assert torch.equal(args["v_descale"], before)


@pytest.mark.parametrize("name", ["out_scale", "out_amax"])
def test_out_scale_and_amax_are_refused_on_non_fp8_calls(name):
    x = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"{name} given but q/k/v are bf16.*drop them"):
        opdispatch.attention(x, x, x, **{name: torch.ones(())})


def test_a_shape_error_leaves_out_amax_unwritten():
    q, k, v, args = _fp8_call_args()
    args["out_amax"] = torch.full((), 7.0)
    with pytest.raises(ValueError):
        opdispatch.attention(q, k[:, :, :1], v, **args, layout="bhsd", window=(1, -5))
    assert args["out_amax"].item() == 7.0


@pytest.mark.parametrize("name", ["out_scale", "out_amax"])
def test_fp8_output_arguments_are_refused_under_compile(name):
    from opdispatch.compile._compile import _EAGER_ONLY_ARGS, attention_for_compile

    assert name in _EAGER_ONLY_ARGS
    q, k, v, args = _fp8_call_args()
    with pytest.raises(ValueError, match="run this call eagerly"):
        attention_for_compile(q, k, v, **{name: args[name]})


# -- nvidia.cudnn_frontend against the fake ------------------------------------------------------------------------

@pytest.fixture
def fe(monkeypatch, basic_manager, tmp_path):
    fake.graphs.clear()
    fake.executions.clear()
    monkeypatch.setattr(fake, "plan_count", 1)
    monkeypatch.setattr(fake, "unbuildable_plans", set())
    return run_on_cpu(monkeypatch, basic_manager, tmp_path, fake.fake_modules(),
                      unbound_from_device(CudnnFrontendAttention, "cudnn_fe"), options={"autotune": False})


@pytest.mark.parametrize("kind,causal,headroom,amax", [(F8, True, 0.5, True), (F8, False, 2.0, False),
                                                       (E5, True, 0.8, True)])
def test_cudnn_frontend_fp8_output_passes_the_caller_s_scale_and_amax(fe, monkeypatch, kind, causal, headroom,
                                                                       amax):
    def refused(*args, **kwargs):
        raise AssertionError("the FP8 output needs neither v's amax nor a dequantization")

    monkeypatch.setattr(adapter_module, "_output_scale", refused)
    monkeypatch.setattr(adapter_module, "_dequantize", refused)
    q, k, v, (qs, ks, vs) = _inputs(21, kind, b=2, sq=6, sk=6, heads=(4, 2), d=64)
    want = _oracle(q.double() * qs.double(), k.double() * ks.double(), v.double() * vs.double(), causal)
    scale = headroom * torch.finfo(kind).max / want.abs().max().item()
    out_scale = torch.full((), scale)
    out_amax = torch.zeros(()) if amax else None
    out = opdispatch.attention(q, k, v, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=kind,
                               out_scale=out_scale, out_amax=out_amax)
    assert out.dtype == kind
    op = fake.graphs[-1].op
    pack = fake.executions[-1]["pack"]
    assert op["kind"] == "sdpa_fp8" and fake._TORCH[op["outputs"][0].data_type] == kind
    assert pack[op["scale_o"].uid].data_ptr() == out_scale.data_ptr()  # the caller's factor, no copy
    amax_o = pack[op["outputs"][3].uid]
    assert (amax_o.data_ptr() == out_amax.data_ptr()) if amax else amax_o.data_ptr() != 0
    if amax:
        assert abs(out_amax.item() - want.abs().max().item()) <= 1e-6 * want.abs().max().item()
    step = 2.0 ** -(3 if kind == F8 else 2)
    expected = _saturated(want, scale, kind).double()
    torch.testing.assert_close(out.double(), expected, rtol=step, atol=2.0 ** -6)


def test_cudnn_frontend_bf16_output_writes_amax_o_into_out_amax(fe):
    q, k, v, (qs, ks, vs) = _inputs(22, F8, b=1, sq=5, sk=5, heads=(2, 1), d=64)
    want = _oracle(q.double() * qs.double(), k.double() * ks.double(), v.double() * vs.double(), False)
    out_amax = torch.zeros(1)
    out = opdispatch.attention(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, out_amax=out_amax)
    assert out.dtype == torch.bfloat16
    op = fake.graphs[-1].op
    assert fake.executions[-1]["pack"][op["outputs"][3].uid].data_ptr() == out_amax.data_ptr()
    assert abs(out_amax.item() - want.abs().max().item()) <= 1e-6 * want.abs().max().item()


def test_cudnn_frontend_refuses_an_fp8_output_of_another_kind_with_the_fix(fe):
    q, k, v, (qs, ks, vs) = _inputs(23, F8, d=64)
    d = opdispatch.explain(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=E5,
                           out_scale=torch.ones(()))
    cand = next(c for c in d.candidates if c.impl_id == "test.cudnn_fe")
    assert any("inputs' kind (torch.float8_e4m3fn), not torch.float8_e5m2" in r for r in cand.reasons)
    assert d.chosen_id == "reference.math"


@pytest.mark.parametrize("out_dtype,amax", [(F8, False), (torch.bfloat16, True), (F8, True)])
def test_explain_on_a_simulated_h100_picks_cudnn_frontend_and_gives_fa3_s_reason(tmp_path, out_dtype, amax):
    # an H100 with both FP8 kernels installed: FA3 (ahead in the default order) and the cuDNN frontend
    with_fe = Path(device_with_library(tmp_path, "h100", "cudnn_frontend", "1.32.0"))
    device = tmp_path / "h100-fe-fa3.yaml"
    device.write_text(with_fe.read_text().replace("libraries:\n", 'libraries:\n  flash_attn_3: "3.0.0"\n'))
    q, k, v = (t.to(F8) for t in meta_qkv())
    one = torch.ones((), device="meta")
    extra = {"out_scale": one} if out_dtype == F8 else {}
    if amax:
        extra["out_amax"] = torch.zeros((), device="meta")
    d = opdispatch.explain(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one, out_dtype=out_dtype,
                           device=str(device), **extra)
    assert d.chosen_id == "nvidia.cudnn_frontend", str(d)
    fa3 = next(c for c in d.candidates if c.impl_id == "nvidia.flash_attn3")
    if out_dtype == F8:
        assert any("FP8 output dtype fp8_e4m3fn not supported (supported: bf16): this kernel cannot produce an "
                   "FP8 output" in r for r in fa3.reasons), fa3.reasons
    if amax:
        assert any("out_amax" in r and "not produced" in r for r in fa3.reasons), fa3.reasons
    assert "out_amax" in str(d) if amax else True
    # the same call with a bf16 output and no amax: FA3 takes it (so the reasons above are what moved the choice)
    plain = opdispatch.explain(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one,
                               device=str(device))
    assert plain.chosen_id == "nvidia.flash_attn3", str(plain)


def test_aiter_says_it_returns_bf16_only():
    from opdispatch.vendors.rocm._attention import RocmAiter

    caps = RocmAiter.caps
    assert not FP8_KINDS & caps.fp8_out_dtypes and not caps.fp8_out_amax


FP8_KINDS = frozenset({F8, E5})
