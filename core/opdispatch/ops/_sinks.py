"""Attention sinks: one shared epilogue over any implementation that returns its LSE.

A sink is a virtual key per query head with logit `sink` and a zero value (GPT-OSS, TE's learnable softmax,
FA3's and vLLM's `s_aux`). Each row's softmax over [scores, sink] gives

    out = out_plain * sigmoid(lse - sink)        lse_with_sink = logaddexp(lse, sink)

where `out_plain`, `lse` are the attention without the sink (lse over the scaled scores, natural log). A row
that sees no key has lse = -inf: out 0, lse_with_sink = sink. So the chosen implementation runs the call
without sinks and with its LSE (`AttentionCall.without_sinks`), and the epilogue — torch ops, differentiated by
autograd (the sink's gradient included) — combines the two. Implementations need nothing sink-specific, except
those whose kernel has the sink itself (`caps.native_sinks`, e.g. FlashAttention-4's `learnable_sink`): the call
goes to them with its sinks, and their own forward and backward (the sink's gradient included) replace the
epilogue — under autograd only with `caps.native_sinks_backward` (aiter's `sink_ptr` is forward-only), and not
where the implementation's `native_sinks_limit(call)` gives a reason (`_attention.takes_sinks_natively`).
(The compiled op, `_compile.py`, always runs the epilogue around the op: exact either way.)

The backward needs the LSE's gradient with respect to q and k. Where the implementation's LSE is a kernel's
side output without one (`caps.lse_grad` False), `exact_lse` supplies it (in `_attention`, as attention's
`OpSpec.result_fix` for a returned LSE uses it too): with P the attention probabilities,

    d lse_i / d q_i = scale * sum_j P_ij k_j             = scale * attention(q, k, v=k)_i
    sum_i g_i d lse_i / d k_j = scale * sum_i P_ij g_i q_i = the v-gradient of attention(q, k, v=k) for
                                                            grad_out = scale * g * q

— one more call of the same implementation on the same pattern (causal, window, mask, ALiBi, KV cache, GQA), with
v = k and no dropout (the LSE is the pre-dropout softmax's). Softcap (its scores are not linear in q.k) and a
bias gradient (d lse / d bias = P) are not covered: capability reasons refuse those, unless `caps.lse_grad`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._attention import AttentionCall, layout_views, out_rows, takes_sinks_natively

__all__ = ["apply_sinks", "run_with_sinks"]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the call with `sinks` from those of the call without: the epilogue, in float32 (float64 for a
    float64 call). Traceable by torch.compile; autograd gives every gradient, the sink's included."""
    sink = sinks.to(lse.dtype).unsqueeze(-1)  # (heads, 1): broadcasts over (batch, heads, seq) and (heads, tokens)
    weight = torch.sigmoid(lse - sink)  # the share of each row's mass on real keys; 0 for a row that sees none
    scaled = (out * out_rows(weight, layout)).to(out.dtype)
    return scaled, torch.logaddexp(lse, sink)


