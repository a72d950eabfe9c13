"""The Triton kernels around `nvidia.cudnn_frontend`'s FP8 SDPA graph on Hopper (imported only where Triton is
installed; why: `_cudnn_frontend`'s docstring).

- `v_amax_bits`: max |v| over a strided (n0, n1, n2, d) FP8 tensor as the magnitude bits (an FP8 value's bits
  without its sign order as |x| does), NaN/inf clamped to the largest finite, reduced in registers over a
  grid-stride loop and `atomic_max`ed into one int32 once per program;
- `output_scale` (one program): reads and zeroes that int32, writes scale_o = fp8_max / (max|v8| * |v_descale|),
  1 for an all-zero v;
- `dequantize`: out = o8 / scale_o in one pass over the FP8 output (contiguous), written in the output's dtype.
"""

import triton
import triton.language as tl


@triton.jit
def v_amax_bits(v_ptr, acc_ptr, rows, dim1, dim2, head_dim, stride0, stride1, stride2, stride_d,
                MAX_FINITE_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, STEPS: tl.constexpr):
    # Grid-stride: each program folds row tiles pid, pid + G, ... of BLOCK_R rows into one register tile and does one
    # atomic at the end (one per chunk serialized thousands of atomics on one address). The caller orders the row
    # dims by decreasing stride, so consecutive rows are neighbours in memory where the layout allows it.
    d = tl.arange(0, BLOCK_D)
    d_offset = d[None, :].to(tl.int64) * stride_d
    d_inside = (d < head_dim)[None, :]
    running = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.int32)
    for step in range(STEPS):  # constexpr: Triton's interpreter cannot loop to a runtime bound
        r = (step * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        i0, i1, i2 = r // (dim1 * dim2), (r // dim2) % dim1, r % dim2
        row = i0.to(tl.int64) * stride0 + i1.to(tl.int64) * stride1 + i2.to(tl.int64) * stride2
        bits = tl.load(v_ptr + row[:, None] + d_offset, mask=(r < rows)[:, None] & d_inside, other=0)
        # (A NaN's or inf's bits lie above the largest finite's: clamped, so the scale stays finite — a NaN in v
        # reaches the output through cuDNN's own arithmetic, not through a NaN scale over every element.)
        running = tl.maximum(running, tl.minimum(bits.to(tl.int32) & 0x7F, MAX_FINITE_BITS))
    tl.atomic_max(acc_ptr, tl.max(tl.max(running, axis=1), axis=0))


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
