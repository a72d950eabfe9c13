"""Tuning is op-aware: rms_norm and rotary_embedding cases, presets and buckets, `tune`/`bench --op` on the CPU,
and an rms_norm autotune table driving real decisions."""

from __future__ import annotations

import logging

import pytest
import torch

import opdispatch
from opdispatch.tools._cli import main
from opdispatch.base._fingerprint import device_fingerprint
from opdispatch.base._ops import op_spec, tunable_ops
from opdispatch.ops._rms_norm import RmsNormCase
from opdispatch.ops._rotary import RotaryCase
from opdispatch.tools._tuning import load_cases, measure, preset, preset_names, tune, tuning_of
from opdispatch.policies._tuned_table import TunedEntry, TunedTable, tuned_table_for

FAST = dict(warmup=1, reps=2, progress=False)
OPS = ("rms_norm", "rotary_embedding")


def test_every_op_can_be_tuned():
    assert set(tunable_ops()) == {"attention", "rms_norm", "rotary_embedding"}
    assert tuning_of("rms_norm") is op_spec("rms_norm").tuning


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_presets_are_valid_calls_of_their_op(op, device_type):
    tuning = tuning_of(op)
    for name in preset_names(op):
        cases = preset(name, device_type, op)
        assert cases
        for case in cases:
            assert type(case).from_dict(case.to_dict()) == case
            call = tuning.validate(**case.inputs("meta"))
            assert call.requires_grad == case.requires_grad
            assert case.flops() > 0
            discrete, sizes = tuning.bucket(call)
            assert len(discrete) == len(tuning.discrete) and len(sizes) == len(tuning.sizes)
    with pytest.raises(ValueError, match=f"unknown preset 'nope' for op '{op}'; allowed: decode, prefill, "
                                         "training, all"):
        preset("nope", device_type, op)


def test_buckets_read_the_call():
    rms = tuning_of("rms_norm")
    call = rms.validate(**RmsNormCase(dtype="fp32", tokens=6, hidden=32, residual=True).inputs("cpu"))
    assert rms.bucket(call) == (("fp32", 32, True, True, False), (6,))
    assert rms.describe(*rms.bucket(call)) == "fp32 h32 +residual t6"
    rope = tuning_of("rotary_embedding")
    case = RotaryCase(dtype="fp32", tokens=5, heads_q=4, heads_k=2, head_dim=16, rotary_dim=8, interleaved=True)
    call = rope.validate(**case.inputs("cpu"))
    assert call.rotary_dim == 8 and call.interleaved
    assert rope.bucket(call) == (("fp32", 4, 2, 16, 8, True, False), (5,))
    assert rope.describe(*rope.bucket(call)) == "fp32 h4/2 d16 rot8 gptj t5"


