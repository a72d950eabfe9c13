"""Plugin hygiene: namespaces, built-ins that cannot be displaced, all-or-nothing registration, misspelt hooks,
the plugin API version, bounded imports, hooks called through pluggy, and fork safety."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

import opdispatch
from opdispatch.plugins import ENTRY_POINT_GROUP
from tests.conftest import REPO


class Acme(opdispatch.AttentionImpl):
    vendor = "acme"
    name = "fast"
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

    def run(self, call):
        raise AssertionError("never run here")


def impl(vendor, name, **attrs):
    return type(f"{vendor}_{name}", (Acme,), dict(vendor=vendor, name=name, **attrs))()


def module(name, impls=(), namespaces=None, hook_name="opdispatch_impls", **attrs):
    mod = types.ModuleType(name)

    def hook():
        return list(impls)

    hook.__name__ = hook_name
    setattr(mod, hook_name, opdispatch.hookimpl(hook))
    if namespaces is not None:
        mod.OPDISPATCH_NAMESPACES = namespaces
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def builtin_and(monkeypatch, *extra):
    """The installed built-in entry points plus fake third-party ones ((name, module) pairs)."""
    eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    for name, mod in extra:
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        eps.append(importlib.metadata.EntryPoint(name=name, value=mod.__name__, group=ENTRY_POINT_GROUP))
    manager = opdispatch.OpManager(entry_points=eps, environ={})
    manager.ensure_initialized()
    return manager, {r.name: r for r in manager.plugins}


@pytest.mark.parametrize("plugin_name", ["acme", "aaa", "zzz"])
def test_a_third_party_plugin_cannot_displace_a_builtin(monkeypatch, plugin_name):
    rogue = module(f"rogue_{plugin_name}", [impl("nvidia", "cudnn")], namespaces=("nvidia",))
    manager, records = builtin_and(monkeypatch, (plugin_name, rogue))
    assert records["nvidia"].status == "loaded" and "nvidia.cudnn" in records["nvidia"].impl_ids
    assert records[plugin_name].status == "failed" and records[plugin_name].stage == "register"
    assert "'nvidia' is the namespace of the built-in plugin 'nvidia'" in records[plugin_name].error
    assert manager.registry.get("attention", "nvidia.cudnn").origin.plugin == "nvidia"


def test_ids_outside_the_namespace_fail_the_whole_plugin(monkeypatch):
    mixed = module("acme_mixed", [impl("acme", "good"), impl("other", "bad")])
    manager, records = builtin_and(monkeypatch, ("acme", mixed))
    assert records["acme"].status == "failed" and "'other.bad', outside its namespaces acme" in records["acme"].error
    assert manager.registry.get("attention", "acme.good") is None  # nothing half-registered
    allowed = module("acme_ns", [impl("acme", "good"), impl("acme_npu", "fast")], namespaces=("acme_npu",))
    record = manager.register_plugin(allowed, name="acme2")
    assert record.status == "failed"  # `acme` is not acme2's namespace
    record = manager.register_plugin(module("acme_ns2", [impl("acme3", "good"), impl("acme_npu", "fast")],
                                            namespaces=("acme_npu",)), name="acme3")
    assert record.status == "loaded" and record.impl_ids == ["acme3.good", "acme_npu.fast"]


def test_a_plugin_that_fails_to_register_leaves_pluggy_whole(monkeypatch):
    """A failed plugin's other hooks (its device probe) never run, and its name is free for a corrected plugin:
    it is unregistered from pluggy, not only marked failed."""
    probed = []

    def probe(device):
        probed.append(device)
        return None

    broken = module("acme_broken", [impl("acme", "one"), impl("other", "bad")],
                    opdispatch_probe_device=opdispatch.hookimpl(probe))
    probe.__name__ = "opdispatch_probe_device"
    manager, records = builtin_and(monkeypatch)
    record = manager.register_plugin(broken, name="acme")
    assert record.status == "failed" and record.stage == "register"
    assert not manager._pm.is_registered(broken) and manager._pm.get_plugin("acme") is None
    manager.device_info(torch.device("cpu"))
    assert probed == []  # its probe is not a hook any more
    fixed = manager.register_plugin(module("acme_fixed", [impl("acme", "one")]), name="acme")
    assert fixed.status == "loaded" and fixed.impl_ids == ["acme.one"]
    unloadable = module("acme_unloadable", [impl("acme2", "x")], OPDISPATCH_PLUGIN_API=99)
    assert manager.register_plugin(unloadable, name="acme2").stage == "load"
    assert not manager._pm.is_registered(unloadable)


def test_a_refused_implementation_rejects_the_plugin_whole(monkeypatch):
    bad_caps = impl("acme", "broken", caps="not caps")
    manager, records = builtin_and(monkeypatch, ("acme", module("acme_half", [impl("acme", "one"), bad_caps])))
    assert records["acme"].status == "failed" and "invalid declaration" in records["acme"].error
    assert manager.registry.get("attention", "acme.one") is None and records["acme"].impl_ids == []


def test_a_misspelt_hook_fails_its_plugin_with_a_hint(monkeypatch, caplog):
    manager, records = builtin_and(monkeypatch, ("acme", module("acme_typo", [impl("acme", "x")],
                                                                hook_name="opdispatch_impl")))
    record = records["acme"]
    assert record.status == "failed" and record.stage == "load"
    assert "'opdispatch_impl': did you mean ['opdispatch_impls']?" in record.error
    assert any("plugin 'acme'" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_the_plugin_api_version_is_checked(monkeypatch):
    manager, records = builtin_and(monkeypatch, ("acme", module("acme_api", [impl("acme", "x")],
                                                                OPDISPATCH_PLUGIN_API=3)))
    assert records["acme"].status == "failed"
    assert "OPDISPATCH_PLUGIN_API = 3, but this opdispatch implements plugin API 2; install" in records["acme"].error
    record = manager.register_plugin(module("acme_api2", [impl("acme2", "x")], OPDISPATCH_PLUGIN_API=2), "acme2")
    assert record.status == "loaded"
    for bad in ("2", 0, True):  # not an int API version (True == 1 is no version either)
        record = manager.register_plugin(module(f"acme_bad_{bad}", [impl("acme3", "x")], OPDISPATCH_PLUGIN_API=bad),
                                         "acme3")
        assert record.status == "failed" and f"OPDISPATCH_PLUGIN_API = {bad!r}, but" in record.error


def test_a_plugin_written_for_api_1_is_told_what_changed(monkeypatch):
    manager, records = builtin_and(monkeypatch, ("acme", module("acme_v1", [impl("acme", "x")],
                                                                OPDISPATCH_PLUGIN_API=1)))
    error = records["acme"].error
    assert records["acme"].status == "failed" and manager.registry.get("attention", "acme.x") is None
    assert ("OPDISPATCH_PLUGIN_API = 1, but this opdispatch implements plugin API 2, which changed since: API 2: "
            "attention's AttentionCaps.layouts is required") in error
    assert "Update the plugin to API 2 (then set OPDISPATCH_PLUGIN_API = 2; docs/plugins.md)" in error


def _written_for_api_1(module_name, **attrs):
    """A plugin module as API 1 allowed: an attention implementation whose caps leave `layouts` empty, its class
    defined in that module."""
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}))
    cls = type("Old", (Acme,), dict(vendor="acme", name="old", caps=caps, __module__=module_name))
    return module(module_name, [cls()], **attrs)


def test_a_plugin_that_states_no_api_and_fails_registration_is_told_what_changed(monkeypatch):
    manager, records = builtin_and(monkeypatch, ("acme", _written_for_api_1("acme_last_month")))
    record = records["acme"]
    assert record.status == "failed" and record.stage == "register"
    assert manager.registry.get("attention", "acme.old") is None
    assert "caps.layouts is not declared: list the layouts run() accepts" in record.error
    assert ("acme_last_month declares no OPDISPATCH_PLUGIN_API, so it is held to the current plugin API 2; if it "
            "was written for an older one, what changed since: API 2: attention's AttentionCaps.layouts is "
            "required") in record.error
    assert "declare OPDISPATCH_PLUGIN_API = 2; docs/plugins.md" in record.error
    # Declaring the current API, the same mistake is only the mistake: no history lesson.
    declared = _written_for_api_1("acme_declares_2", namespaces=("acme",), OPDISPATCH_PLUGIN_API=2)
    monkeypatch.setitem(sys.modules, declared.__name__, declared)
    record = manager.register_plugin(declared, "acme_v2")
    assert record.status == "failed" and "caps.layouts is not declared" in record.error
    assert "OPDISPATCH_PLUGIN_API" not in record.error
    # Declaring API 1 is refused before registration, with the same change named.
    old = _written_for_api_1("acme_declares_1", namespaces=("acme",), OPDISPATCH_PLUGIN_API=1)
    monkeypatch.setitem(sys.modules, old.__name__, old)
    record = manager.register_plugin(old, "acme_v1")
    assert record.status == "failed" and "caps.layouts is not declared" not in record.error
    assert "OPDISPATCH_PLUGIN_API = 1, but this opdispatch implements plugin API 2, which changed since" in record.error


def test_a_hanging_import_fails_its_plugin_in_bounded_time(tmp_path, monkeypatch):
    (tmp_path / "hangs_at_import.py").write_text("import time\ntime.sleep(30)\n")
    (tmp_path / "imports_fine_later.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [importlib.metadata.EntryPoint(name="hangs", value="hangs_at_import", group=ENTRY_POINT_GROUP),
           *importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    manager = opdispatch.OpManager(entry_points=eps, environ={"OPDISPATCH_PLUGIN_TIMEOUT": "0.5"})
    start = time.monotonic()
    q = torch.randn(1, 4, 2, 8)
    previous = opdispatch.set_manager(manager)
    try:
        out = opdispatch.attention(q, q, q)
    finally:
        opdispatch.set_manager(previous)
    assert time.monotonic() - start < 10 and out.shape == q.shape
    record = next(r for r in manager.plugins if r.name == "hangs")
    assert record.status == "failed" and "did not finish in 0.5 s" in record.error
    assert "OPDISPATCH_DISABLE_PLUGINS=hangs" in record.error
    import imports_fine_later  # other imports are not blocked by the hung one

    assert imports_fine_later.VALUE == 7


def test_unknown_names_in_the_allow_and_block_lists_are_warned_about(caplog):
    manager = opdispatch.OpManager(environ={"OPDISPATCH_PLUGINS": "acmee,reference,cpu",
                                            "OPDISPATCH_DISABLE_PLUGINS": "nvidiaa"})
    manager.ensure_initialized()
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("OPDISPATCH_PLUGINS names 'acmee', which is no installed plugin" in m for m in messages)
    assert any("OPDISPATCH_DISABLE_PLUGINS names 'nvidiaa'" in m and "did you mean 'nvidia'" in m for m in messages)


def test_device_probes_go_through_pluggy_and_a_raising_probe_is_skipped(manager):
    from opdispatch import DeviceInfo

    def probe_raises(device):
        raise RuntimeError("driver query failed")

    def probe_answers(device):
        return DeviceInfo(vendor="acme", type=device.type, arch="a1", name="Acme A1")

    for name, fn in (("acme", probe_answers), ("broken", probe_raises)):
        mod = types.ModuleType(f"probe_{name}")
        fn.__name__ = "opdispatch_probe_device"
        mod.opdispatch_probe_device = opdispatch.hookimpl(fn)
        assert manager.register_plugin(mod, name=name).status == "loaded"
    info = manager._probe_with_plugins(torch.device("meta"))
    assert info is not None and info.name == "Acme A1"
    broken = next(r for r in manager.plugins if r.name == "broken")
    assert broken.status == "failed" and broken.stage == "probe" and "driver query failed" in broken.error


FORK_CHILD = """
    import os, sys, threading, time, torch, opdispatch
    torch.set_num_threads(1)  # a forked child otherwise hangs in the OpenMP pool the parent started
    q = torch.randn(1, 8, 2, 16)
    opdispatch.attention(q, q, q)
    manager = opdispatch.get_manager()
    held = threading.Event()

    def hold():
        with manager._lock, manager.registry._lock, manager.breaker._lock:
            held.set()
            time.sleep(30)

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        try:
            manager.register_impl(type(manager.implementation("attention", "reference.math"))(), "again")
        except Exception as exc:  # a duplicate id: the registry's lock was free to say so
            ok = "registered twice" in str(exc)
        out = opdispatch.attention(torch.randn(1, 5, 2, 16), q[:, :5], q[:, :5], causal=True)
        os._exit(0 if ok and out.shape == (1, 5, 2, 16) and not manager.fast.get("stale") else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_while_locks_are_held_dispatches():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env["OPDISPATCH_PLUGINS"] = "cpu,reference"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(FORK_CHILD)], capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "0", result.stdout + result.stderr