def _per_row(in_layout: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of `out_rows`: a tensor shaped like the output less its head dim, as per-row values shaped
    like the LSE."""
    if layout == "thd":
        return in_layout.transpose(0, 1)  # (tokens, heads) -> (heads, tokens)
    return layout_views(layout)[0](in_layout.unsqueeze(-1)).squeeze(-1)


def _sink_weight_and_out(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                         layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, out * weight, logaddexp(lse, sink)) without autograd: the product in float32, rounded once."""
    weight = torch.sigmoid(lse - sinks.to(lse.dtype).unsqueeze(-1))
    scaled = torch.mul(out, out_rows(weight, layout), out=torch.empty_like(out))
    return weight, scaled, torch.logaddexp(lse, sinks.to(lse.dtype).unsqueeze(-1))


class _SinksFromSaved(torch.autograd.Function):
    """The sinks epilogue over a kernel's (out, LSE), differentiated through the kernel's own backward from its
    saved results (`impl.backward`) instead of autograd over the epilogue.

    With s = sigmoid(lse - sink) and the output o' = o * s, the attention with the sink as a virtual key of zero
    value has dS_ij = P_ij s_i (g_i.v_j - g_i.o'_i): exactly what a FlashAttention-style backward computes from
    dO = g * s when handed o' as the output (its D_i = dO_i.o'_i). No extra attention pass, where autograd over
    the epilogue needs the LSE's gradient (one more forward and backward: `exact_lse`). The sink's gradient:
    d sink_h = -sum over rows of head h of (1 - s_i) g_i.o'_i.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, impl: Any, call: AttentionCall,
                recompute: Callable[..., tuple[torch.Tensor, ...]]) -> torch.Tensor:
        weight, scaled, _ = _sink_weight_and_out(out, lse, sinks, call.layout)
        ctx.save_for_backward(q, k, v, sinks, scaled, lse, weight)
        ctx.impl, ctx.call, ctx.recompute = impl, call, recompute
        return scaled

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, sinks, scaled, lse, weight = ctx.saved_tensors
        layout = ctx.call.layout
        grad = grad.contiguous()
        grad_plain = torch.mul(grad, out_rows(weight, layout), out=torch.empty_like(grad))
        grads = ctx.impl.backward(ctx.call, scaled, lse, grad_plain)
        if grads is None:  # a call its backward does not cover: autograd over a recomputed forward, exact
            return (*ctx.recompute(q, k, v, sinks, grad), None, None, None, None, None)
        dq, dk, dv = grads
        dot = _per_row(torch.linalg.vecdot(grad.float(), scaled.float()), layout)
        rows = (1.0 - weight) * dot.to(weight.dtype)
        d_sinks = -(rows.sum(dim=1) if layout == "thd" else rows.sum(dim=(0, 2)))
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                d_sinks.to(sinks.dtype) if need[3] else None, None, None, None, None, None)


def _from_saved(call: AttentionCall, impl: Any) -> bool:
    """Whether a sinks call takes `_SinksFromSaved`: gradients wanted of the output only (no LSE returned, no bias
    gradient, no dropout: its mask is not saved), from an implementation with a backward of its own."""
    return (torch.is_grad_enabled() and not call.return_lse and call.dropout_p == 0
            and any(t.requires_grad for t in (call.q, call.k, call.v, call.sinks) if t is not None)
            and not (call.attn_bias is not None and call.attn_bias.requires_grad)
            and getattr(impl, "saves_for_backward", False))


def _run_from_saved(manager: Any, call: AttentionCall, impl: Any) -> torch.Tensor:
    assert call.sinks is not None
    detached = call.with_tensors(call.q.detach(), call.k.detach(), call.v.detach())
    detached.sinks = call.sinks.detach()
    inner = detached.without_sinks()  # requires_grad False: run without autograd, differentiated from saved
    with torch.no_grad():
        out, lse = manager.call("attention", inner, impl=impl.id)

    def recompute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                  grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
            again = call.with_tensors(*leaves[:3])
            again.sinks = leaves[3]
            plain = again.without_sinks()
            out_, lse_ = manager.call("attention", plain, impl=impl.id)  # LSE exact via OpSpec.result_fix
            scaled, _ = apply_sinks(out_, lse_, leaves[3], call.layout)
            found = torch.autograd.grad(scaled, leaves, grad, allow_unused=True)
        return tuple(found)

    bwd_call = impl.conform(inner)
    result: torch.Tensor = _SinksFromSaved.apply(  # type: ignore[no-untyped-call]
        call.q, call.k, call.v, call.sinks, out, lse, impl, bwd_call, recompute)
    return result


def run_with_sinks(manager: Any, call: AttentionCall, impl: str | None) -> Any:
    """Decide `call` (sinks and all: capability reasons, `when: sinks` rules), run its implementation on the call
    without sinks and with the LSE, and apply the epilogue — or, for an implementation that takes sinks natively
    (`caps.native_sinks`), run it on the call as it is. Returns what `opdispatch.attention` returns."""
    assert call.sinks is not None
    decision = manager.resolve("attention", call, impl=impl)
    inner = None  # the call without sinks, with the LSE: only the epilogue paths below run it
    while True:
        # Pinned to the decision's choice: the inner call must not be decided again without its sinks. A kernel
        # that raises fails over at the outer call's level, as a call without sinks does.
        try:
            if takes_sinks_natively(decision.chosen, call):  # the kernel's own sink: no epilogue
                return manager.call("attention", call, impl=decision.chosen.id)
            if _from_saved(call, decision.chosen):
                return _run_from_saved(manager, call, decision.chosen)
            if inner is None:
                inner = call.without_sinks()
            if not torch.is_grad_enabled() or not inner.requires_grad and not call.sinks.requires_grad:
                with torch.no_grad():  # no autograd over the epilogue: one pass, rounded once
                    out, lse = manager.call("attention", inner, impl=decision.chosen.id)
                    _, out, lse = _sink_weight_and_out(out, lse, call.sinks, call.layout)
                return (out, lse) if call.return_lse else out
            out, lse = manager.call("attention", inner, impl=decision.chosen.id)  # LSE exact via OpSpec.result_fix
            break
        except Exception as exc:
            if not manager.may_fail_over(decision, impl, exc, call.device):
                raise
            decision = manager._next_decision("attention", call, impl, decision, exc)
    out, lse = apply_sinks(out, lse, call.sinks, call.layout)
    return (out, lse) if call.return_lse else out
