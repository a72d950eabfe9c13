"""Plugins at three levels: in-memory objects, faked entry points, and a real package installed with pip."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import opdispatch
from opdispatch.plugins import ENTRY_POINT_GROUP, hookspec, load_entry_point_plugins
from tests.conftest import REPO

F32 = frozenset({torch.float32})


class DoubleScale(opdispatch.AttentionImpl):
    """A fake vendor kernel: correct attention computed by the reference, tagged so tests can tell it ran."""

    vendor = "memvendor"
    name = "attn"
    priority = 1
    caps = opdispatch.AttentionCaps(dtypes=F32, gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))
    ran = 0

    def run(self, call):
        type(self).ran += 1
        return opdispatch.get_manager().registry.get("attention", "reference.math").impl.run(call)


def _plugin_module(name: str, impls=None, raise_in_hook: Exception | None = None,
                   namespaces=("memvendor", "hookvendor")) -> types.ModuleType:
    module = types.ModuleType(name)
    module.OPDISPATCH_NAMESPACES = namespaces

    @opdispatch.hookimpl
    def opdispatch_impls():
        if raise_in_hook is not None:
            raise raise_in_hook
        return impls or []

    module.opdispatch_impls = opdispatch_impls
    return module


def _entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def qkv():
    return torch.randn(1, 5, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)


# -- in memory ---------------------------------------------------------------------------------------------

def test_in_memory_plugin_registers_and_is_selected_through_a_policy(manager):
    record = manager.register_plugin(_plugin_module("memplugin", [DoubleScale()]), name="memplugin")
    assert record.status == "loaded" and record.impl_ids == ["memvendor.attn"]
    from opdispatch.policies import parse_policy

    manager.set_policy(parse_policy("ops:\n  attention:\n    order: ['memvendor.*', cpu.flash]\n", "<inline>"))
    q, k, v = qkv()
    before = DoubleScale.ran
    out = opdispatch.attention(q, k, v, causal=True)
    assert DoubleScale.ran == before + 1
    torch.testing.assert_close(out, opdispatch.attention(q, k, v, causal=True, impl="reference.math"))
    decision = opdispatch.explain(q, k, v, causal=True)
    assert decision.chosen_id == "memvendor.attn"
    assert decision.candidate("memvendor.attn").origin == "plugin 'memplugin' (module tests.test_plugins)"
    assert "order 'memvendor.*'" in str(decision.decided_by)


def test_plugin_raising_in_its_hook_is_recorded_and_others_keep_working(manager):
    record = manager.register_plugin(_plugin_module("bad", raise_in_hook=RuntimeError("driver too old")), name="bad")
    assert record.status == "failed" and record.stage == "register"
    assert "RuntimeError: driver too old" in record.error and "Traceback" in record.traceback
    q, k, v = qkv()
    decision = opdispatch.explain(q, k, v)
    assert decision.chosen_id == "cpu.flash"
    failed = decision.candidate("plugin:bad")
    assert failed.status == "failed to load" and "driver too old" in failed.reasons[0]


def test_duplicate_id_from_two_plugins_is_an_error_naming_both(manager):
    manager.register_plugin(_plugin_module("first", [DoubleScale()]), name="first")
    record = manager.register_plugin(_plugin_module("second", [DoubleScale()]), name="second")
    assert record.status == "failed"
    assert "registered twice: first by plugin 'first'" in record.error and "again by plugin 'second'" in record.error


# -- faked entry points ------------------------------------------------------------------------------------

@pytest.fixture
def fake_modules(monkeypatch):
    good = _plugin_module("fake_ep_good", [DoubleScale()])
    broken_hook = _plugin_module("fake_ep_hook", raise_in_hook=ValueError("bad capability table"))
    monkeypatch.setitem(sys.modules, "fake_ep_good", good)
    monkeypatch.setitem(sys.modules, "fake_ep_hook", broken_hook)
    return [
        _entry_point("good", "fake_ep_good"),
        _entry_point("missing", "fake_ep_does_not_exist_xyz"),
        _entry_point("hookfail", "fake_ep_hook"),
    ]


def test_faked_entry_points_load_with_failures_isolated(fake_modules):
    manager = opdispatch.OpManager(entry_points=fake_modules, environ={})
    manager.ensure_initialized()
    by_name = {r.name: r for r in manager.plugins}
    assert by_name["good"].status == "loaded" and by_name["good"].impl_ids == ["memvendor.attn"]
    assert by_name["missing"].status == "failed" and by_name["missing"].stage == "load"
    assert "ModuleNotFoundError" in by_name["missing"].error
    assert by_name["hookfail"].status == "failed" and by_name["hookfail"].stage == "register"
    assert [r.impl.id for r in manager.registry] == ["memvendor.attn"]


def test_pin_to_an_impl_whose_plugin_failed_says_why_it_is_gone(fake_modules):
    manager = opdispatch.OpManager(entry_points=fake_modules, environ={})
    q, k, v = qkv()
    with pytest.raises(opdispatch.PinnedImplementationError) as info:
        manager.resolve("attention", opdispatch.validate_attention(q, k, v), impl="hookvendor.fast")
    message = str(info.value)
    assert "'hookvendor.fast' pinned by impl= is not registered" in message
    assert "plugin 'hookfail'" in message and "bad capability table" in message
    assert "plugin 'missing'" in message and "ModuleNotFoundError" in message


@pytest.mark.parametrize("env,loaded", [
    ({"OPDISPATCH_PLUGINS": "good"}, {"good"}),
    ({"OPDISPATCH_DISABLE_PLUGINS": "missing,hookfail"}, {"good"}),
    ({"OPDISPATCH_PLUGINS": "good,missing", "OPDISPATCH_DISABLE_PLUGINS": "missing"}, {"good"}),
])
def test_allow_and_block_lists(fake_modules, env, loaded):
    pm = __import__("pluggy").PluginManager("opdispatch")
    pm.add_hookspecs(hookspec)
    records = load_entry_point_plugins(pm, fake_modules, env)
    assert {r.name for r in records if r.status == "loaded"} == loaded
    disabled = [r for r in records if r.status == "disabled"]
    assert disabled and all(("OPDISPATCH_PLUGINS" in r.error) or ("OPDISPATCH_DISABLE_PLUGINS" in r.error)
                            for r in disabled)


def test_builtin_vendors_come_from_our_own_entry_points():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["reference"] == "opdispatch.vendors.reference"
    assert eps["cpu"] == "opdispatch.vendors.cpu"
    assert all(ep.dist.name == "opdispatch" for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
               if ep.name in ("reference", "cpu"))


# -- a real package installed with pip ---------------------------------------------------------------------

def _install_plugin_pkg(tmp_path_factory, plugin_api: int | None = None) -> Path:
    """pip-install a copy of tests/plugin_pkg into a fresh folder (the checkout stays clean); `plugin_api`
    rewrites the OPDISPATCH_PLUGIN_API it declares (the same package written for another plugin API)."""
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("src") / "plugin_pkg"
    shutil.copytree(REPO / "tests" / "plugin_pkg", source)
    if plugin_api is not None:
        plugin = source / "src" / "opdispatch_fakevendor" / "plugin.py"
        text, count = re.subn(r"^OPDISPATCH_PLUGIN_API = \d+", f"OPDISPATCH_PLUGIN_API = {plugin_api}",
                              plugin.read_text(), flags=re.M)
        assert count == 1, "tests/plugin_pkg's plugin declares its OPDISPATCH_PLUGIN_API once"
        plugin.write_text(text)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)],
                   check=True, capture_output=True, text=True)
    return target


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    return _install_plugin_pkg(tmp_path_factory)


def _run_with(site: Path, code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env["PYTHONPATH"] = str(site)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_real_installed_plugin_is_discovered_and_selected_by_yaml_policy(installed_plugin, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops:\n  attention:\n    order:\n      - fakevendor.sdpa\n      - cpu.flash\n")
    result = _run_with(installed_plugin, """
        import json, torch, opdispatch
        q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
        d = opdispatch.explain(q, k, v, causal=True)
        out = opdispatch.attention(q, k, v, causal=True)
        ref = opdispatch.attention(q, k, v, causal=True, impl="reference.math")
        rec = [r for r in opdispatch.get_manager().plugins if r.name == "fakevendor"][0]
        print(json.dumps(dict(chosen=d.chosen_id, decided=str(d.decided_by), err=(out - ref).abs().max().item(),
                              origin=rec.origin, status=rec.status)))
    """, {"OPDISPATCH_POLICY": str(policy)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["chosen"] == "fakevendor.sdpa"
    assert report["decided"] == f"{policy}:4 (order 'fakevendor.sdpa')"
    assert report["err"] < 1e-5
    assert report["status"] == "loaded"
    assert report["origin"] == "fakevendor = opdispatch_fakevendor.plugin from opdispatch-fakevendor 0.3.1"


@pytest.mark.slow
def test_real_installed_plugin_can_be_disabled_and_doctor_shows_it(installed_plugin):
    result = _run_with(installed_plugin, """
        import sys
        from opdispatch.tools._cli import main
        sys.exit(main(["doctor"]))
    """, {"OPDISPATCH_DISABLE_PLUGINS": "fakevendor"})
    assert result.returncode == 0, result.stderr
    assert "plugin 'fakevendor' (fakevendor = opdispatch_fakevendor.plugin from opdispatch-fakevendor 0.3.1) is " \
           "disabled: listed in OPDISPATCH_DISABLE_PLUGINS" in result.stdout
    assert "fakevendor.sdpa" not in result.stdout.split("implementations:")[-1]


@pytest.mark.slow
def test_an_installed_plugin_written_for_api_1_is_refused_with_what_changed(tmp_path_factory):
    site = _install_plugin_pkg(tmp_path_factory, plugin_api=1)
    result = _run_with(site, """
        import torch, opdispatch
        from opdispatch.tools._cli import main
        code = main(["doctor"])
        q = torch.randn(1, 4, 2, 16)
        torch.testing.assert_close(opdispatch.attention(q, q, q), opdispatch.attention(q, q, q, impl="reference.math"))
        print("dispatch goes on:", opdispatch.explain(q, q, q).chosen_id)
        print("doctor exit status", code)
    """, {})
    assert result.returncode == 0, result.stderr
    assert "doctor exit status 1" in result.stdout  # a plugin that failed to load is a problem doctor reports
    assert ("plugin 'fakevendor' (fakevendor = opdispatch_fakevendor.plugin from opdispatch-fakevendor 0.3.1) failed "
            "to load: ValueError: plugin 'fakevendor' declares OPDISPATCH_PLUGIN_API = 1, but this opdispatch "
            "implements plugin API 2, which changed since: API 2: attention's AttentionCaps.layouts is required"
            ) in result.stdout
    assert "Update the plugin to API 2 (then set OPDISPATCH_PLUGIN_API = 2; docs/plugins.md)" in result.stdout
    assert "dispatch goes on: cpu.flash" in result.stdout
