"""Every available attention implementation against reference.math in float64, on the GPU.

For each implementation the case list below is filtered through the implementation's own declaration
(`not_supported_reasons` on the real device): what it declares is what gets tested, forward, LSE where declared,
and backward where declared. Fresh random inputs for every case. Skipped without CUDA.

Run one implementation per process (`-k nvidia.cudnn`): a kernel that faults poisons the CUDA context for the
rest of the process. Set GPU_ATTN_SUMMARY=path to append one JSON line per case.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import opdispatch
from opdispatch import validate_attention

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = [pytest.mark.gpu]

# ‖out − ref‖ / ‖ref‖ bounds per implementation and dtype (forward, gradients); LSE: max |Δ| over finite rows.
TOLERANCES = {
    "default": {torch.float16: (4e-3, 1.5e-2), torch.bfloat16: (2.5e-2, 5e-2), torch.float32: (2e-3, 5e-3)},
    "flagos.triton": {torch.float16: (5e-3, None), torch.bfloat16: (2.5e-2, None)},
}
LSE_ATOL = 2e-2

IMPLS = ["nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient", "nvidia.flash_attn", "nvidia.flash_attn3",
         "flagos.triton"]
if os.environ.get("GPU_ATTN_IMPL"):  # one implementation per process (see the module docstring)
    IMPLS = [i for i in IMPLS if i == os.environ["GPU_ATTN_IMPL"]]


def _case(name, b=2, sq=128, sk=128, hq=4, hkv=4, d=64, dv=None, dtype=torch.bfloat16, layout="bshd", **kw):
    return dict(name=name, b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=dv or d, dtype=dtype, layout=layout, kw=kw)


CASES = [
    _case("basic"),
    _case("basic_fp16", dtype=torch.float16),
    _case("basic_fp32", dtype=torch.float32),
    _case("causal", causal=True),
    _case("gqa4_causal_d128", hq=8, hkv=2, d=128, causal=True),
    _case("gqa8_d128_fp16", hq=16, hkv=2, d=128, dtype=torch.float16),
    _case("d256_causal", d=256, causal=True),
    _case("d96", d=96),
    _case("d32", d=32, causal=True),
    _case("dv_differs", d=128, dv=64),
    _case("bhsd", layout="bhsd", causal=True, hq=8, hkv=2),
    _case("sbhd", layout="sbhd", causal=True),
    _case("sq<sk_top_left", sq=64, sk=160, causal=True, causal_alignment="top_left"),
    _case("sq<sk_bottom_right", sq=64, sk=160, causal=True, causal_alignment="bottom_right"),
    _case("sq>sk_bottom_right", sq=160, sk=64, causal=True, causal_alignment="bottom_right"),
    _case("noncausal_sq<sk", sq=96, sk=200),
    _case("window_causal", sq=256, sk=256, causal=True, window=(48, 0)),
    _case("window_both", sq=256, sk=256, window=(32, 16)),
    _case("window_br", sq=128, sk=256, causal=True, window=(40, 0), causal_alignment="bottom_right"),
    _case("softcap", causal=True, softcap=20.0, hq=8, hkv=2),
    _case("alibi", causal=True, alibi=True),
    _case("alibi_noncausal", alibi=True),
    _case("attn_mask", mask=True),
    _case("attn_mask_causal_gqa", mask=True, causal=True, hq=8, hkv=2),
    _case("attn_bias", bias=True),
    _case("decode_gqa8", b=4, sq=1, sk=300, hq=16, hkv=2, d=128),
    _case("decode_mha", b=4, sq=1, sk=257, hq=8, hkv=8, d=64),
    _case("varlen_causal", layout="thd", lens_q=[37, 128, 5, 90], hq=8, hkv=2, d=128, causal=True),
    _case("varlen_noncausal", layout="thd", lens_q=[37, 128, 5, 90], hq=4, hkv=4, d=64),
    _case("varlen_br", layout="thd", lens_q=[20, 64, 1, 33], lens_k=[50, 64, 17, 99], hq=8, hkv=2, d=128,
          causal=True, causal_alignment="bottom_right"),
    _case("varlen_tl", layout="thd", lens_q=[20, 64, 3, 33], lens_k=[50, 64, 17, 99], hq=8, hkv=2, d=128,
          causal=True, causal_alignment="top_left"),
    _case("varlen_q>k_tl", layout="thd", lens_q=[50, 30, 70], lens_k=[20, 30, 40], hq=8, hkv=2, d=128,
          causal=True),
    _case("varlen_mqa_d256", layout="thd", lens_q=[300, 77, 129], hq=8, hkv=1, d=256, causal=True),
    _case("varlen_fp16_dv", layout="thd", lens_q=[37, 128, 5, 90], hq=8, hkv=2, d=128, dv=64,
          dtype=torch.float16),
    _case("varlen_window_softcap", layout="thd", lens_q=[70, 128, 9], hq=8, hkv=2, d=128, causal=True,
          window=(32, 0), softcap=30.0),
]


def _make(case, device, grad, gen):
    b, sq, sk, hq, hkv, d, dv, dtype, layout = (case[k] for k in ("b", "sq", "sk", "hq", "hkv", "d", "dv", "dtype",
                                                                   "layout"))
    kw = dict(case["kw"])
    extra = {}

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if layout == "thd":
        lens_q = kw.pop("lens_q")
        lens_k = kw.pop("lens_k", None)
        tq = sum(lens_q)
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0).tolist()), dtype=torch.int32, device=device)
        if lens_k is None:
            cu_k, tk = cu_q, tq
        else:
            tk = sum(lens_k)
            cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0).tolist()), dtype=torch.int32,
                                device=device)
        q, k, v = rnd(tq, hq, d), rnd(tk, hkv, d), rnd(tk, hkv, dv)
        extra.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        b = len(lens_q)
    else:
        shape = {"bshd": lambda s, h, x: (b, s, h, x), "bhsd": lambda s, h, x: (b, h, s, x),
                 "sbhd": lambda s, h, x: (s, b, h, x)}[layout]
        q, k, v = rnd(*shape(sq, hq, d)), rnd(*shape(sk, hkv, d)), rnd(*shape(sk, hkv, dv))
    if kw.pop("alibi", False):
        extra["alibi_slopes"] = torch.rand(hq, generator=gen, device=device) * 0.3 + 0.01
    if kw.pop("mask", False):
        m = torch.rand(b, 1, sq, sk, generator=gen, device=device) > 0.3
        m[..., 0] = True  # every query sees at least one key
        extra["attn_mask"] = m
    if kw.pop("bias", False):
        extra["attn_bias"] = (torch.randn(1, hq, sq, sk, generator=gen, device=device) * 0.5).to(dtype)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, {**kw, **extra}


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _report(record):
    path = os.environ.get("GPU_ATTN_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
@pytest.mark.parametrize("impl_id", IMPLS)
def test_against_reference(impl_id, case):
    manager = opdispatch.get_manager()
    manager.ensure_initialized()
    registered = manager.registry.get("attention", impl_id)
    if registered is None:
        pytest.skip(f"{impl_id} not registered")
    impl = registered.impl
    device = manager.device_info(torch.device("cuda"))
    why = manager.availability(impl, device)
    if why:
        pytest.skip(f"{impl_id} unavailable: {why}")
    if impl_id == "nvidia.cudnn" and case["layout"] == "thd":
        # cuDNN varlen is opt-in (slow graph rebuilds on torch 2.11); its numerics are tested all the same.
        _check(impl_id, impl.with_options({"varlen": True}), device, manager, case)
        return
    _check(impl_id, impl, device, manager, case)


def _check(impl_id, impl, device, manager, case):
    gen = torch.Generator(device="cuda").manual_seed(hash((impl_id, case["name"])) % 2**31)
    q, k, v, kw = _make(case, "cuda", grad=False, gen=gen)
    ref_impl = manager.registry.get("attention", "reference.math").impl
    results = {}
    for grad in (False, True):
        qg, kg, vg = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
        call = validate_attention(qg, kg, vg, layout=case["layout"], return_lse=not grad, **kw)
        reasons = impl.not_supported_reasons(call, device)
        if reasons:
            results["backward" if grad else "forward"] = "not declared: " + "; ".join(reasons)
            continue
        tol_out, tol_grad = TOLERANCES.get(impl_id, TOLERANCES["default"])[case["dtype"]]
        q64, k64, v64 = (t.detach().double().requires_grad_(grad) for t in (q, k, v))
        kw64 = {key: (val.double() if key == "attn_bias" else val) for key, val in kw.items()}
        ref_call = validate_attention(q64, k64, v64, layout=case["layout"], return_lse=not grad, **kw64)
        ref = ref_impl.run(ref_call)
        got = impl.run(call)
        if not grad:
            out, lse = got if call.return_lse and isinstance(got, tuple) else (got, None)
            ref_out, ref_lse = ref
            err = _rel(out, ref_out)
            rec = {"impl": impl_id, "case": case["name"], "pass": "forward", "rel_err": err, "tol": tol_out}
            ok = err <= tol_out
            if impl.caps.lse:
                assert lse is not None, "return_lse declared but no lse returned"
                assert lse.shape == ref_lse.shape, f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
                finite = torch.isfinite(ref_lse)
                lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
                inf_ok = bool((lse[~finite] == -math.inf).all()) if (~finite).any() else True
                rec.update(lse_err=lse_err, lse_empty_rows_ok=inf_ok)
                ok = ok and lse_err <= LSE_ATOL and inf_ok
            rec["ok"] = ok
            _report(rec)
            results["forward"] = rec
        else:
            g = torch.randn(got.shape, generator=gen, device="cuda", dtype=torch.float32)
            got.backward(g.to(got.dtype))
            ref.backward(g.double())
            errs = {n: _rel(a.grad, b.grad) for n, a, b in (("dq", qg, q64), ("dk", kg, k64), ("dv", vg, v64))}
            rec = {"impl": impl_id, "case": case["name"], "pass": "backward", **errs, "tol": tol_grad,
                   "ok": max(errs.values()) <= tol_grad}
            _report(rec)
            results["backward"] = rec
    print(impl_id, case["name"], results)
    failures = [r for r in results.values() if isinstance(r, dict) and not r["ok"]]
    assert not failures, failures
    if all(isinstance(r, str) for r in results.values()):
        pytest.skip("; ".join(results.values()))
