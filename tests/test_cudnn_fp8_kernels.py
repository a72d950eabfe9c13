"""The Triton kernels around nvidia.cudnn_frontend's FP8 graph (vendors/opdispatch/vendors/nvidia/_cudnn_fp8_triton.py), run where
the suite runs (Triton's interpreter on CPU, tests/conftest.py; the GPU as they are): the output scale against
fp8_max / max|v| computed in float64 from the dequantized values, on strided views, both FP8 kinds, subnormal-only,
zero, NaN/inf and negative-descale rows, twice on one accumulator (it must come back zeroed); the dequantization
against float64 o8 / scale rounded to the output dtype."""

from __future__ import annotations

import pytest
import torch

from opdispatch.vendors.nvidia import _cudnn_frontend as fe

pytestmark = pytest.mark.skipif(fe._triton_kernels() is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _want_scale(v8: torch.Tensor, descale: float) -> float:
    """fp8_max / (max|v8| |descale|) in float64, a NaN or inf counted as the largest finite; 1 for zero."""
    fp8_max = torch.finfo(v8.dtype).max
    mags = v8.double().abs().nan_to_num(nan=fp8_max, posinf=fp8_max)
    v_max = mags.max().item() * abs(descale)
    return fp8_max / v_max if v_max > 0 else 1.0


def _strided_v(kind: torch.dtype, values: torch.Tensor) -> torch.Tensor:
    """(b, h, s, d) view of a bshd buffer with a sliced head dim: no dimension contiguous but d."""
    return values.to(kind).transpose(1, 2)[..., 3:67]


@pytest.mark.parametrize("kind", KINDS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("content", ["random", "subnormal_only", "zero", "nan_and_inf", "negative_descale"])
def test_output_scale_is_fp8_max_over_max_abs_v_and_leaves_the_accumulator_zeroed(kind, content):
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(2, 70, 3, 80, generator=gen) * 30
    fp8_min_normal = torch.finfo(kind).smallest_normal
    if content == "subnormal_only":
        values = values / values.abs().max() * fp8_min_normal * 0.9
    elif content == "zero":
        values = values * 0
    v = _strided_v(kind, values).to(DEVICE)
    if content == "nan_and_inf":
        v.view(torch.uint8)[1, 2, 5, 7] = 0x7F  # NaN in both kinds
        v.view(torch.uint8)[0, 0, 3, 0] = 0xFC if kind == torch.float8_e5m2 else 0xFF  # -inf in e5m2, NaN e4m3
    descale = -0.37 if content == "negative_descale" else 0.0123
    scratch = fe._Scratch(torch.device(DEVICE))
    fe._output_scale(v, torch.tensor(descale, device=DEVICE), scratch)
    torch.testing.assert_close(scratch.scale_o.item(), _want_scale(v.cpu(), descale), rtol=1e-6, atol=0)
    assert scratch.v_bits.item() == 0
    # the same scratch again, with a v of smaller magnitude: its own scale, not the last call's maximum
    smaller = _strided_v(kind, torch.randn(2, 70, 3, 80, generator=gen)).to(DEVICE)
    fe._output_scale(smaller, torch.tensor(descale, device=DEVICE), scratch)
    torch.testing.assert_close(scratch.scale_o.item(), _want_scale(smaller.cpu(), descale), rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "d_strided"])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_v_amax_reaches_every_row_of_every_layout(layout, where):
    """More row tiles than programs (each program loops): one element far above the rest, at the first, last or
    a middle element of the (b, h, s, d) view, in four memory layouts — the scale must be the one it sets."""
    gen = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 3, 300, 64  # 1800 rows of 64: 15 tiles of 128 rows over 4 programs on CPU
    base = torch.rand(b, s, h, d + (8 if layout == "d_strided" else 0), generator=gen)
    view = {"bshd": lambda t: t.transpose(1, 2), "bhsd": lambda t: t.transpose(1, 2).contiguous(),
            "sbhd": lambda t: t.transpose(0, 1).contiguous().permute(1, 2, 0, 3),
            "d_strided": lambda t: t.transpose(1, 2)[..., ::2][..., : d // 2 + 1]}[layout](base)
    index = {"first": (0, 0, 0, 0), "last": tuple(n - 1 for n in view.shape),
             "middle": (1, 2, 173, view.shape[-1] // 2)}[where]
    view[index] = 400.0
    v = view.to(torch.float8_e4m3fn).to(DEVICE) if layout != "d_strided" else \
        _fp8_view_like(view, torch.float8_e4m3fn).to(DEVICE)
    scratch = fe._Scratch(torch.device(DEVICE))
    fe._output_scale(v, torch.tensor(1.0, device=DEVICE), scratch)
    assert v.cpu().double().abs().max().item() == 384.0  # 400 in e4m3; every other element is below 1
    torch.testing.assert_close(scratch.scale_o.item(), _want_scale(v.cpu(), 1.0), rtol=1e-6, atol=0)


def _fp8_view_like(view: torch.Tensor, kind: torch.dtype) -> torch.Tensor:
    """An FP8 tensor with `view`'s values, shape and strides (a strided view of an FP8 buffer)."""
    buffer = torch.empty(view.untyped_storage().nbytes() // view.element_size(), dtype=kind)
    out = buffer.as_strided(view.shape, view.stride(), view.storage_offset())
    out.copy_(view)
    return out


@pytest.mark.parametrize("kind", KINDS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 4096, 2 * 4096 + 3])
def test_dequantize_is_o8_over_scale_in_the_output_dtype(kind, out_dtype, n):
    gen = torch.Generator().manual_seed(n)
    o8 = (torch.randn(n, generator=gen) * 100).to(kind).to(DEVICE)
    scale = torch.tensor([37.25], device=DEVICE)
    out = torch.empty(n, dtype=out_dtype, device=DEVICE)
    fe._dequantize(o8, scale, out)
    want = o8.cpu().double() / 37.25
    # fp16 has room for every e4m3/e5m2 value over this scale: exact; bf16 within its own rounding (Triton's
    # interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest: one bf16 ulp, 2**-7 relative)
    rtol = 2 ** -7 if out_dtype == torch.bfloat16 else 2 ** -11
    torch.testing.assert_close(out.cpu().double(), want, rtol=rtol, atol=0)