ROGUE_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-rogue"
version = "1.0"

[project.entry-points."opdispatch.plugins"]
acme = "acme_rogue"

[tool.setuptools]
py-modules = ["acme_rogue"]
"""

ROGUE_MODULE = """
import torch, opdispatch

OPDISPATCH_NAMESPACES = ("nvidia",)

class Cudnn(opdispatch.AttentionImpl):
    vendor, name = "nvidia", "cudnn"
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

    def run(self, call):
        raise RuntimeError("rogue")

@opdispatch.hookimpl
def opdispatch_impls():
    return [Cudnn()]
"""


@pytest.mark.slow
def test_an_installed_rogue_package_cannot_take_a_builtin_id(tmp_path):
    source, site = tmp_path / "src", tmp_path / "site"
    source.mkdir()
    (source / "pyproject.toml").write_text(ROGUE_PYPROJECT)
    (source / "acme_rogue.py").write_text(ROGUE_MODULE)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(source)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env["PYTHONPATH"] = str(site)
    code = """
        import json, opdispatch
        m = opdispatch.get_manager(); m.ensure_initialized()
        rec = {r.name: r for r in m.plugins}
        print(json.dumps(dict(acme=rec["acme"].status, error=rec["acme"].error, dist=rec["acme"].distribution,
                              nvidia=rec["nvidia"].impl_ids,
                              origin=m.registry.get("attention", "nvidia.cudnn").origin.plugin)))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["acme"] == "failed" and report["dist"] == "acme-rogue" and report["origin"] == "nvidia"
    assert "built-in plugin 'nvidia'" in report["error"] and "nvidia.cudnn" in report["nvidia"]


def test_a_pin_to_a_disabled_plugin_says_it_is_disabled_not_missing():
    manager = opdispatch.OpManager(environ={"OPDISPATCH_DISABLE_PLUGINS": "nvidia"})
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(opdispatch.PinnedImplementationError) as info:
        manager.resolve("attention", opdispatch.validate_attention(q, q, q), impl="nvidia.cudnn")
    message = str(info.value)
    assert "Its plugin 'nvidia' is installed but disabled: listed in OPDISPATCH_DISABLE_PLUGINS" in message
    assert "install the plugin" not in message
