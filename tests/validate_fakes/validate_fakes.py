"""Fake implementations for `opdispatch validate`'s tests: one right, the others wrong in one way each. Loaded by
the validate workers through a real entry point (the tests write its dist-info); namespace `vfake`."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

import opdispatch
from opdispatch.plugins.toolkit import allowed_positions

F32 = frozenset({torch.float32})


class Right(opdispatch.AttentionImpl):
    vendor, name = "vfake", "right"
    caps = opdispatch.AttentionCaps(dtypes=F32, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True,
                                    causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True)

    def compute(self, call):
        q, k, v = (call.bhsd(t) for t in (call.q, call.k, call.v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        mask = None
        if call.causal:
            sq, sk = q.shape[-2], k.shape[-2]
            offset = sk - sq if call.causal_alignment == "bottom_right" else 0
            mask = torch.ones(sq, sk, dtype=torch.bool).tril(offset)
        return call.from_bhsd(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=call.scale))

    def run(self, call):
        return self.compute(call)


class WrongShape(Right):
    name = "shape"

    def run(self, call):
        return self.compute(call)[..., :1]


class Nan(Right):
    name = "nan"

    def run(self, call):
        return torch.full_like(self.compute(call), float("nan"))


class Corrupts(Right):
    name = "corrupt"

    def run(self, call):
        call.q.mul_(0.5)
        raise RuntimeError("failed after writing into q")


class AbortsOnCausal(Right):
    name = "abort"

    def run(self, call):
        if call.causal and call.heads_kv == 1:
            os.abort()
        return self.compute(call)


class HangsOnGqa(Right):
    name = "hang"

    def run(self, call):
        if call.heads_kv == 1 and call.causal:
            time.sleep(600)
        return self.compute(call)


class Elsewhere(Right):
    """Available on no device here: `validate --impl vfake.elsewhere` has nothing to validate."""

    name = "elsewhere"

    def extra_availability(self, device):
        return "needs an accelerator this host does not have"


class TopLeftOnly(Right):
    """Declares bottom-right alignment but computes top-left: wrong only for that feature class."""

    name = "bottom"

    def run(self, call):
        if call.causal and call.causal_alignment == "bottom_right":
            call = call.with_tensors(call.q, call.k, call.v)
            call.causal_alignment = "top_left"
        return self.compute(call)


class NormIgnoresWeight(opdispatch.RmsNormImpl):
    """rms_norm that forgets the weight: right only for weightless calls."""

    vendor, name = "vfake", "norm"
    caps = opdispatch.RmsNormCaps(dtypes=F32, weight_optional=True)

    def run(self, call):
        h = call.x if call.residual is None else call.x + call.residual
        y = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + call.eps).to(h.dtype)
        return y if call.residual is None else (y, h)


class ThreeBugs(opdispatch.AttentionImpl):
    """A third party's attention, right alone in every feature it declares, with three combination bugs:
    (a) bottom-right alignment computed top-left, only for packed sequences (thd);
    (b) no gradient reaching k/v when kv heads are shared (GQA/MQA: the expanded k/v are detached);
    (c) NaN for a query that sees no key (a plain softmax over a row of -inf)."""

    vendor, name = "vfake", "combo"
    caps = opdispatch.AttentionCaps(dtypes=F32, layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), causal=True,
                                    causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True,
                                    backward=True)

    def run(self, call):
        if not call.varlen:
            q, k, v = (call.bhsd(t) for t in (call.q, call.k, call.v))
            return call.from_bhsd(self.attend(call, q, k, v, call.causal_alignment))
        cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        outs = []
        for b in range(call.batch):
            q, k, v = (t[c[b]:c[b + 1]].transpose(0, 1).unsqueeze(0) for t, c in
                       ((call.q, cu_q), (call.k, cu_k), (call.v, cu_k)))
            outs.append(self.attend(call, q, k, v, "top_left")[0].transpose(0, 1))  # bug (a)
        return torch.cat(outs)

    @staticmethod
    def attend(call, q, k, v, alignment):
        group = q.shape[1] // k.shape[1]
        if group > 1:  # bug (b): the gradient stops at the expanded k/v
            k, v = (t.repeat_interleave(group, 1).detach() + 0 * t.repeat_interleave(group, 1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) * call.scale
        sq, sk = scores.shape[-2:]
        offset = sk - sq if alignment == "bottom_right" else 0
        allowed = allowed_positions(sq, sk, call.causal, call.window, offset,
                                   scores.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v  # bug (c): a row of -inf gives NaN


@opdispatch.hookimpl
def opdispatch_impls():
    return [Right(), WrongShape(), Nan(), Corrupts(), AbortsOnCausal(), HangsOnGqa(), TopLeftOnly(),
            NormIgnoresWeight(), ThreeBugs(), Elsewhere()]
