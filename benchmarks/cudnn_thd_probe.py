"""Which packed-varlen (thd) calls cuDNN's ragged graphs get right, forward and backward, through nvidia.cudnn_frontend
(bf16, GQA 4:1, d128): per sequence, the largest error of out, dq, dk and dv against float32 autograd, relative to
the largest reference value of the whole tensor. Variants part the things that differ between the thd GPU test's
rows: a zero-length query sequence (and where it sits), a zero-length key sequence, q/k/v sliced from one packed
projection or contiguous, causal alignment. cuDNN's own tests gate zero-length sequences on cuDNN >= 9.25
(cudnn-frontend test_sdpa_edge_cases.py, issue #943); this probe measures what the installed cuDNN does.

    python benchmarks/cudnn_thd_probe.py --out cudnn_thd_probe-h100.md    # a Hopper GPU, the frontend wheel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _impl_options import use_attention_options  # noqa: E402

IMPL = "nvidia.cudnn_frontend"
VARIANTS = [  # name, lens_q, lens_k (None: self-attention), packed qkv, causal, alignment
    ("self, no empty sequence, packed", [512, 77, 300], None, True, True, "top_left"),
    ("self, no empty sequence, contiguous", [512, 77, 300], None, False, True, "top_left"),
    ("self, empty 2nd sequence, packed (GPU test row 1)", [512, 0, 77, 300], None, True, True, "top_left"),
    ("self, empty 2nd sequence, contiguous", [512, 0, 77, 300], None, False, True, "top_left"),
    ("self, empty last sequence, contiguous", [512, 77, 300, 0], None, False, True, "top_left"),
    ("self, empty 2nd sequence, not causal", [512, 0, 77, 300], None, False, False, "top_left"),
    ("cross, empty 2nd query sequence", [512, 0, 77], [300, 64, 200], False, True, "bottom_right"),
    ("cross, empty 2nd key sequence", [512, 64, 77], [300, 0, 200], False, False, "top_left"),
    ("cross, no empty sequence", [100, 700, 3], [640, 200, 129], False, True, "bottom_right"),
]


def reference_one(q, k, v, causal, bottom_right):
    sq, hq, sk, hk = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    kk, vv = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, kk) * q.shape[-1] ** -0.5
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq if bottom_right else 0)
    j = torch.arange(sk, device=q.device)[None, :]
    keep = (j <= i) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def run(lens_q, lens_k, packed, causal, align):
    hq, hk, d = 8, 2, 128
    self_attention = lens_k is None
    lens_k = lens_q if self_attention else lens_k
    gen = torch.Generator(device="cuda").manual_seed(11)
    tq, tk = sum(lens_q), sum(lens_k)
    if packed:
        qkv = torch.randn(tq, hq + 2 * hk, d, generator=gen, device="cuda").to(torch.bfloat16)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    else:
        q = torch.randn(tq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(tk, hk, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    cu_q = cu(lens_q)
    cu_k = cu_q if self_attention else cu(lens_k)
    out = opdispatch.attention(*leaves, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
                               causal_alignment=align, impl=IMPL)
    d_o = torch.randn(out.shape, generator=gen, device="cuda").to(torch.bfloat16)
    out.backward(d_o)
    refs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    parts, cq, ck = [], 0, 0
    for nq, nk in zip(lens_q, lens_k, strict=True):
        parts.append(reference_one(refs[0][cq:cq + nq], refs[1][ck:ck + nk], refs[2][ck:ck + nk], causal,
                                   align == "bottom_right" and not self_attention))
        cq, ck = cq + nq, ck + nk
    want = torch.cat(parts)
    want.backward(d_o.float())
    rows = []
    for name, got, ref, lens in (("out", out, want.detach(), lens_q), ("dq", leaves[0].grad, refs[0].grad, lens_q),
                                 ("dk", leaves[1].grad, refs[1].grad, lens_k),
                                 ("dv", leaves[2].grad, refs[2].grad, lens_k)):
        scale = float(ref.abs().max())
        errors, start = [], 0
        for n in lens:
            diff = (got[start:start + n].float() - ref[start:start + n]).abs()
            errors.append(float("nan") if bool(diff.isnan().any()) else float(diff.max()) / scale if n else 0.0)
            start += n
        rows.append((name, errors))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import cudnn

    use_attention_options(IMPL, {"half": True})
    lines = [f"# cuDNN thd (ragged) SDPA through {IMPL}: error per sequence against float32 autograd", "",
             f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, cuDNN {cudnn.backend_version()}, "
             f"nvidia-cudnn-frontend {cudnn.__version__}; bf16, 8 query heads, 2 KV heads, d128", "",
             "Each cell: the largest |error| in that sequence / the largest |reference| of the tensor (bound: out "
             "2**-6 = 0.016, gradients 2**-4 = 0.063); `nan`: NaN in that sequence.", "",
             "| variant | lengths q / k | causal | out | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
    for name, lens_q, lens_k, packed, causal, align in VARIANTS:
        try:
            rows = dict(run(lens_q, lens_k, packed, causal, align))
            cells = [" ".join(f"{e:.3f}" for e in rows[t]) for t in ("out", "dq", "dk", "dv")]
        except Exception as exc:  # noqa: BLE001  (a refusal or a cuDNN error is this variant's row)
            cells = [f"error: {type(exc).__name__}: {str(exc)[:160]}", "", "", ""]
        lens = f"{lens_q} / {'same' if lens_k is None else lens_k}"
        lines.append(f"| {name} | {lens} | {align if causal else 'no'} | " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
