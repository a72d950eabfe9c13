"""docs/plugins.md is the plugin contract: its worked example runs and matches a float64 oracle on every layout,
its policy example routes to it, its capability tables are the code's fields and defaults, and the README's
first snippet runs on this CPU as written."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

import opdispatch
from opdispatch.policies import load_policy
from tests.test_numerics import naive_attention

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "plugins.md"


def marked_block(text: str, marker: str) -> str:
    """The fenced code block right after `<!-- marker -->`."""
    found = re.search(rf"<!-- {re.escape(marker)} -->\s*```\w*\n(.*?)```", text, re.S)
    assert found, f"no code block marked <!-- {marker} --> in the document"
    return found.group(1)


def marked_table(text: str, marker: str) -> dict[str, str]:
    """The markdown table right after `<!-- marker -->`: first cell (backticks stripped) -> second cell."""
    start = text.index(f"<!-- {marker} -->")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("field", "attribute") or set(cells[0]) <= {"-"}:
            continue
        rows[cells[0].replace("`", "")] = cells[1].replace("`", "")
    return rows


@pytest.fixture
def acme(basic_manager, tmp_path):
    """The document's example plugin, written to a module file and registered under its entry-point name."""
    path = tmp_path / "acme_doc_plugin.py"
    path.write_text(marked_block(DOC.read_text(), "example: acme plugin"))
    spec = importlib.util.spec_from_file_location("acme_doc_plugin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = basic_manager.register_plugin(module, name="acme")
    assert record.status == "loaded" and record.impl_ids == ["acme.chunked"], record.describe()
    return basic_manager


TO_LAYOUT = {"bhsd": lambda t: t, "bshd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.permute(2, 0, 1, 3)}
FROM_LAYOUT = {"bhsd": lambda t: t, "bshd": lambda t: t.transpose(1, 2), "sbhd": lambda t: t.permute(1, 2, 0, 3)}

CASES = {
    "plain": dict(sq=37, sk=150),
    "causal top-left, fewer queries": dict(sq=37, sk=150, causal=True),
    "causal bottom-right, fewer queries": dict(sq=37, sk=150, causal=True, causal_alignment="bottom_right"),
    "causal bottom-right, more queries (blind rows)": dict(sq=90, sk=20, causal=True,
                                                           causal_alignment="bottom_right"),
    "self-attention, MQA": dict(sq=65, sk=65, causal=True, hkv=1),
}


@pytest.mark.parametrize("layout", sorted(TO_LAYOUT))
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_documented_plugin_matches_the_oracle_on_every_layout(acme, layout, case):
    kw = dict(CASES[case])
    sq, sk, hkv = kw.pop("sq"), kw.pop("sk"), kw.pop("hkv", 2)
    gen = torch.Generator().manual_seed(len(case) * 7 + len(layout))
    b, hq, d = 2, 4, 24
    # Strided: each tensor is a slice of a wider one (the head dim stays unit-stride, the rest is not packed).
    q = torch.randn(b, hq, sq, d + 8, generator=gen)[..., :d].requires_grad_()
    k = torch.randn(b, hkv, sk, d + 8, generator=gen)[..., :d].requires_grad_()
    v = torch.randn(b, hkv, sk, d, generator=gen).requires_grad_()
    to, back = TO_LAYOUT[layout], FROM_LAYOUT[layout]
    out, lse = opdispatch.attention(to(q), to(k), to(v), layout=layout, impl="acme.chunked", return_lse=True, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, scale=d ** -0.5, causal=kw.get("causal", False),
                                       alignment=kw.get("causal_alignment", "top_left"))
    assert out.shape == to(torch.empty(b, hq, sq, d)).shape and out.dtype == torch.float32
    torch.testing.assert_close(back(out).double(), ref_out, atol=2e-5, rtol=2e-5)
    blind = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), blind) and (lse[blind] < 0).all()
    torch.testing.assert_close(lse.double()[~blind], ref_lse[~blind], atol=2e-5, rtol=2e-5)
    grad = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(back(out), (q, k, v), grad.float())
    want = torch.autograd.grad(ref_out, (q, k, v), grad)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r.double(), atol=5e-5, rtol=5e-5)


