"""`torch.flex` backward twice with ``retain_graph=True`` (issue 27): the gradients of each backward must equal
the gradients of one backward and the float64 oracle's, for softcap and ALiBi (what lands on torch.flex).

Root cause (torch 2.13, torch/_functorch/_aot_autograd: graph_compile.py collects `bw_donated_idxs` when
``torch._functorch.config.donated_buffer`` is on at compile time; runtime_wrappers.py `_backward_impl` refuses a
``retain_graph=True`` backward when the global flag is on at backward time and ``bw_donated_idxs != []``, which
also holds for a graph compiled without donation, whose idxs are None). The fix, `retainable` in
vendors/opdispatch/vendors/torch_flex/_attention.py: the compiled flex runs inside an autograd.Function that compiles and
backpropagates it with donated buffers off and forwards the outer ``retain_graph``; the mechanism is checked on
the CPU in tests/test_vendor_torch_flex_retain.py. The ``attn_bias`` row gives the bias a gradient too
(``bias_grad``): `retainable` passes it as a leaf of its own. Its gradient is accumulated with atomic adds, so it
is compared within tolerance; dq/dk/dv must be bitwise equal across backwards.

Skipped without CUDA. Run: pytest -q -rxXs tests/gpu/test_flex_retain_graph_gpu.py
"""

from __future__ import annotations

import zlib

import pytest
import torch

from opdispatch import validate_attention

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tests.gpu.test_flex_gpu import CASES, TOL, _impl, _make, _reference, _rel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning")]

RETAIN_CASES = [c for c in CASES if c["name"] in ("softcap_gqa4", "alibi_mha", "d100_softcap", "d96_alibi",
                                                 "attn_bias")]


@pytest.mark.parametrize("case", RETAIN_CASES, ids=[c["name"] for c in RETAIN_CASES])
def test_backward_twice_with_retain_graph_equals_once(case):
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"retain/{case['name']}".encode()))
    q, k, v, kw = _make(case, dtype, gen)
    bias = kw.pop("attn_bias", None)
    impl = _impl()

    def forward():
        tensors = (q, k, v) if bias is None else (q, k, v, bias)
        leaves = tuple(t.detach().clone().requires_grad_() for t in tensors)
        extra = {} if bias is None else {"attn_bias": leaves[3]}
        call = validate_attention(*leaves[:3], layout=case["layout"], **kw, **extra)
        return leaves, call, impl.run(call)

    leaves, call, out = forward()
    grad_out = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    once = torch.autograd.grad(out, leaves, grad_out)  # an ordinary training step first: the backward compiles
    leaves, call, out = forward()
    first = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    second = torch.autograd.grad(out, leaves, grad_out)
    # The oracle's bias is a float64 CPU leaf of its own (`_reference` reads kw["attn_bias"]).
    ref_bias = None if bias is None else leaves[3].detach().cpu().double().requires_grad_()
    ref_leaves, ref_out, _ = _reference(case, call, *leaves[:3], kw if ref_bias is None else
                                        dict(kw, attn_bias=ref_bias))
    ref_leaves = ref_leaves if ref_bias is None else (*ref_leaves, ref_bias)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, grad_out.cpu().double())
    for name, a, b, c, r in zip(("dq", "dk", "dv", "dbias"), once, first, second, ref_grads):
        if name == "dbias":  # atomic adds: equal within tolerance, not bitwise
            assert max(_rel(a, b.double().cpu()), _rel(c, b.double().cpu())) <= TOL[dtype][1], f"{name} differs"
        else:
            assert torch.equal(b, c) and torch.equal(a, b), f"{name}: a retained backward differs from one backward"
        assert _rel(b, r) <= TOL[dtype][1], f"{name} rel err {_rel(b, r):.3g} against the float64 oracle"
