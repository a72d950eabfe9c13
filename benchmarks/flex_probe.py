"""torch.flex on one GPU case with and without flex's split-KV decoding kernel: forward, LSE and gradient error
against a float64 reference. Diagnoses cases where the compiled kernel disagrees with the oracle.

    python benchmarks/flex_probe.py --sq 100 --sk 333 --alignment bottom_right
"""

from __future__ import annotations

import argparse

import torch

import opdispatch
from opdispatch.vendors.reference import ReferenceAttention
from opdispatch.vendors.torch_flex import TorchFlexAttention


def errors(impl, q, k, v, kw):
    call = opdispatch.validate_attention(q, k, v, return_lse=True, **kw)
    out, lse = impl.run(call)
    ref_call = opdispatch.validate_attention(*(t.double() for t in (q, k, v)), return_lse=True, **kw)
    ref_out, ref_lse = ReferenceAttention().run(ref_call)
    seen = torch.isfinite(ref_lse)
    lse_err = (lse.double()[seen] - ref_lse[seen]).abs().max().item()
    out_err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(impl.run(opdispatch.validate_attention(qg, kg, vg, **kw)), (qg, kg, vg), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ReferenceAttention().run(opdispatch.validate_attention(*leaves, **kw))
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    grad_errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(grads, ref_grads)]
    return out_err, lse_err, grad_errs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sq", type=int, default=100)
    p.add_argument("--sk", type=int, default=333)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--alignment", default="bottom_right")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def t(s, h):
        return torch.randn(2, s, h, args.head_dim, generator=gen, device="cuda").bfloat16()

    q, k, v = t(args.sq, args.heads), t(args.sk, args.kv_heads), t(args.sk, args.kv_heads)
    kw = dict(causal=True, causal_alignment=args.alignment)
    for label, options in [("torch's choice", None),
                           ("FORCE_USE_FLEX_ATTENTION", {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}})]:
        impl = TorchFlexAttention().with_options(options)
        try:
            out_err, lse_err, grad_errs = errors(impl, q, k, v, kw)
            print(f"sq={args.sq} sk={args.sk} {args.alignment:12s} {label:26s} out rel {out_err:.2e}  "
                  f"lse max {lse_err:.2e}  dq/dk/dv rel {' '.join(f'{e:.2e}' for e in grad_errs)}", flush=True)
        except Exception as exc:  # report and go on: this is a diagnosis
            print(f"sq={args.sq} sk={args.sk} {args.alignment:12s} {label:26s} {type(exc).__name__}: {exc}"[:600],
                  flush=True)


if __name__ == "__main__":
    main()