def test_the_documented_plugin_declines_what_it_does_not_declare(acme):
    packed = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    decision = opdispatch.explain(packed, packed, packed, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert "packed varlen (thd) not supported (supported layouts: bhsd, bshd, sbhd)" in decision.candidate(
        "acme.chunked").reasons
    x = torch.randn(1, 8, 2, 16)
    decision = opdispatch.explain(x, x, x, window=(2, 0))
    assert any("sliding window" in r for r in decision.candidate("acme.chunked").reasons)
    with pytest.raises(opdispatch.PinnedImplementationError, match="sliding window"):
        opdispatch.attention(x, x, x, window=(2, 0), impl="acme.chunked")


def test_unnamed_the_documented_plugin_ranks_before_the_reference_only(acme):
    x = torch.randn(1, 8, 2, 16)
    decision = opdispatch.explain(x, x, x)
    ids = [c.impl_id for c in decision.candidates]
    assert ids.index("cpu.flash") < ids.index("acme.chunked") < ids.index("reference.math")
    assert decision.chosen_id == "cpu.flash"
    assert decision.candidate("acme.chunked").decided_by.note == "order '*'"


def test_the_documented_policy_routes_to_the_plugin_with_its_options(acme, tmp_path):
    path = tmp_path / "acme.yaml"
    path.write_text(marked_block(DOC.read_text(), "example: acme policy"))
    acme.set_policy(load_policy(path))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen) for n in (5, 300, 300))
    decision = opdispatch.explain(q, k, v, causal=True, causal_alignment="bottom_right")
    assert decision.chosen_id == "acme.chunked"
    assert decision.decided_by.rule == "acme-first-on-cpu" and "acme.yaml:" in decision.decided_by.source
    assert decision.chosen.options.block_size == 128
    out = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right")
    ref, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=0.25, causal=True,
                             alignment="bottom_right")
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=2e-5, rtol=2e-5)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING or f.metadata.get("required"):
        return "required"  # no default, or one registration refuses
    return repr(f.default)


@pytest.mark.parametrize("caps", [opdispatch.AttentionCaps, opdispatch.RmsNormCaps, opdispatch.RotaryCaps])
def test_the_capability_tables_are_the_code(caps):
    table = marked_table(DOC.read_text(), f"caps: {caps.__name__}")
    assert list(table) == [f.name for f in dataclasses.fields(caps)], "fields (in declaration order)"
    for f in dataclasses.fields(caps):
        assert table[f.name] == _default_text(f), f"{caps.__name__}.{f.name}"


def test_the_impl_attribute_table_is_the_code():
    table = marked_table(DOC.read_text(), "attrs: Impl")
    documented = [name.strip() for row in table for name in row.split(",")]
    declared = [name for name in opdispatch.Impl.__annotations__ if not name.startswith("_")
                and name not in ("op", "reference_fallback")]
    assert sorted(documented) == sorted(declared)
    for row, default in table.items():
        for name in (n.strip() for n in row.split(",")):
            expected = "required" if not hasattr(opdispatch.Impl, name) else repr(getattr(opdispatch.Impl, name))
            assert default == expected, name


