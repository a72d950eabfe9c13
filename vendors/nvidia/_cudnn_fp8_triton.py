"""The Triton kernels around `nvidia.cudnn_frontend`'s FP8 SDPA graph on Hopper (imported only where Triton is
installed; why: `_cudnn_frontend`'s docstring).

- `v_amax_bits`: max |v| over a strided (b, h, s, d) FP8 tensor as the magnitude bits (an FP8 value's bits
  without its sign order as |x| does), NaN/inf clamped to the largest finite, `atomic_max`ed into one int32;
- `output_scale` (one program): reads and zeroes that int32, writes scale_o = fp8_max / (max|v8| * |v_descale|),
  1 for an all-zero v;
- `dequantize`: out = o8 / scale_o in one pass over the FP8 output (contiguous), written in the output's dtype.
"""

import triton
import triton.language as tl


@triton.jit
def v_amax_bits(v_ptr, acc_ptr, rows, heads, seqlen, dim, stride_b, stride_h, stride_s, stride_d,
                MAX_FINITE_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    b, h, s = r // (heads * seqlen), (r // seqlen) % heads, r % seqlen
    row = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + s.to(tl.int64) * stride_s
    inside = (r < rows)[:, None] & (d < dim)[None, :]
    bits = tl.load(v_ptr + row[:, None] + d[None, :].to(tl.int64) * stride_d, mask=inside, other=0)
    # (A NaN's or inf's bits lie above the largest finite's: clamped, so the scale stays finite — a NaN in v
    # reaches the output through cuDNN's own arithmetic, not through a NaN scale over every element.)
    magnitude = tl.minimum(bits.to(tl.int32) & 0x7F, MAX_FINITE_BITS)
    tl.atomic_max(acc_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))


@triton.jit
def output_scale(acc_ptr, v_descale_ptr, scale_o_ptr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                 EXPONENT_BIAS: tl.constexpr):
    bits = tl.atomic_xchg(acc_ptr, 0)  # read, and leave the accumulator zeroed for the next call on the stream
    exponent = bits >> MANTISSA_BITS
    mantissa = bits & ((1 << MANTISSA_BITS) - 1)
    # The FP8 value exactly in float32: (2**M + m) * 2**(e - bias - M), subnormal m * 2**(1 - bias - M); the
    # powers of two built from their float32 bits (exp2 may be approximate on a GPU).
    power = tl.where(exponent == 0, 1, exponent) - EXPONENT_BIAS - MANTISSA_BITS
    two_to_power = ((power + 127) << 23).to(tl.float32, bitcast=True)
    significand = tl.where(exponent == 0, mantissa, mantissa + (1 << MANTISSA_BITS)).to(tl.float32)
    v_max = significand * two_to_power * tl.abs(tl.load(v_descale_ptr))
    tl.store(scale_o_ptr, FP8_MAX / tl.where(v_max > 0, v_max, FP8_MAX))  # 1 for an all-zero v


@triton.jit
def dequantize(o8_ptr, scale_o_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    value = tl.load(o8_ptr + i, mask=inside, other=0.0).to(tl.float32) / tl.load(scale_o_ptr)
    tl.store(out_ptr + i, value.to(out_ptr.dtype.element_ty), mask=inside)
