"""Measured autotune: tuning on the CPU, the tuned table's round trip, fingerprints, lookups, presets, CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

import opdispatch
from opdispatch.tools._cli import main
from opdispatch.ops._attention_case import AttentionCase
from opdispatch.ops._attention_tuning import attention_bucket
from opdispatch.base._fingerprint import device_fingerprint
from opdispatch.tools._timing import time_fn
from opdispatch.tools._tuning import load_cases, measure, preset, preset_names, tune
from opdispatch.policies._tuned_table import TunedEntry, TunedTable, tuned_table_for

PRESETS = preset_names("attention")

TINY = [AttentionCase(dtype="fp32", batch=1, seqlen_q=8, seqlen_k=8, heads_q=2, heads_kv=1, head_dim=16, causal=True),
        AttentionCase(dtype="fp32", layout="thd", batch=2, seqlen_q=8, seqlen_k=8, heads_q=2, heads_kv=2, head_dim=16)]
FAST = dict(warmup=1, reps=2, progress=False)


def _call(seq: int = 8, batch: int = 1, head_dim: int = 16, layout: str = "bshd", **kw) -> opdispatch.AttentionCall:
    spec = AttentionCase(dtype="fp32", layout=layout, batch=batch, seqlen_q=seq, seqlen_k=seq, heads_q=2, heads_kv=1,
                    head_dim=head_dim, causal=True, **kw)
    args = spec.inputs("cpu")
    return opdispatch.validate_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_tune_times_cpu_flash_against_reference(basic_manager):
    table = tune(TINY, manager=basic_manager, device="cpu", **FAST)
    assert len(table.entries) == 2
    dense = table.entries[0]
    assert sorted(dense.order) == ["cpu.flash", "reference.math"]  # both eligible for the dense call
    assert all(t > 0 for t in dense.median_us.values())
    assert dense.order[0] == min(dense.median_us, key=dense.median_us.get)
    assert sorted(table.entries[1].order) == ["cpu.flash", "reference.math"]  # varlen: cpu.flash per sequence
    assert table.fingerprint == device_fingerprint(basic_manager.device_info("cpu"))
    assert table.settings["reps"] == 2


def test_impl_filter(basic_manager):
    table = tune(TINY[:1], manager=basic_manager, device="cpu", impls=["cpu.*"], **FAST)
    assert table.entries[0].order == ["cpu.flash"]


def test_progress_bar_goes_to_stderr(basic_manager, capsys):
    measure(TINY[:1], manager=basic_manager, device="cpu", warmup=0, reps=1, progress=True)
    err = capsys.readouterr().err
    assert "[" in err and "1/1" in err and "reference.math" in err


def test_round_trip(basic_manager, tmp_path):
    table = tune(TINY, manager=basic_manager, device="cpu", **FAST)
    path = tmp_path / "tuned.yaml"
    table.save(path)
    loaded = TunedTable.load(path)
    assert loaded.fingerprint == table.fingerprint
    assert [(e.discrete, e.sizes, e.order) for e in loaded.entries] == [
        (e.discrete, e.sizes, e.order) for e in table.entries]
    assert loaded.source == str(path)
    assert loaded.lookup(_call()) == table.entries[0].order
    assert yaml.safe_load(path.read_text())["format"] == "opdispatch-tuned/1"


def test_a_table_without_op_is_attentions_and_entries_are_checked_per_op(tmp_path):
    table = TunedTable({"name": "cpu"}, [_entry(64, ["a.x", "b.y"])])
    data = table.to_dict()
    assert data["op"] == "attention"
    del data["op"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    loaded = TunedTable.load(path)
    assert loaded.op == "attention" and loaded.entries[0].discrete == table.entries[0].discrete
    data["entries"][0]["layout"] = "ragged"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"old.yaml: field entries.0.layout: 'ragged' is not one of dense, varlen"):
        TunedTable.load(path)
    del data["entries"][0]["layout"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"field entries.0.layout: Field required"):
        TunedTable.load(path)
    data["op"] = "nope"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"field op: unknown op 'nope'; known ops: attention"):
        TunedTable.load(path)


def test_fingerprint_mismatch_is_stale(basic_manager, tmp_path, caplog):
    device = basic_manager.device_info("cpu")
    table = TunedTable(dict(device_fingerprint(device), torch="1.0.0"), [])
    ok, reason = table.matches(device)
    assert not ok
    assert "torch 1.0.0 in the table vs" in reason and "opdispatch tune" in reason
    assert TunedTable(device_fingerprint(device), []).matches(device)[0]
    path = tmp_path / "stale.yaml"
    table.save(path)
    with caplog.at_level(logging.WARNING, logger="opdispatch"):
        assert tuned_table_for(path, device) is None
        assert tuned_table_for(path, device) is None  # cached: one warning
    assert len([r for r in caplog.records if "is stale for this device" in r.getMessage()]) == 1
    fresh = tmp_path / "fresh.yaml"
    TunedTable(device_fingerprint(device), []).save(fresh)
    assert isinstance(tuned_table_for(fresh, device), TunedTable)


def test_simulated_device_fingerprint_comes_from_its_descriptor(tmp_path):
    descriptor = tmp_path / "gpu.yaml"
    descriptor.write_text("vendor: nvidia\ntype: cuda\narch: sm90\nname: H100\ncapability: [9, 0]\n"
                          "libraries: {torch: '2.13.0', cudnn: '91000'}\n")
    fp = device_fingerprint(opdispatch.load_device_descriptor(descriptor))
    assert fp == {"vendor": "nvidia", "type": "cuda", "arch": "sm90", "name": "H100", "capability": "9.0",
                  "cudnn": "91000", "torch": "2.13.0"}


def _entry(seq: int, order: list[str], batch: int = 1, head_dim: int = 16, layout: str = "dense") -> TunedEntry:
    return TunedEntry(("fp32", layout, head_dim, 2, 1, True, False, False, False), (seq, seq, batch), order)


def test_lookup_takes_the_nearest_bucket_in_log_space():
    table = TunedTable({}, [_entry(64, ["a.x", "b.y"]), _entry(1024, ["b.y", "a.x"])])
    assert table.lookup(_call(64)) == ["a.x", "b.y"]
    assert table.lookup(_call(100)) == ["a.x", "b.y"]  # log2 100 = 6.6: nearer 64 (6) than 1024 (10)
    assert table.lookup(_call(200)) == ["a.x", "b.y"]  # 7.6: below the log midpoint 8 (= 256)
    assert table.lookup(_call(300)) == ["b.y", "a.x"]  # 8.2
    assert table.lookup(_call(4096)) == ["b.y", "a.x"]
    assert table.lookup(_call(100, head_dim=32)) is None  # discrete features must match
    assert table.lookup(_call(100, layout="thd")) is None
    assert table.lookup_entry(_call(2000)).sizes == (1024, 1024, 1)


def test_lookup_uses_batch_too():
    table = TunedTable({}, [_entry(64, ["a.x"], batch=1), _entry(64, ["b.y"], batch=32)])
    assert table.lookup(_call(64, batch=2)) == ["a.x"]
    assert table.lookup(_call(64, batch=16)) == ["b.y"]


def test_attention_bucket():
    discrete, sizes = attention_bucket(_call(8, batch=3, window=(4, 0)))
    assert discrete == ("fp32", "dense", 16, 2, 1, True, True, False, False)
    assert sizes == (8, 8, 3)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_presets_are_valid_calls(name, device_type):
    specs = preset(name, device_type)
    assert specs
    with torch.device("meta"):
        for spec in specs:
            kw = spec.inputs("meta")
            call = opdispatch.validate_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), check_values=False, **kw)
            assert call.requires_grad == spec.requires_grad
            assert spec.flops() > 0
    if name == "all":
        assert len(specs) == sum(len(preset(p, device_type)) for p in PRESETS[:-1])
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


def test_flops_count_allowed_pairs():
    full = AttentionCase(seqlen_q=4, seqlen_k=4, heads_q=1, heads_kv=1, head_dim=1)
    assert full.flops() == 2 * 16 * 2
    assert AttentionCase(seqlen_q=4, seqlen_k=4, heads_q=1, heads_kv=1, head_dim=1, causal=True).flops() == 2 * 10 * 2
    decode = AttentionCase(seqlen_q=1, seqlen_k=4, heads_q=1, heads_kv=1, head_dim=1, causal=True)
    assert decode.flops() == 2 * 4 * 2  # bottom-right: the one query sees every key
    window = AttentionCase(seqlen_q=4, seqlen_k=4, heads_q=1, heads_kv=1, head_dim=1, causal=True, window=(1, 0))
    assert window.flops() == 2 * 7 * 2


def test_load_cases(tmp_path):
    path = tmp_path / "shapes.yaml"
    path.write_text("shapes:\n  - {dtype: fp32, batch: 2, seqlen_q: 16, heads_q: 4, head_dim: 8, causal: true}\n"
                    "  - {layout: thd, batch: 3, seqlen_q: 32, heads_q: 4, heads_kv: 2, window: [8, 0]}\n")
    specs = load_cases(path)
    assert specs[0].seqlen_k == 16 and specs[0].heads_kv == 4
    assert specs[1].window == (8, 0) and specs[1].layout == "thd"
    path.write_text("- {dtype: fp32, seqlen: 4}\n")
    with pytest.raises(ValueError, match="unknown field"):
        load_cases(path)


def test_time_fn_returns_a_median():
    assert 0 < time_fn(lambda: sum(range(100)), torch.device("cpu"), warmup=1, reps=3) < 0.1


def test_failing_impl_is_recorded_not_ranked(basic_manager):
    class Broken(opdispatch.AttentionImpl):
        vendor, name = "broken", "impl"
        caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

        def run(self, call):
            raise RuntimeError("kernel exploded")

    basic_manager.register_impl(Broken())
    (m,) = measure(TINY[:1], manager=basic_manager, device="cpu", **FAST)
    assert "kernel exploded" in m.failed["broken.impl"]
    assert "broken.impl" not in m.ranking()
    assert m.pick == "cpu.flash"
    assert m.regret is not None and m.regret >= 0


def _shapes_file(tmp_path: Path) -> Path:
    path = tmp_path / "shapes.yaml"
    path.write_text("- {dtype: fp32, batch: 1, seqlen_q: 8, heads_q: 2, head_dim: 16, causal: true}\n")
    return path


def test_cli_tune(basic_manager, tmp_path, capsys):
    out = tmp_path / "t.yaml"
    assert main(["tune", "--shapes", str(_shapes_file(tmp_path)), "--out", str(out), "--reps", "1", "--warmup", "0",
                 "-q"]) == 0
    assert "autotune: t.yaml" in capsys.readouterr().out
    assert sorted(TunedTable.load(out).entries[0].order) == ["cpu.flash", "reference.math"]
    assert main(["tune", "--shapes", str(_shapes_file(tmp_path)), "--out", str(out), "--reps", "1", "--warmup", "0",
                 "-q", "--device-only"]) == 0
    assert TunedTable.load(out).entries[0].order == ["cpu.flash"]


def test_cli_bench(basic_manager, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    assert main(["bench", "--shapes", str(_shapes_file(tmp_path)), "--out-dir", str(out_dir), "--reps", "1",
                 "--warmup", "0", "-q"]) == 0
    text = (out_dir / "attention-cpu.md").read_text()
    assert "| shape | cpu.flash | reference.math | pick | regret |" in text
    assert "geometric-mean regret" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in capsys.readouterr().err
    else:
        assert (out_dir / "attention-cpu.png").stat().st_size > 1000


# -- the policy's `autotune:` key drives real decisions ---------------------------------------------------------

def _timed(seq: int, times: dict[str, float], batch: int = 1) -> TunedEntry:
    entry = _entry(seq, sorted(times, key=times.get), batch=batch)
    entry.median_us.update(times)
    return entry


def _table_for_cpu(manager, order):
    device = manager.device_info(torch.device("cpu"))
    fast, slow = order
    return TunedTable(device_fingerprint(device), [_timed(64, {fast: 10.0, slow: 30.0}),
                                                   _timed(1024, {slow: 100.0, fast: 300.0})])


def test_estimate_blends_neighbours_between_buckets():
    table = TunedTable({}, [_timed(512, {"a.x": 24.0, "b.y": 26.0}), _timed(2048, {"a.x": 160.0, "b.y": 80.0})])
    call = opdispatch.validate_attention(torch.empty(1, 1024, 2, 16, device="meta"),
                                         torch.empty(1, 1024, 1, 16, device="meta"),
                                         torch.empty(1, 1024, 1, 16, device="meta"), causal=True)
    scores, used = table.estimate(call)
    assert len(used) == 2 and scores["b.y"] == 1.0 and scores["a.x"] > 1.3  # the neighbours outvote a near-tie
    order, note = table.rank(call, ["a.x", "b.y"])
    assert order == ["b.y", "a.x"] and "buckets" in note


def test_rank_keeps_policy_order_within_the_noise_margin():
    table = TunedTable({}, [_timed(512, {"a.x": 24.5, "b.y": 25.5})])
    call = opdispatch.validate_attention(torch.empty(1, 512, 2, 16, device="meta"),
                                         torch.empty(1, 512, 1, 16, device="meta"),
                                         torch.empty(1, 512, 1, 16, device="meta"), causal=True)
    assert table.rank(call, ["b.y", "a.x"])[0] == ["b.y", "a.x"]  # 4% apart: the policy's order stands
    assert table.rank(call, ["b.y", "a.x"], margin=0.01)[0] == ["a.x", "b.y"]


def test_policy_autotune_table_orders_the_decision(basic_manager, tmp_path):
    _table_for_cpu(basic_manager, ["reference.math", "cpu.flash"]).save(tmp_path / "tuned.yaml")
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops:\n  attention:\n    autotune: tuned.yaml\n")
    basic_manager.set_policy(policy)
    short = torch.randn(1, 70, 2, 16)  # between buckets, nearest to 64: reference.math measured fastest
    long = torch.randn(1, 900, 2, 16)  # nearest to 1024: cpu.flash measured fastest
    kv = torch.randn(1, 70, 1, 16)
    d = opdispatch.explain(short, kv, kv, causal=True)
    assert d.chosen_id == "reference.math"
    assert d.decided_by.source == f"{policy}:3" and "autotune tuned.yaml" in d.decided_by.note
    kv = torch.randn(1, 900, 1, 16)
    assert opdispatch.explain(long, kv, kv, causal=True).chosen_id == "cpu.flash"
    # rules still outrank the measured order
    policy.write_text("ops:\n  attention:\n    autotune: tuned.yaml\n    rules:\n      - name: r\n"
                      "        prefer: [cpu.flash]\n")
    basic_manager.reload()
    kv = torch.randn(1, 70, 1, 16)
    assert opdispatch.explain(short, kv, kv, causal=True).chosen_id == "cpu.flash"


def test_policy_autotune_table_of_another_device_is_ignored_with_a_warning(basic_manager, tmp_path, caplog):
    device = basic_manager.device_info(torch.device("cpu"))
    TunedTable(dict(device_fingerprint(device), torch="1.0.0"), [_entry(64, ["reference.math", "cpu.flash"])]).save(
        tmp_path / "stale.yaml")
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops:\n  attention:\n    autotune: stale.yaml\n")
    basic_manager.set_policy(policy)
    q, kv = torch.randn(1, 64, 2, 16), torch.randn(1, 64, 1, 16)
    with caplog.at_level(logging.WARNING, logger="opdispatch"):
        d = opdispatch.explain(q, kv, kv, causal=True)
    assert d.chosen_id == "cpu.flash" and "order" in d.decided_by.note
    assert any("stale.yaml" in r.getMessage() and "Ignoring it" in r.getMessage() for r in caplog.records)


def test_an_autotune_table_is_read_inside_one_plan(basic_manager, tmp_path, monkeypatch):
    from opdispatch.policies import _plan

    _table_for_cpu(basic_manager, ["reference.math", "cpu.flash"]).save(tmp_path / "tuned.yaml")
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops:\n  attention:\n    autotune: tuned.yaml\n    rules:\n      - name: r\n"
                      "        when: {seqlen_q: '>=4096'}\n        prefer: [cpu.flash]\n")
    basic_manager.set_policy(policy)
    matched, plans = [], []
    real_match, real_build = _plan.rule_matches, _plan.build_plan
    monkeypatch.setattr(_plan, "rule_matches", lambda when, *a: matched.append(when) or real_match(when, *a))
    monkeypatch.setattr("opdispatch.policies._policy.build_plan", lambda *a: plans.append(a) or real_build(*a))
    q, kv = torch.randn(1, 70, 2, 16), torch.randn(1, 70, 1, 16)
    d = opdispatch.explain(q, kv, kv, causal=True)
    assert d.chosen_id == "reference.math" and "autotune tuned.yaml" in d.decided_by.note
    rules = [rule for _, layer in basic_manager.policy.yaml_layers if layer.op("attention")
             for rule in layer.op("attention").rules]
    assert len(plans) == 1 and len(matched) == len(rules)  # every rule matched once, in one plan


def test_spread_and_noise():
    from opdispatch.tools._timing import Spread

    steady = Spread.of([1.00, 1.01, 0.99, 1.00, 1.02, 1.00])
    assert (steady.min, steady.max) == (0.99, 1.02) and steady.median == 1.0 and not steady.noisy
    busy = Spread.of([1.0, 1.0, 3.0, 1.1, 2.5, 0.9])  # another process took the CPU for some reps
    assert busy.noisy and busy.max == 3.0


def test_measure_records_every_timing_spread_and_the_summary_reports_noise_and_skips(basic_manager):
    from opdispatch.tools._bench import timing_summary
    from opdispatch.tools._timing import Spread

    results = measure(TINY[:1], manager=basic_manager, device="cpu", warmup=1, reps=4, progress=False)
    (m,) = results
    assert set(m.spreads) == set(m.seconds) == {"cpu.flash", "reference.math"}
    for impl_id, spread in m.spreads.items():
        assert spread.min <= spread.median == m.seconds[impl_id] <= spread.max
    m.spreads["cpu.flash"] = Spread(0.9e-5, 1e-5, 1.1e-5, 0.05e-5)  # as an idle machine measures
    m.spreads["reference.math"] = Spread(1e-4, 2e-4, 9e-4, 1e-4)  # as a busy machine measures
    m.skipped["nvidia.cudnn"] = "runs on device type 'cuda', not 'cpu'"
    lines = timing_summary(results)
    assert lines[0].startswith(f"{m.case.describe()}: fastest {m.fastest} ") and "(min " in lines[0]
    assert lines[1] == "not timed, they cannot run here: nvidia.cudnn (`opdispatch list` says why)"
    assert lines[2].startswith("WARNING: 1 of 2 timings are noisy") and "worst: reference.math" in lines[2]
    assert "median 200.0 µs, min 100.0 µs, max 900.0 µs" in lines[2]


def test_progress_off_a_terminal_is_one_line_per_case_naming_what_runs(basic_manager, capsys):
    measure(TINY, manager=basic_manager, device="cpu", warmup=0, reps=1, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(TINY)  # one per case, however many implementations are registered
    assert lines[0].endswith("causal: cpu.flash, reference.math") and lines[1].endswith("d16: cpu.flash, reference.math")
