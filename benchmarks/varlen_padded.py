"""Varlen against what torch's default SDPA offers for it: pad the sequences into a batch and pass a mask.

    python benchmarks/varlen_padded.py [--out FILE.md]

Rows: the matrix's varlen shapes (bf16, causal, GQA 4:1). Columns: opdispatch.attention on packed thd (its pick),
F.scaled_dot_product_attention on the padded batch with a boolean causal+padding mask (torch's default path
for uneven lengths), and a per-sequence loop of F.scaled_dot_product_attention (needs the lengths on the host).
Median of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import opdispatch

CASES = [
    ("16k uneven (3000,512,7000,1200,4700,77) d128", [3000, 512, 7000, 1200, 4700, 77], 32, 8, 128),
    ("16k uneven d64", [3000, 512, 7000, 1200, 4700, 77], 32, 8, 64),
    ("64 x 256 d128", [256] * 64, 32, 8, 128),
    ("16 x 1024 d128", [1024] * 16, 32, 8, 128),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    lines = [f"# Varlen vs torch's padded SDPA ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"cuDNN {torch.backends.cudnn.version()})", "",
             "| shape | opdispatch pick | opdispatch ms | padded SDPA + mask ms | per-sequence loop ms | vs padded |",
             "|---|---|--:|--:|--:|--:|"]
    for name, lens, hq, hkv, d in CASES:
        total, longest, b = sum(lens), max(lens), len(lens)
        q = torch.randn(total, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(total, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(total, hkv, d, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                  causal=True)
        pick = opdispatch.explain(q, k, v, **kw).chosen_id
        t_ours = do_bench(lambda: opdispatch.attention(q, k, v, **kw))
        # Padded: (b, h, longest, d) and a mask that is causal inside each sequence and hides the padding.
        qp = torch.zeros(b, hq, longest, d, device=dev, dtype=q.dtype)
        kp = torch.zeros(b, hkv, longest, d, device=dev, dtype=q.dtype)
        vp = torch.zeros_like(kp)
        keep = torch.zeros(b, 1, longest, longest, dtype=torch.bool, device=dev)
        starts = cu.tolist()
        for i, n in enumerate(lens):
            qp[i, :, :n] = q[starts[i]:starts[i] + n].transpose(0, 1)
            kp[i, :, :n] = k[starts[i]:starts[i] + n].transpose(0, 1)
            vp[i, :, :n] = v[starts[i]:starts[i] + n].transpose(0, 1)
            keep[i, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        keep[:, :, :, 0] |= ~keep.any(-1)  # padding rows attend to one key instead of none (no NaN)
        t_pad = do_bench(lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=keep, enable_gqa=True))
        views = [(q[s:s + n].transpose(0, 1), k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1))
                 for s, n in zip(starts, lens)]
        t_loop = do_bench(lambda: [F.scaled_dot_product_attention(a, b_, c, is_causal=True, enable_gqa=True)
                                   for a, b_, c in views])
        lines.append(f"| {name} | {pick} | {t_ours:.3f} | {t_pad:.3f} | {t_loop:.3f} | {t_pad / t_ours:.1f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