def test_the_readme_first_snippet_runs_on_cpu_as_written(basic_manager, capsys):
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(first, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    out = namespace["out"]
    assert out.shape == namespace["q"].shape and torch.isfinite(out).all()
    assert "chosen:" in capsys.readouterr().out
    assert not math.isnan(out.float().abs().max().item())


@pytest.fixture
def acme_rms_norm(basic_manager, tmp_path):
    """The document's rms_norm implementation in a plugin module of its own, registered as `acme`."""
    path = tmp_path / "acme_doc_rms_norm.py"
    path.write_text(marked_block(DOC.read_text(), "example: acme rms_norm")
                    + "\n\n@opdispatch.hookimpl\ndef opdispatch_impls():\n    return [AcmeRmsNorm()]\n")
    spec = importlib.util.spec_from_file_location("acme_doc_rms_norm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = basic_manager.register_plugin(module, name="acme")
    assert record.status == "loaded" and record.impl_ids == ["acme.rms_norm"], record.describe()
    return basic_manager


def rms_norm_oracle(x, weight, residual, eps):
    """float64 RMSNorm of x (+ residual) over the last dim: (y, h)."""
    h = x.double() if residual is None else x.double() + residual.double()
    y = h / torch.sqrt(h.square().mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.double()), h


RMS_CASES = {  # shape, weight, residual, grad; a thd batch is simply (total_tokens, hidden)
    "packed thd rows, weight, residual, grad": ((37, 96), True, True, True),
    "bshd, no weight, residual": ((2, 5, 3, 40), False, True, False),
    "bshd, weight, no residual, grad": ((3, 7, 64), True, False, True),
    "one row, no weight, no residual": ((1, 8), False, False, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(RMS_CASES))
def test_the_documented_rms_norm_matches_the_oracle(acme_rms_norm, case, dtype):
    from tests.conftest import TOLERANCES

    shape, with_weight, with_residual, grad = RMS_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_(grad)
    weight = torch.rand(shape[-1], generator=gen).add(0.5).to(dtype).requires_grad_(grad) if with_weight else None
    residual = torch.randn(shape, generator=gen).to(dtype).requires_grad_(grad) if with_residual else None
    before = [t.detach().clone() for t in (x, weight, residual) if t is not None]
    got = opdispatch.rms_norm(x, weight, 1e-5, residual, impl="acme.rms_norm")
    y, h = got if with_residual else (got, None)
    assert isinstance(got, tuple) == with_residual and y.shape == x.shape and y.dtype == dtype
    want_y, want_h = rms_norm_oracle(x, weight, residual, 1e-5)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), want_y, **tol)
    if with_residual:
        assert h.dtype == dtype and h.data_ptr() not in (x.data_ptr(), residual.data_ptr())
        torch.testing.assert_close(h.double(), want_h, **tol)
    after = [t.detach() for t in (x, weight, residual) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "an input was modified"
    if grad:
        inputs = [t for t in (x, weight, residual) if t is not None]
        up = torch.randn(shape, generator=gen, dtype=torch.float64)
        wide = [t.detach().double().requires_grad_() for t in (x, weight, residual) if t is not None]
        it = iter(wide)
        want_y, want_h = rms_norm_oracle(next(it), next(it) if with_weight else None,
                                         next(it) if with_residual else None, 1e-5)  # float64 leaves
        outs = (y, h) if with_residual else (y,)
        wants = (want_y, want_h) if with_residual else (want_y,)
        up = up.to(dtype)  # the upstream gradient as the kernel sees it; the oracle takes the same values
        got_grads = torch.autograd.grad(outs, inputs, [up] * len(outs))
        want_grads = torch.autograd.grad(wants, wide, [up.double()] * len(wants))
        for g, w in zip(got_grads, want_grads):  # a gradient sums rows: bounded relative to its largest element
            torch.testing.assert_close(g.double(), w.double(), atol=4 * tol["atol"] * w.abs().max().item(),
                                       rtol=4 * tol["rtol"])


CALL_RECORDS = [("attention", opdispatch.AttentionCall), ("rms_norm", opdispatch.RmsNormCall),
                ("rotary_embedding", opdispatch.RotaryCall)]


@pytest.mark.parametrize("op,record", CALL_RECORDS, ids=[op for op, _ in CALL_RECORDS])
def test_the_document_names_every_field_of_every_call_record(op, record):
    prose = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)  # described in the text, not only used
    spans = " ".join(re.findall(r"`([^`]*)`", prose))  # what the text writes as code
    missing = [name for name in record.__slots__ if not re.search(rf"(?<![\w.]){name}\b|call\.{name}\b", spans)]
    assert not missing, f"{record.__name__} fields docs/plugins.md does not describe: {missing}"


def test_the_document_lists_every_hook_and_the_current_plugin_api():
    from opdispatch.plugins import hookspec

    hooks = [name for name in dir(hookspec) if name.startswith("opdispatch_")]
    section = DOC.read_text().split("## Hooks and packaging", 1)[1].split("\n## ", 1)[0]
    assert hooks and all(f"`{name}(" in section for name in hooks), hooks
    assert f"OPDISPATCH_PLUGIN_API = {hookspec.PLUGIN_API_VERSION}" in section
    assert f"OPDISPATCH_PLUGIN_API = {hookspec.PLUGIN_API_VERSION}" in marked_block(DOC.read_text(),
                                                                                  "example: acme plugin")
    assert all(f"API {v}" in section for v in hookspec.PLUGIN_API_CHANGES), "each API change is named"


def test_the_test_plugin_package_is_packaged_as_the_document_says():
    """tests/plugin_pkg is the installable example: it depends on opdispatch and states the current API."""
    import tomllib

    from opdispatch.plugins.hookspec import PLUGIN_API_VERSION

    package = ROOT / "tests" / "plugin_pkg"
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"opdispatch\b", dep) for dep in project["dependencies"]), project["dependencies"]
    assert "opdispatch.plugins" in project["entry-points"]
    plugin = (package / "src" / "opdispatch_fakevendor" / "plugin.py").read_text()
    assert f"\nOPDISPATCH_PLUGIN_API = {PLUGIN_API_VERSION}" in plugin
