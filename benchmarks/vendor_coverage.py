"""Which implementation the default policy picks, on every simulated device, for each call class of the
training/feature set — no hardware needed (`opdispatch.explain` on meta tensors and the shipped descriptors).

Call classes: ten features (dense, causal, GQA 4:1, sliding window, softcap, ALiBi, additive bias, boolean mask,
varlen, MLA 192/128) × {forward, training (q, k, v and a bias require grad)}, plus paged decode with 16-key pages
(vLLM's default block size) and paged MLA decode (absorbed: q/k 576, v 512, one KV head, 16-key pages). bf16,
2 × 2048 × 16 heads × 128 unless the class says otherwise. Every cell that goes to reference.math is listed below
the table with what each fused candidate said.

Usage: python benchmarks/vendor_coverage.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

import opdispatch

DEVICES = Path(__file__).resolve().parent.parent / "configs" / "devices"
B, S, H, D = 2, 2048, 16, 128


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def feature_call(feature: str, grad: bool) -> dict:
    """The keyword arguments of opdispatch.explain for one call class."""
    q, k, v = meta(B, S, H, D, grad=grad), meta(B, S, H, D, grad=grad), meta(B, S, H, D, grad=grad)
    kw: dict = dict(q=q, k=k, v=v)
    if feature == "dense":
        pass
    elif feature == "causal":
        kw["causal"] = True
    elif feature == "gqa":
        kw.update(k=meta(B, S, H // 4, D, grad=grad), v=meta(B, S, H // 4, D, grad=grad), causal=True)
    elif feature == "window":
        kw.update(causal=True, window=(1024, 0))
    elif feature == "softcap":
        kw.update(causal=True, softcap=30.0)
    elif feature == "alibi":
        kw.update(causal=True, alibi_slopes=torch.empty(H, dtype=torch.float32, device="meta"))
    elif feature == "bias":
        kw["attn_bias"] = meta(1, H, S, S, grad=grad)
    elif feature == "mask":
        kw["attn_mask"] = torch.empty(S, S, dtype=torch.bool, device="meta")
    elif feature == "varlen":
        total = B * S
        cu = torch.tensor([0, 700, 1900, 3000, total], dtype=torch.int32, device="meta")
        kw.update(q=meta(total, H, D, grad=grad), k=meta(total, H // 4, D, grad=grad),
                  v=meta(total, H // 4, D, grad=grad), layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                  max_seqlen_q=1200, max_seqlen_k=1200, causal=True)
    elif feature == "mla":  # DeepSeek-style prefill/training: q·k 192 (128 + 64 RoPE), v 128
        kw.update(q=meta(B, S, H, 192, grad=grad), k=meta(B, S, H, 192, grad=grad), v=meta(B, S, H, 128, grad=grad),
                  causal=True)
    else:
        raise ValueError(feature)
    return kw


def paged_call(mla: bool) -> dict:
    """One-query decode over a paged cache of 16-key pages (capacity 4096 keys per sequence)."""
    batch, page, pages_per_seq = 8, 16, 256
    pool = batch * pages_per_seq
    if mla:
        q, k = meta(batch, 1, H, 576), meta(pool, page, 1, 576)
        v = k[..., :512]  # absorbed MLA: the values are the latent, the first 512 columns of the key cache
    else:
        q, k, v = meta(batch, 1, 4 * 8, D), meta(pool, page, 8, D), meta(pool, page, 8, D)
    return dict(q=q, k=k, v=v, causal=True, causal_alignment="bottom_right",
                seqused_k=torch.empty(batch, dtype=torch.int32, device="meta"),
                block_table=torch.empty(batch, pages_per_seq, dtype=torch.int32, device="meta"))


# Measured with this script before issue 35 (flagos.triton NVIDIA-only, torch.flex requiring torch >= 2.11).
BEFORE = ("Before issue 35 (same devices and calls): 80 of 140 training, 71 of 140 forward and 25 of 28 paged cells "
          "went to reference.math.")

# Paged MLA decode: flagos.flash_mla (vendors/opdispatch/vendors/flagos/_flash_mla.py) adapts FlagGems 5.0.2's flash_mla.
PAGED_MLA_NOTE = (
    "paged16 MLA: flagos.flash_mla runs FlagGems' `flash_mla(q, block_table, blocked_k, max_seqlen_pad, "
    "block_size, b, s_q, cache_seqlens, h_q, h_kv, d, dv, causal)` (any page size) where 5.0.2 has tiles for the "
    "chip (capability major 9/8, 7 on Iluvatar, 3 on Moore Threads; any Cambricon; 9/8 in _kunlunxin and _metax; "
    "black-listed on Hygon; none on Ascend; AMD refused: Hopper tiles over a 64 KiB LDS). It claims only what it "
    "computes: v = k[..., :512] of the same storage (it reads V from blocked_k), scale 1/sqrt(576), one query per "
    "sequence, one KV head, bf16, no LSE, forward only; a chip whose descriptor declares no capability is refused "
    "until it does.")

# MLA prefill/training (q/k 192, v 128) on kernels that need one head dim: the toolkit's pads_v_head_dim.
MLA_NOTE = (
    "mla fwd/train: ascend.fusion_attention, cambricon.sdpa, iluvatar.ixformer, kunlunxin.prefill, rocm.ck, "
    "rocm.aotriton, mthreads.sdpa and flagos.triton need one head dim for q/k/v; they take v narrower than q/k by "
    "zero-padding v to q/k's head dim and slicing the output (exact: the padded columns of the output are zero, the "
    "scores, scale and LSE are q/k's; dv is the padded gradient's slice). Cost per call: one padded copy of v "
    "(192/128 = 1.5x v's memory, kept for the backward) and a 192-wide output whose first 128 columns are returned "
    "as a view (opdispatch.plugins.toolkit.pads_v_head_dim). Still refused: mthreads.sdpa (head dims <= 128), "
    "flagos.triton's dense kernel (head dims {16, 32, 64, 128, 256}), and training on chips whose only fused "
    "kernels for it are forward-only.")

FEATURES = ["dense", "causal", "gqa", "window", "softcap", "alibi", "bias", "mask", "varlen", "mla"]
COLUMNS = ([(f"{f} fwd", f, False) for f in FEATURES] + [(f"{f} train", f, True) for f in FEATURES]
           + [("paged16 decode", "paged", False), ("paged16 MLA", "paged_mla", False)])


def cell(device: Path, feature: str, grad: bool):
    kw = paged_call(feature == "paged_mla") if feature.startswith("paged") else feature_call(feature, grad)
    return opdispatch.explain(kw.pop("q"), kw.pop("k"), kw.pop("v"), device=device, **kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()
    devices = sorted(DEVICES.glob("*.yaml"))
    lines = ["# Implementation chosen per simulated device and call class (default policy)", "",
             f"Versions: opdispatch {opdispatch.__version__}, torch {torch.__version__} (the host's; each device "
             f"declares its own in its descriptor), python {platform.python_version()}. Generated by "
             "`python benchmarks/vendor_coverage.py`.", "",
             "Cells: the chosen implementation; **ref** = reference.math (the O(S²) oracle), explained below.", "",
             "| device | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    notes: list[str] = []
    count = {"train": 0, "fwd": 0, "paged": 0}
    total = {"train": 0, "fwd": 0, "paged": 0}
    for device in devices:
        row = []
        for label, feature, grad in COLUMNS:
            decision = cell(device, feature, grad)
            group = "paged" if feature.startswith("paged") else ("train" if grad else "fwd")
            total[group] += 1
            if decision.chosen_id == "reference.math":
                count[group] += 1
                row.append("**ref**")
                said = [f"{c.impl_id}: {c.reasons[0]}" for c in decision.candidates
                        if c.impl_id != "reference.math" and c.reasons
                        and not c.reasons[0].startswith("runs on device type")
                        and "hardware, not vendor" not in c.reasons[0]]
                text = "; ".join(said).replace(str(DEVICES.parent.parent) + "/", "")  # repo-relative descriptor paths
                notes.append(f"- {device.stem} · {label}: " + (text or "no fused implementation supports this "
                                                                "device"))
            else:
                row.append(decision.chosen_id)
        lines.append(f"| {device.stem} | " + " | ".join(row) + " |")
    lines += ["", f"reference.math: {count['train']} of {total['train']} training cells, {count['fwd']} of "
              f"{total['fwd']} forward cells, {count['paged']} of {total['paged']} paged cells.", "", BEFORE, "",
              "## Why each reference.math cell has no fused implementation", "",
              "(each fused candidate that runs on the device, with its first reason)", ""] + notes + [
                 "", "## MLA prefill (unequal head dims)", "", f"- {MLA_NOTE}", "", "## Paged MLA", "",
                 f"- {PAGED_MLA_NOTE}"]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
