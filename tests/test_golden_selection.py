"""Golden selection snapshots: every simulated device × representative calls, decision and provenance.

A change of the default policy, a descriptor or an implementation's declared capabilities shows up here as a
diff of tests/golden/selection.json. To accept an intended change: UPDATE_GOLDEN=1 pytest tests/test_golden_selection.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import opdispatch
from tests.conftest import DEVICES_DIR, REPO

GOLDEN = REPO / "tests" / "golden" / "selection.json"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
DEVICES = ["h100", "h200", "a100", "l40s", "mi300x", "mi250x", "bi-v150", "p800", "cpu",
           # FlagGems' other vendors (issue 35): what would run there
           "ascend-910b", "cambricon-mlu590", "hygon-k100", "metax-c500", "mthreads-s4000"]


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def calls() -> dict[str, dict]:
    cu = torch.tensor([0, 700, 1900, 3000, 4096], dtype=torch.int32, device="meta")
    return {
        "decode gqa 4:1 d128": dict(q=meta(8, 1, 32, 128), k=meta(8, 4096, 8, 128), v=meta(8, 4096, 8, 128),
                                    causal=True, causal_alignment="bottom_right"),
        "prefill causal gqa 4:1 d128": dict(q=meta(2, 4096, 32, 128), k=meta(2, 4096, 8, 128),
                                            v=meta(2, 4096, 8, 128), causal=True),
        "prefill mha d64": dict(q=meta(4, 1024, 16, 64), k=meta(4, 1024, 16, 64), v=meta(4, 1024, 16, 64)),
        "prefill fp16 d256": dict(q=meta(1, 2048, 8, 256, dtype=torch.float16), k=meta(1, 2048, 8, 256, dtype=torch.float16),
                                  v=meta(1, 2048, 8, 256, dtype=torch.float16), causal=True),
        "sliding window 1024": dict(q=meta(1, 8192, 16, 128), k=meta(1, 8192, 16, 128), v=meta(1, 8192, 16, 128),
                                    causal=True, window=(1024, 0)),
        "softcap 30": dict(q=meta(2, 4096, 16, 128), k=meta(2, 4096, 8, 128), v=meta(2, 4096, 8, 128), causal=True,
                           softcap=30.0),
        "varlen uneven causal": dict(q=meta(4096, 16, 128), k=meta(4096, 4, 128), v=meta(4096, 4, 128), layout="thd",
                                     cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1200, max_seqlen_k=1200, causal=True),
        "training causal d128": dict(q=meta(2, 2048, 16, 128, grad=True), k=meta(2, 2048, 16, 128, grad=True),
                                     v=meta(2, 2048, 16, 128, grad=True), causal=True),
        "fp32 masked": dict(q=meta(1, 128, 8, 64, dtype=torch.float32), k=meta(1, 128, 8, 64, dtype=torch.float32),
                            v=meta(1, 128, 8, 64, dtype=torch.float32),
                            attn_mask=torch.empty(128, 128, dtype=torch.bool, device="meta")),
    }


def _portable(text: str) -> str:
    return text.replace(str(REPO) + "/", "")


def snapshot() -> dict:
    out: dict = {}
    for device in DEVICES:
        for name, kw in calls().items():
            kw = dict(kw)
            decision = opdispatch.explain(kw.pop("q"), kw.pop("k"), kw.pop("v"), device=DEVICES_DIR / f"{device}.yaml", **kw)
            out[f"{device} | {name}"] = {
                "chosen": decision.chosen_id,
                "decided_by": _portable(str(decision.decided_by)) if decision.decided_by else None,
                "candidates": {c.impl_id: c.status for c in decision.candidates},
            }
    return out


def test_selection_matches_golden_snapshot(manager):
    current = snapshot()
    if UPDATE or not GOLDEN.exists():
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        if not UPDATE:
            pytest.fail(f"{GOLDEN} did not exist; written now — review and commit it")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(current)
    diffs = [f"{key}: {golden[key]['chosen']} -> {current[key]['chosen']} ({current[key]['decided_by']})"
             for key in golden if golden[key] != current[key]]
    assert not diffs, "selection changed:\n" + "\n".join(diffs)


@pytest.mark.parametrize("device,expected_vendor", [
    ("h100", "nvidia"), ("a100", "nvidia"), ("l40s", "nvidia"), ("mi300x", "rocm"), ("mi250x", "rocm"),
    ("bi-v150", "iluvatar"), ("p800", "kunlunxin"), ("cpu", "cpu"),
])
def test_each_vendor_device_gets_its_own_implementation_for_prefill(manager, device, expected_vendor):
    kw = calls()["prefill causal gqa 4:1 d128"] if device != "cpu" else dict(
        q=meta(1, 128, 8, 64, dtype=torch.float32), k=meta(1, 128, 8, 64, dtype=torch.float32),
        v=meta(1, 128, 8, 64, dtype=torch.float32), causal=True)
    kw = dict(kw)
    decision = opdispatch.explain(kw.pop("q"), kw.pop("k"), kw.pop("v"), device=DEVICES_DIR / f"{device}.yaml", **kw)
    assert decision.chosen_id.split(".")[0] == expected_vendor, str(decision)
    assert decision.device.simulated
    for cand in decision.candidates:
        if cand.status in ("unavailable", "rejected"):
            assert cand.reasons, cand  # every loser says why


@pytest.mark.parametrize("max_len,grad,expected,rule", [
    # The H100 policy proof contradicted flagos-for-short-varlen-inference (FA2 faster at 256 and 1024): gone.
    (256, False, "nvidia.flash", None),
    (1024, False, "nvidia.flash", None),
    (4096, False, "nvidia.flash", None),
    (256, True, "nvidia.flash", None),
])
def test_varlen_goes_to_torch_flash_on_h100(manager, max_len, grad, expected, rule):
    n = 16
    cu = torch.arange(0, (n + 1) * max_len, max_len, dtype=torch.int32, device="meta")
    q = meta(n * max_len, 32, 128, grad=grad)
    kv = meta(n * max_len, 8, 128, grad=grad)
    decision = opdispatch.explain(q, kv, kv, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                  max_seqlen_k=max_len, causal=True, device=DEVICES_DIR / "h100.yaml")
    assert decision.chosen_id == expected, str(decision)
    assert decision.decided_by.rule == rule


@pytest.mark.parametrize("device,forward,training", [
    # FlagGems' generic Triton kernels serve inference; training takes torch.flex where torch's inductor has a
    # Triton backend for the device type (cuda); torch's flex_attention refuses npu/mlu/musa tensors itself, and
    # FlagGems has no usable backward there: Ascend trains on torch_npu's fused op; Cambricon and Moore Threads
    # run their torch builds' fused F.sdpa (vendor kernels, ahead of FlagGems' generic ones) both ways
    ("metax-c500", "flagos.triton", "torch.flex"), ("hygon-k100", "flagos.triton", "torch.flex"),
    ("ascend-910b", "flagos.triton", "ascend.fusion_attention"),
    ("cambricon-mlu590", "cambricon.sdpa", "cambricon.sdpa"),
    ("mthreads-s4000", "mthreads.sdpa", "mthreads.sdpa"),
    # vendors with their own kernels keep them first; their training goes to flex, not the reference
    ("bi-v150", "iluvatar.ixformer", "torch.flex"), ("p800", "kunlunxin.prefill", "torch.flex"),
])
def test_flagos_and_flex_beyond_nvidia(manager, device, forward, training):
    for grad, want in ((False, forward), (True, training)):
        kw = dict(calls()["training causal d128"])
        q, k, v = (kw.pop(n).detach().requires_grad_(grad) for n in ("q", "k", "v"))
        decision = opdispatch.explain(q, k, v, device=DEVICES_DIR / f"{device}.yaml", **kw)
        assert decision.chosen_id == want, str(decision)
        if want == "reference.math":
            flex = next(c for c in decision.candidates if c.impl_id == "torch.flex")
            assert f"refuses {decision.device.type!r} tensors" in flex.reasons[0]
            flagos = next(c for c in decision.candidates if c.impl_id == "flagos.triton")
            assert any("forward-only" in r for r in flagos.reasons)
