"""benchmarks/dispatch_overhead.py: its variants compute the same result, the floor has exactly attention's
signature, and the table has a row per size with every column."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

import opdispatch

from .conftest import REPO


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("dispatch_overhead", REPO / "benchmarks" / "dispatch_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_markdown_row_per_size(script, basic_manager):
    text = script.markdown(torch.device("cpu"), [(1, 1, 1, 8), (1, 2, 4, 16)], repeat=1)
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    assert [r.split(" | ")[0] for r in rows] == ["| (1, 1, 1, 8)", "| (1, 2, 4, 16)"]
    assert all(r.split(" | ")[1] == "cpu.flash" for r in rows)
    columns = len(script.COLUMNS) + len(script.OVERHEAD_COLUMNS) + 2
    assert all(r.count("µs") == len(script.OVERHEAD_COLUMNS) and r.count("|") == columns + 1 for r in rows)


def test_every_variant_is_timed_and_overheads_are_paired(script, basic_manager):
    result = script.bench_size((1, 1, 1, 8), torch.device("cpu"), repeat=3)
    assert result["impl"] == "cpu.flash"
    assert set(result["median"]) == set(result["over"]) == set(script.COLUMNS)
    assert result["over"]["direct"] == 0.0
    assert all(t > 0 for t in result["median"].values())


def test_overheads_are_the_median_of_same_round_differences(script):
    samples = {"direct": [10.0, 20.0, 30.0], "x": [11.0, 23.0, 31.0]}
    assert script.overheads(samples) == {"direct": 0.0, "x": 1.0}


def test_floor_has_attentions_signature_and_calls_through(script):
    seen = []
    floor = script.signature_floor(lambda q, k, v: seen.append((q, k, v)) or "out")
    assert list(inspect.signature(floor).parameters) == list(inspect.signature(opdispatch.attention).parameters)
    assert floor(1, 2, 3, layout="bhsd", impl="cpu.flash") == "out" and seen == [(1, 2, 3)]
    with pytest.raises(TypeError):
        floor(1, 2, 3, "bhsd")  # keyword-only, like attention


def test_direct_kernel_matches_the_bound_plan(script, basic_manager):
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    call = opdispatch.validate_attention(q, k, v, layout="bhsd", causal=True)
    direct = script.direct_kernel("cpu.flash", call)
    torch.testing.assert_close(direct(), opdispatch.plan(q, k, v, layout="bhsd", causal=True)(q, k, v))
    assert script.direct_kernel("reference.math", call) is None


def test_key_cost_table_has_every_group(script, basic_manager):
    text = script.key_costs_markdown(torch.device("cpu"), (1, 1, 1, 8), repeat=1)
    rows = [line.split(" | ")[0].lstrip("| ") for line in text.splitlines() if line.startswith("| flags")
            or line.startswith("| +")]
    assert rows == list(script.KEY_GROUPS)


def test_every_keyed_variant_returns_the_planned_result(script, basic_manager):
    q, k, v = (torch.randn(1, 1, 3, 8) for _ in range(3))
    expected = opdispatch.plan(q, k, v, layout="bhsd")(q, k, v)
    for fields in script.KEY_GROUPS.values():
        namespace = {"fast": {}, "target": opdispatch.plan(q, k, v, layout="bhsd"), "grad": torch.is_grad_enabled}
        exec(script._KEYED.format(fields=fields), namespace)
        for _ in range(2):  # miss, then hit
            torch.testing.assert_close(namespace["keyed"](q, k, v, layout="bhsd"), expected)
        assert len(namespace["fast"]) == 1
