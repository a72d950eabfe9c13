"""The Triton kernels of `core.compat._kv_append` (the fused KV-cache index check and append): imported only
where Triton is installed. What each checks and writes: `_kv_append`'s docstring."""

import triton
import triton.language as tl


# Pointers are not specialized on their alignment: a kernel launched directly after its first call
# (core.compat._triton_direct) must be the one the jit function would pick for every later call's pointers.
# `report_ptr` may be a pinned host row (the report ring's, mapped into the device's address space): written only,
# never read back here; what the other kernels read is the verdict's device word (`verdict_ptr`).
@triton.jit
def _checked(lens_ptr, rows_ptr, table_ptr, report_ptr, bad_ptr, verdict_ptr, lens_out_ptr, safe_ptr, writes,
             batch, new, width, page, cache_rows, max_len, table_stride_b, table_stride_w,
             HAS_ROWS: tl.constexpr, PAGED: tl.constexpr,
             BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, W_BLOCKS: tl.constexpr):
    """The verdict (0 or 1) of every index; the program where `writes` holds also stores the report row, the
    verdict word and bool, the lengths after the append and the clamped rows or table (the others only read)."""
    b = tl.arange(0, BLOCK_B)
    in_batch = b < batch
    lens = tl.load(lens_ptr + b, mask=in_batch, other=0)
    safe_lens = tl.minimum(tl.maximum(lens, 0), max_len)
    # (An int or absent cache_seqlens was checked on the host: its lengths pass here as they are.)
    bad = tl.max(((safe_lens != lens) & in_batch).to(tl.int32), axis=0)
    tl.store(report_ptr + 1 + b, lens, mask=in_batch & writes)
    tl.store(lens_out_ptr + b, safe_lens + new, mask=in_batch & writes)
    # Every appended key (sequence s // new, step s % new) and the cache slot it goes to.
    s = tl.arange(0, BLOCK_S)
    in_slots = s < batch * new
    seq = s // new
    pos = tl.minimum(tl.maximum(tl.load(lens_ptr + seq, mask=in_slots, other=0), 0), max_len) + s % new
    if HAS_ROWS:
        rows = tl.load(rows_ptr + b, mask=in_batch, other=0)
        safe_rows = tl.minimum(tl.maximum(rows, 0), cache_rows - 1)
        bad = tl.maximum(bad, tl.max(((safe_rows != rows) & in_batch).to(tl.int32), axis=0))
        tl.store(report_ptr + 1 + batch + b, rows, mask=in_batch & writes)
        tl.store(safe_ptr + b, safe_rows, mask=in_batch & writes)
        # Distinct rows (the reference path's Unique on cache_batch_idx, clamped as its device path has it).
        same = ((safe_rows[:, None] == safe_rows[None, :]) & (b[:, None] < b[None, :])
                & in_batch[:, None] & in_batch[None, :])
        bad = tl.maximum(bad, tl.max(tl.max(same.to(tl.int32), axis=1), axis=0))
    if PAGED:
        # The entries each sequence reads (the first ceil((lens + new) / page)), in range; clamped copies.
        for block in range(W_BLOCKS):  # a constexpr bound (Triton's interpreter cannot loop to a runtime one)
            w = block * BLOCK_W + tl.arange(0, BLOCK_W)
            inside = in_batch[:, None] & (w[None, :] < width)
            entry = tl.load(table_ptr + b[:, None] * table_stride_b + w[None, :] * table_stride_w, mask=inside,
                            other=0)
            used = inside & (w[None, :] * page < (safe_lens + new)[:, None])
            safe = tl.where(used, tl.minimum(tl.maximum(entry, 0), cache_rows - 1), entry)
            bad = tl.maximum(bad, tl.max(tl.max((used & (safe != entry)).to(tl.int32), axis=1), axis=0))
            tl.store(report_ptr + 1 + batch + b[:, None] * width + w[None, :], entry,
                     mask=inside & writes)  # as given
            tl.store(safe_ptr + b[:, None] * width + w[None, :], safe, mask=inside & writes)
        entry = tl.load(table_ptr + seq * table_stride_b + (pos // page) * table_stride_w, mask=in_slots, other=0)
        slot = tl.minimum(tl.maximum(entry, 0), cache_rows - 1).to(tl.int64) * page + pos % page
        same = ((slot[:, None] == slot[None, :]) & (s[:, None] < s[None, :])
                & in_slots[:, None] & in_slots[None, :])
        bad = tl.maximum(bad, tl.max(tl.max(same.to(tl.int32), axis=1), axis=0))
    tl.store(report_ptr, bad, mask=writes)
    tl.store(verdict_ptr, bad, mask=writes)
    tl.store(bad_ptr, bad != 0, mask=writes)
    return bad


@triton.jit
def _copied(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, seq, step, row, pos, bad, heads_dim, dim,
            k_sb, k_st, k_sh, k_sd, v_sb, v_st, v_sh, v_sd,
            kc_sr, kc_sp, kc_sh, kc_sd, vc_sr, vc_sp, vc_sh, vc_sd, BLOCK: tl.constexpr):
    """This program's tile of key (seq, step) stored at (row, pos) of both caches — nothing when `bad` is 1."""
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # An invalid call writes nothing: its verdict (0 or 1) leaves no element inside.
    # (A comparison alone: Triton 3.9's interpreter refuses a mask combined with a loaded bool.)
    inside = i < heads_dim * (1 - bad)
    h, d = i // dim, i % dim
    src = seq.to(tl.int64) * k_sb + step * k_st + h * k_sh + d * k_sd
    dst = row * kc_sr + pos.to(tl.int64) * kc_sp + h * kc_sh + d * kc_sd
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=inside), mask=inside)
    src = seq.to(tl.int64) * v_sb + step * v_st + h * v_sh + d * v_sd
    dst = row * vc_sr + pos.to(tl.int64) * vc_sp + h * vc_sh + d * vc_sd
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=inside), mask=inside)


