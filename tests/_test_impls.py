"""Test implementations shared by the decision-class and compile tests: limits declared as data and as code."""

from __future__ import annotations

from typing import ClassVar

import torch

from opdispatch import AttentionCaps, AttentionImpl


def prefer_test_impls(manager, tmp_path) -> None:
    """A policy that puts the test implementations (id `test.*`) first."""
    path = tmp_path / "order.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    order: ['test.*', cpu.flash, reference.math]\n")
    manager.set_policy(path)


class ShortOnly(AttentionImpl):
    """A test kernel limited to short sequences by data (caps.max_seqlen), computing in float64 itself."""

    vendor: ClassVar[str] = "test"
    name: ClassVar[str] = "short"
    priority: ClassVar[int] = 1000
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, max_seqlen=20,
                                                  backward=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

    def run(self, call):
        q, k, v = (call.bhsd(t).double() for t in (call.q, call.k, call.v))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        scores = q @ k.transpose(-1, -2) * call.scale
        if call.causal:  # top-left, as declared: a test double is held to what it claims too
            sq, sk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(scores, -1).nan_to_num(0.0)
        return call.from_bhsd((p @ v).to(call.dtype))


class EvenKeysOnly(ShortOnly):
    """Extra limits written as code that reads sizes, with no selection_key: decided per exact shape eagerly, and
    re-checked per call under torch.compile (no guard can stand for them)."""

    name: ClassVar[str] = "even"
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, backward=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

    def extra_reasons(self, call, device):
        return [] if call.seqlen_k % 2 == 0 else [f"seqlen_k {call.seqlen_k} is odd"]
