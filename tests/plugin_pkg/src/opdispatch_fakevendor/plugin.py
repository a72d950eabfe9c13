"""Registers `fakevendor.sdpa`: torch's own scaled_dot_product_attention, as a vendor would wrap its kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import opdispatch

OPDISPATCH_PLUGIN_API = 2  # the plugin API this module was written for (opdispatch.plugins.hookspec)


class FakeVendorSdpa(opdispatch.AttentionImpl):
    vendor = "fakevendor"
    name = "sdpa"
    priority = 5
    description = "torch.nn.functional.scaled_dot_product_attention behind a third-party plugin"
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32, torch.float64}), gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

    def run(self, call):
        q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=call.causal, scale=call.scale,
                                             enable_gqa=call.heads_q != call.heads_kv)
        return call.from_bhsd(out)


@opdispatch.hookimpl
def opdispatch_impls():
    return [FakeVendorSdpa()]