@triton.jit(do_not_specialize_on_alignment=["lens_ptr", "rows_ptr", "table_ptr", "report_ptr", "bad_ptr",
                                            "verdict_ptr", "lens_out_ptr", "safe_ptr"])
def verdict(lens_ptr, rows_ptr, table_ptr, report_ptr, bad_ptr, verdict_ptr, lens_out_ptr, safe_ptr,
            batch, new, width, page, cache_rows, max_len, table_stride_b, table_stride_w,
            HAS_ROWS: tl.constexpr, PAGED: tl.constexpr,
            BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, W_BLOCKS: tl.constexpr):
    """The two-kernel path's check (one program): writes everything `_checked` writes."""
    _checked(lens_ptr, rows_ptr, table_ptr, report_ptr, bad_ptr, verdict_ptr, lens_out_ptr, safe_ptr,
             tl.program_id(0) == 0, batch, new, width, page, cache_rows, max_len, table_stride_b, table_stride_w,
             HAS_ROWS, PAGED, BLOCK_B, BLOCK_S, BLOCK_W, W_BLOCKS)


@triton.jit(do_not_specialize_on_alignment=["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "verdict_ptr",
                                            "lens_out_ptr", "safe_ptr"])
def append(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, verdict_ptr, lens_out_ptr, safe_ptr,
            new, heads_dim, dim, page, width,
            k_sb, k_st, k_sh, k_sd, v_sb, v_st, v_sh, v_sd,
            kc_sr, kc_sp, kc_sh, kc_sd, vc_sr, vc_sp, vc_sh, vc_sd,
            HAS_ROWS: tl.constexpr, PAGED: tl.constexpr, BLOCK: tl.constexpr):
    """The two-kernel path's append (a program per key and tile): reads `verdict`'s outputs."""
    key = tl.program_id(0)
    seq = key // new
    step = key % new
    pos = tl.load(lens_out_ptr + seq) - new + step  # the safe length, plus the step
    if PAGED:
        row = tl.load(safe_ptr + seq * width + pos // page).to(tl.int64)
        pos = pos % page
    elif HAS_ROWS:
        row = tl.load(safe_ptr + seq).to(tl.int64)
    else:
        row = seq.to(tl.int64)
    _copied(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, seq, step, row, pos, tl.load(verdict_ptr), heads_dim, dim,
            k_sb, k_st, k_sh, k_sd, v_sb, v_st, v_sh, v_sd, kc_sr, kc_sp, kc_sh, kc_sd, vc_sr, vc_sp, vc_sh, vc_sd,
            BLOCK)


@triton.jit(do_not_specialize_on_alignment=["lens_ptr", "rows_ptr", "table_ptr", "report_ptr", "bad_ptr",
                                            "verdict_ptr", "lens_out_ptr", "safe_ptr", "k_ptr", "v_ptr",
                                            "k_cache_ptr", "v_cache_ptr"])
def verdict_append(lens_ptr, rows_ptr, table_ptr, report_ptr, bad_ptr, verdict_ptr, lens_out_ptr, safe_ptr,
                   k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
                   batch, new, width, page, cache_rows, max_len, table_stride_b, table_stride_w, heads_dim, dim,
                   k_sb, k_st, k_sh, k_sd, v_sb, v_st, v_sh, v_sd,
                   kc_sr, kc_sp, kc_sh, kc_sd, vc_sr, vc_sp, vc_sh, vc_sd,
                   HAS_ROWS: tl.constexpr, PAGED: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_W: tl.constexpr, W_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """`verdict` and `append` as one kernel (a program per key and tile): every program works the verdict out
    from the same inputs, so all agree; program (0, 0) alone writes the report and the buffers, and each program
    stores its tile only when the verdict is good. Its key's slot is clamped exactly as `verdict` clamps it."""
    key = tl.program_id(0)
    bad = _checked(lens_ptr, rows_ptr, table_ptr, report_ptr, bad_ptr, verdict_ptr, lens_out_ptr, safe_ptr,
                   (key == 0) & (tl.program_id(1) == 0), batch, new, width, page, cache_rows, max_len,
                   table_stride_b, table_stride_w, HAS_ROWS, PAGED, BLOCK_B, BLOCK_S, BLOCK_W, W_BLOCKS)
    seq = key // new
    step = key % new
    pos = tl.minimum(tl.maximum(tl.load(lens_ptr + seq), 0), max_len) + step
    if PAGED:
        entry = tl.load(table_ptr + seq * table_stride_b + (pos // page) * table_stride_w)
        row = tl.minimum(tl.maximum(entry, 0), cache_rows - 1).to(tl.int64)
        pos = pos % page
    elif HAS_ROWS:
        row = tl.minimum(tl.maximum(tl.load(rows_ptr + seq), 0), cache_rows - 1).to(tl.int64)
    else:
        row = seq.to(tl.int64)
    _copied(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, seq, step, row, pos, bad, heads_dim, dim,
            k_sb, k_st, k_sh, k_sd, v_sb, v_st, v_sh, v_sd, kc_sr, kc_sp, kc_sh, kc_sd, vc_sr, vc_sp, vc_sh, vc_sd,
            BLOCK)


@triton.jit(do_not_specialize_on_alignment=["out_ptr", "lse_ptr", "verdict_ptr"])
def poison(out_ptr, lse_ptr, verdict_ptr, out_numel, lse_numel, HAS_LSE: tl.constexpr, BLOCK: tl.constexpr):
    """The attention's output (and its LSE) NaN in place when the verdict is bad (contiguous tensors); nothing
    written when it is good."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bad = tl.load(verdict_ptr)  # 0 or 1: a good call's bound is 0, so no element is inside
    tl.store(out_ptr + i, tl.full([BLOCK], float("nan"), tl.float32).to(out_ptr.dtype.element_ty),
             mask=i < out_numel * bad)
    if HAS_LSE:
        tl.store(lse_ptr + i, tl.full([BLOCK], float("nan"), tl.float32).to(lse_ptr.dtype.element_ty),
                 mask=i < lse_numel * bad)