def test_rotary_case_defaults_and_cos_sin_caches():
    case = RotaryCase.from_dict({"dtype": "fp32", "tokens": 3, "heads_q": 2, "head_dim": 8})
    assert case.rotary_dim == 8 and case.heads_k == 2
    kw = case.inputs("cpu")
    positions = torch.arange(3, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
    torch.testing.assert_close(kw["cos"].double(), torch.cos(positions * inv_freq), atol=1e-6, rtol=0)
    torch.testing.assert_close(kw["sin"].double(), torch.sin(positions * inv_freq), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['seqlen'\]"):
        RotaryCase.from_dict({"seqlen": 4})


def test_tune_rms_norm_on_cpu(basic_manager, tmp_path):
    cases = [RmsNormCase(dtype="fp32", tokens=4, hidden=32),
             RmsNormCase(dtype="fp32", tokens=4, hidden=32, residual=True, requires_grad=True)]
    table = tune(cases, op="rms_norm", manager=basic_manager, device="cpu", **FAST)
    assert table.op == "rms_norm" and len(table.entries) == 2
    for entry in table.entries:
        assert sorted(entry.order) == ["reference.rms_norm", "torch.rms_norm"]
        assert entry.order[0] == min(entry.median_us, key=entry.median_us.get)
    assert table.entries[1].discrete == ("fp32", 32, True, True, True) and table.entries[1].sizes == (4,)
    path = tmp_path / "rms.yaml"
    table.save(path)
    loaded = TunedTable.load(path)
    assert loaded.op == "rms_norm"
    assert [(e.discrete, e.sizes, e.order) for e in loaded.entries] == [
        (e.discrete, e.sizes, e.order) for e in table.entries]
    x = torch.randn(5, 32)  # 5 tokens: nearest bucket is 4
    assert loaded.lookup(opdispatch.validate_rms_norm(x, torch.randn(32))) == table.entries[0].order


def test_measure_rotary_forward_and_backward(basic_manager):
    cases = [RotaryCase(dtype="fp32", tokens=4, heads_q=2, heads_k=1, head_dim=8, rotary_dim=8),
             RotaryCase(dtype="fp32", tokens=4, heads_q=2, heads_k=1, head_dim=8, rotary_dim=4, requires_grad=True)]
    results = measure(cases, op="rotary_embedding", manager=basic_manager, device="cpu", **FAST)
    for m in results:
        assert list(m.seconds) == ["reference.rotary_embedding"] and m.pick == "reference.rotary_embedding"
        assert m.regret == 0.0 and not m.failed
    assert results[1].features == (("fp32", 2, 1, 8, 4, False, True), (4,))


def test_cli_tune_and_bench_rms_norm(basic_manager, tmp_path, capsys):
    out = tmp_path / "rms.yaml"
    assert main(["tune", "--op", "rms_norm", "--preset", "decode", "--out", str(out), "--reps", "1",
                 "--warmup", "0", "-q"]) == 0
    assert "ops: {rms_norm: {autotune: rms.yaml}}" in capsys.readouterr().out
    table = TunedTable.load(out)
    assert table.op == "rms_norm" and len(table.entries) == len(preset("decode", "cpu", "rms_norm"))
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("- {dtype: fp32, tokens: 8, hidden: 64, residual: true}\n")
    assert load_cases(shapes, "rms_norm") == [RmsNormCase(dtype="fp32", tokens=8, hidden=64, residual=True)]
    out_dir = tmp_path / "bench"
    assert main(["bench", "--op", "rms_norm", "--shapes", str(shapes), "--out-dir", str(out_dir), "--reps", "1",
                 "--warmup", "0", "-q"]) == 0
    text = (out_dir / "rms_norm-cpu.md").read_text()
    assert text.startswith("# opdispatch rms_norm benchmark")
    assert "| shape | reference.rms_norm | torch.rms_norm | pick | regret |" in text
    assert "| fp32 t8 h64 +residual |" in text


def test_cli_bench_rotary_and_the_shapes_file_is_read_as_the_op(basic_manager, tmp_path):
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("- {dtype: fp32, tokens: 4, heads_q: 2, heads_k: 1, head_dim: 8}\n")
    out_dir = tmp_path / "bench"
    assert main(["bench", "--op", "rotary_embedding", "--shapes", str(shapes), "--out-dir", str(out_dir),
                 "--reps", "1", "--warmup", "0", "-q"]) == 0
    assert "| fp32 t4 h2/1 d8 neox |" in (out_dir / "rotary_embedding-cpu.md").read_text()
    with pytest.raises(ValueError, match=r"expected a list of rms_norm shapes \(mappings of RmsNormCase fields"):
        shapes.write_text("tokens: 4\n")
        load_cases(shapes, "rms_norm")


# -- an rms_norm autotune table drives decisions -----------------------------------------------------------------

def _rms_table(manager, times_small, times_large, op="rms_norm"):
    fingerprint = device_fingerprint(manager.device_info(torch.device("cpu")))

    def entry(tokens, times):
        return TunedEntry(("fp32", 64, True, False, False), (tokens,), sorted(times, key=times.get), dict(times))

    return TunedTable(fingerprint, [entry(8, times_small), entry(4096, times_large)], op=op)


def test_rms_norm_autotune_table_orders_the_decision(basic_manager, tmp_path):
    _rms_table(basic_manager, {"reference.rms_norm": 10.0, "torch.rms_norm": 30.0},
               {"reference.rms_norm": 300.0, "torch.rms_norm": 100.0}).save(tmp_path / "rms.yaml")
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops:\n  rms_norm:\n    autotune: rms.yaml\n")
    basic_manager.set_policy(policy)
    weight = torch.randn(64)
    d = opdispatch.explain_rms_norm(torch.randn(10, 64), weight)
    assert d.chosen_id == "reference.rms_norm"  # measured faster near 8 rows, against the default order
    assert d.decided_by.source == f"{policy}:3"
    assert d.decided_by.note == ("autotune rms.yaml: buckets fp32 h64 t8; fp32 h64 t4096: reference.rms_norm x1.00, "
                                 "torch.rms_norm x2.77")  # blended by inverse log-distance
    assert opdispatch.explain_rms_norm(torch.randn(3000, 64), weight).chosen_id == "torch.rms_norm"
    # another op's section is untouched by this table
    q = torch.randn(1, 8, 2, 16)
    assert "autotune" not in (opdispatch.explain(q, q, q).decided_by.note or "")


def test_a_table_of_another_op_is_ignored_with_a_warning(basic_manager, tmp_path, caplog):
    _rms_table(basic_manager, {"reference.rms_norm": 10.0, "torch.rms_norm": 30.0},
               {"reference.rms_norm": 10.0, "torch.rms_norm": 30.0}).save(tmp_path / "rms.yaml")
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops:\n  attention:\n    autotune: rms.yaml\n")
    basic_manager.set_policy(policy)
    q = torch.randn(1, 8, 2, 16)
    with caplog.at_level(logging.WARNING, logger="opdispatch"):
        d = opdispatch.explain(q, q, q)
    assert d.chosen_id == "cpu.flash" and "autotune" not in (d.decided_by.note or "")
    assert any("times op 'rms_norm'" in r.getMessage() and "ops.attention.autotune" in r.getMessage()
               for r in caplog.records)
    device = basic_manager.device_info("cpu")
    assert tuned_table_for(tmp_path / "rms.yaml", device, "rms_norm") is not None
