"""Registry and OpManager: registration rules, ordering, pins, errors that list every candidate, caching."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl, Origin, Registry, RegistrationError
from opdispatch.base._decision import CHOSEN, DENIED, ELIGIBLE, REJECTED, UNAVAILABLE

F32 = frozenset({torch.float32})
DENSE = frozenset({"bshd", "bhsd", "sbhd"})
TOP_LEFT = frozenset({"top_left"})


def make_impl(vendor="fake", name="impl", priority=0, caps=None, run=None, availability=None, **attrs):
    caps = caps or AttentionCaps(dtypes=F32, layouts=DENSE, causal=True, causal_alignments=TOP_LEFT)

    def _run(self, call):
        return run(call) if run else call.q * 1.0

    def _extra(self, device):
        return availability

    cls = type(f"Impl_{vendor}_{name}", (AttentionImpl,), dict(
        vendor=vendor, name=name, priority=priority, caps=caps, run=_run, extra_availability=_extra, **attrs))
    return cls()


def qkv(dtype=torch.float32):
    return torch.randn(1, 4, 2, 8, dtype=dtype), torch.randn(1, 4, 2, 8, dtype=dtype), torch.randn(1, 4, 2, 8, dtype=dtype)


# -- registry ----------------------------------------------------------------------------------------------

def test_duplicate_id_names_both_origins():
    reg = Registry()
    reg.register(make_impl(), Origin("first", "pkg_a.mod"))
    with pytest.raises(RegistrationError) as info:
        reg.register(make_impl(), Origin("second", "pkg_b.mod"))
    message = str(info.value)
    assert "'fake.impl'" in message and "plugin 'first' (module pkg_a.mod)" in message
    assert "plugin 'second' (module pkg_b.mod)" in message
    assert info.value.impl is not None


@pytest.mark.parametrize("attrs,problem", [
    (dict(vendor="Bad-Vendor"), "vendor='Bad-Vendor' must be a lower-case identifier"),
    (dict(name=""), "name='' must be a lower-case identifier"),
    (dict(priority="high"), "priority='high' must be an int"),
    (dict(min_capability=(8,)), "min_capability=(8,) must be None or a (major, minor) tuple"),
    (dict(device_types=["cuda"]), "device_types must be a set or frozenset"),
    (dict(caps=AttentionCaps(dtypes=F32, layouts=frozenset({"bsdh"}), causal=True, causal_alignments=TOP_LEFT)), "caps.layouts has unknown layouts ['bsdh']"),
    (dict(caps=AttentionCaps(dtypes=frozenset(), layouts=DENSE, causal=True, causal_alignments=TOP_LEFT)), "caps.dtypes must be a non-empty set"),
    # Undeclared means unsupported; where nothing would be supported, registration asks for the declaration.
    (dict(caps=AttentionCaps(dtypes=F32)), "caps.layouts is not declared: list the layouts run() accepts"),
    (dict(caps=AttentionCaps(dtypes=F32, layouts=DENSE, window=True)),
     "caps.causal_alignments is not declared but caps claims window"),
    (dict(caps=AttentionCaps(dtypes=F32, layouts=DENSE, causal=True)),
     "caps.causal_alignments is not declared but caps claims causal"),
])
def test_invalid_declarations_are_refused_at_registration(attrs, problem):
    caps = attrs.pop("caps", None)
    impl = make_impl(caps=caps, **{k: v for k, v in attrs.items() if k not in ("vendor", "name", "priority")})
    for key in ("vendor", "name", "priority"):
        if key in attrs:
            setattr(impl, key, attrs[key])
    with pytest.raises(RegistrationError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        Registry().register(impl, Origin("p", "m"))


def test_undeclared_features_are_unsupported(basic_manager):
    impl = make_impl("minimal", "impl", caps=AttentionCaps(dtypes=F32, layouts=frozenset({"bshd"})))
    basic_manager.register_impl(impl)
    device = basic_manager.device_info(torch.device("cpu"))
    q, k, v = qkv()
    ok = opdispatch.validate_attention(q, k, v)
    assert impl.not_supported_reasons(ok, device) == []
    reasons = impl.not_supported_reasons(opdispatch.validate_attention(q, k, v, causal=True, deterministic=True,
                                                                       layout="bhsd"), device)
    assert "causal masking not supported" in reasons
    assert "layout 'bhsd' not supported (supported layouts: bshd)" in reasons
    assert any("deterministic" in r for r in reasons), reasons
    # An explicit empty alignment set is a declaration: causal with equal lengths only.
    equal_only = make_impl("equal", "only", caps=AttentionCaps(dtypes=F32, layouts=DENSE, causal=True,
                                                               causal_alignments=frozenset()))
    basic_manager.register_impl(equal_only)
    longer_k = opdispatch.validate_attention(q, torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), causal=True)
    assert equal_only.not_supported_reasons(opdispatch.validate_attention(q, k, v, causal=True), device) == []
    assert equal_only.not_supported_reasons(longer_k, device) == [
        "causal_alignment 'top_left' with seqlen_q != seqlen_k not supported (supported: none: equal lengths only)"]


def test_rotary_must_declare_its_pairing():
    class NoPairing(opdispatch.RotaryImpl):
        vendor, name = "fake", "rope"
        caps = opdispatch.RotaryCaps(dtypes=F32)

        def run(self, call):
            raise AssertionError("never runs")

    with pytest.raises(RegistrationError, match="declares neither neox=True"):
        Registry().register(NoPairing(), Origin("p", "m"))


def test_registering_a_non_impl_is_refused():
    with pytest.raises(RegistrationError, match="is not an opdispatch.Impl instance"):
        Registry().register(object(), Origin("p", "m"))  # type: ignore[arg-type]


def test_registry_is_thread_safe():
    reg = Registry()
    errors = []

    def worker(i):
        try:
            for j in range(50):
                reg.register(make_impl(vendor=f"v{i}", name=f"n{j}"), Origin(f"p{i}", "m"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(reg) == 400 and len(reg.for_op("attention")) == 400


# -- manager -----------------------------------------------------------------------------------------------

def test_policy_order_then_priority(basic_manager):
    basic_manager.register_impl(make_impl("alpha", "slow", priority=10))
    basic_manager.register_impl(make_impl("zeta", "fast", priority=50))
    q, k, v = qkv()
    decision = opdispatch.explain(q, k, v)
    ids = [c.impl_id for c in decision.candidates]
    # The default policy names cpu.flash, then '*' (what it does not name, highest priority first), then the
    # reference: a plugin's implementation outranks the unfused last resort without any policy edit.
    assert ids[:4] == ["cpu.flash", "zeta.fast", "alpha.slow", "reference.math"]
    assert decision.chosen_id == "cpu.flash"
    assert decision.candidate("zeta.fast").status == ELIGIBLE
    assert decision.candidate("zeta.fast").decided_by.note == "order '*'"
    # Without an order that places it, priority ranks it.
    basic_manager.set_policy(_policy(basic_manager, "order: [cpu.flash]"))
    decision = opdispatch.explain(q, k, v)
    assert [c.impl_id for c in decision.candidates][1:3] == ["zeta.fast", "alpha.slow"]
    assert decision.candidate("zeta.fast").decided_by.kind == "priority"


def test_chosen_is_first_eligible_and_statuses_are_reported(basic_manager):
    basic_manager.register_impl(make_impl("aaa", "unavail", availability="library 'aaa' is not installed"))
    basic_manager.register_impl(make_impl("bbb", "bf16only", caps=AttentionCaps(dtypes=frozenset({torch.bfloat16}), layouts=DENSE, causal=True, causal_alignments=TOP_LEFT)))
    basic_manager.set_policy(_policy(basic_manager, "order: [aaa.unavail, bbb.bf16only, reference.math, cpu.flash]"))
    q, k, v = qkv()
    decision = opdispatch.explain(q, k, v)
    assert [c.status for c in decision.candidates] == [UNAVAILABLE, REJECTED, CHOSEN, ELIGIBLE]
    assert decision.candidate("aaa.unavail").reasons == ["library 'aaa' is not installed"]
    assert decision.candidate("bbb.bf16only").reasons == ["dtype fp32 not supported (supported: bf16)"]
    text = str(decision)
    assert "reference.math" in text and "decided by" in text and "dtype fp32 not supported" in text


def _policy(manager, op_body: str, tmp_text: str | None = None):
    from opdispatch.policies import parse_policy

    body = "\n".join("    " + line for line in op_body.splitlines())
    return parse_policy(f"ops:\n  attention:\n{body}\n", "<test policy>")


def test_no_implementation_error_lists_every_candidate(basic_manager):
    basic_manager.register_impl(make_impl("aaa", "unavail", availability="needs the aaa runtime"))
    q, k, v = (t.to(torch.float64) for t in qkv())
    basic_manager.set_policy(_policy(basic_manager, "deny: [reference.math]"))
    with pytest.raises(opdispatch.NoImplementationError) as info:
        opdispatch.attention(q, k, v, dropout_p=0.5)
    message = str(info.value)
    assert isinstance(info.value, NotImplementedError)
    for expected in ("cpu.flash", "dropout_p=0.5 not supported", "aaa.unavail", "needs the aaa runtime",
                     "reference.math", DENIED, "dtype=fp64", "Fix:"):
        assert expected in message, expected
    assert info.value.decision is not None and info.value.decision.chosen is None


def test_pinned_impl_never_falls_back(manager):
    q, k, v = qkv()
    with pytest.raises(opdispatch.PinnedImplementationError) as info:
        opdispatch.attention(q, k, v, dropout_p=0.2, impl="cpu.flash")
    message = str(info.value)
    assert "'cpu.flash' pinned by impl=" in message and "dropout_p=0.2 not supported" in message
    assert "never falls back" in message


def test_pin_of_unknown_impl_lists_registered_ones(basic_manager):
    q, k, v = qkv()
    with pytest.raises(opdispatch.PinnedImplementationError, match=r"'nope.impl' pinned by impl= is not registered; "
                                                                    r"registered implementations: cpu.flash, reference.math"):
        opdispatch.attention(q, k, v, impl="nope.impl")


def test_env_pin(monkeypatch):
    monkeypatch.setenv("OPDISPATCH_IMPL_ATTENTION", "reference.math")
    fresh = opdispatch.OpManager()
    opdispatch.set_manager(fresh)
    try:
        q, k, v = qkv()
        decision = fresh.resolve("attention", opdispatch.validate_attention(q, k, v))
        assert decision.chosen_id == "reference.math"
        assert decision.decided_by.source == "OPDISPATCH_IMPL_ATTENTION"
        assert decision.candidate("cpu.flash").status == DENIED
        # impl= outranks the env var.
        assert opdispatch.explain(q, k, v, impl="cpu.flash").chosen_id == "cpu.flash"
    finally:
        opdispatch.set_manager(None)


def test_decisions_are_cached_per_signature(manager):
    seen = []
    impl = make_impl("spy", "impl", priority=1)
    original = type(impl).not_supported_reasons

    def counting(self, call, device):
        seen.append(call.signature())
        return original(self, call, device)

    type(impl).not_supported_reasons = counting
    manager.register_impl(impl)
    q, k, v = qkv()
    for _ in range(5):
        opdispatch.attention(q, k, v)
    assert len(seen) == 1
    opdispatch.attention(q, k, v, causal=True)
    opdispatch.attention(torch.randn(1, 6, 2, 8), k, v)
    assert len(seen) == 3
    manager.set_policy(_policy(manager, "order: [reference.math]"))
    opdispatch.attention(q, k, v)
    assert len(seen) == 4  # a new policy drops every cached decision


def test_fallback_on_error_setting(manager):
    def boom(call):
        raise RuntimeError("kernel launch failed")

    manager.register_impl(make_impl("flaky", "impl", run=boom))
    from opdispatch.policies import parse_policy

    q, k, v = qkv()
    manager.set_policy(parse_policy("settings: {fallback_on_error: false}\n"
                                    "ops: {attention: {order: [flaky.impl, reference.math]}}", "<p>"))
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        opdispatch.attention(q, k, v)
    manager.set_policy(parse_policy("ops: {attention: {order: [flaky.impl, reference.math]}}", "<p>"))  # on
    out = opdispatch.attention(q, k, v)
    torch.testing.assert_close(out, opdispatch.attention(q, k, v, impl="reference.math"))
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        opdispatch.attention(q, k, v, impl="flaky.impl")  # a pin never falls back


def test_decision_is_logged_once_at_info(manager, caplog):
    q, k, v = qkv()
    with caplog.at_level(logging.DEBUG, logger="opdispatch"):
        opdispatch.attention(q, k, v)
        opdispatch.attention(q, k, v)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "chose cpu.flash" in infos[0].getMessage()
    assert any(r.levelno == logging.DEBUG and "reference.math" in r.getMessage() for r in caplog.records)


def test_log_level_env(monkeypatch):
    monkeypatch.setenv("OPDISPATCH_LOG_LEVEL", "verbose")
    with pytest.raises(ValueError, match="OPDISPATCH_LOG_LEVEL='verbose' is not a logging level"):
        opdispatch.OpManager().ensure_initialized()


def test_autograd_through_the_op(manager):
    q, k, v = (t.requires_grad_() for t in qkv())
    out = opdispatch.attention(q, k, v, causal=True)
    out.square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_manager_works_in_a_forked_child(manager):
    q, k, v = qkv()
    opdispatch.attention(q, k, v)  # initialise and cache in the parent
    lock_held = threading.Event()
    release = threading.Event()

    def hold_lock():  # a parent thread holds the manager lock at fork time
        with manager._lock:
            lock_held.set()
            release.wait(5)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    lock_held.wait(5)
    parent_state = manager.state
    pid = os.fork()
    if pid == 0:  # child: deciding must not deadlock on the inherited lock (kernels are not run: OpenMP
        try:      # thread pools do not survive fork, which is torch's matter, not the dispatcher's)
            state = manager.state  # the whole state is new and empty, for the same policy
            if (state is parent_state or state.decisions or state.fast or manager.fast is not state.fast
                    or state.policy is not parent_state.policy):
                os._exit(5)
            cached = manager.resolve("attention", opdispatch.validate_attention(q, k, v)).chosen_id
            fresh = manager.resolve("attention", opdispatch.validate_attention(q, k, v, causal=True)).chosen_id
            os._exit(0 if cached == fresh == "cpu.flash" else 3)
        except BaseException:
            os._exit(4)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_simulated_device_never_imports_vendor_library(manager, monkeypatch):
    from opdispatch import Requirement

    impl = make_impl("ghost", "impl", requires=(Requirement("ghost_lib_xyz", "ghost-lib", "1.2"),),
                     availability="extra_availability must not run for simulated devices")
    manager.register_impl(impl)
    sim = opdispatch.DeviceInfo(vendor="cpu", type="cpu", arch="x86_64", name="sim", simulated=True,
                                source="test.yaml", libraries={"ghost_lib_xyz": "1.1"})
    q, k, v = qkv()
    reason = manager.explain("attention", opdispatch.validate_attention(q, k, v), device=sim).candidate(
        "ghost.impl").reasons[0]
    assert "'ghost_lib_xyz' 1.1 is older than the required 1.2" in reason
    sim2 = opdispatch.DeviceInfo(vendor="cpu", type="cpu", arch="x86_64", name="sim", simulated=True,
                                 source="test.yaml", libraries={"ghost_lib_xyz": "1.3"})
    cand = manager.explain("attention", opdispatch.validate_attention(q, k, v), device=sim2).candidate("ghost.impl")
    assert cand.status in (ELIGIBLE, CHOSEN)
    real_reason = manager.availability(impl, manager.device_info(torch.device("cpu")))
    assert "library 'ghost_lib_xyz' is not installed; install it with: pip install 'ghost-lib>=1.2'" == real_reason


def test_an_importable_module_without_its_distribution_is_not_the_vendor_library(tmp_path, monkeypatch):
    """A shim named like the vendor's module (e.g. one that routes back into opdispatch) must not make the vendor's
    implementation available: availability checks the installed distribution, not just the import name."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("def flash_attn_func(*a, **k):\n    raise AssertionError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    req = opdispatch.Requirement("flash_attn", "flash-attn", "2.6.0", verify_distribution=True)
    local = opdispatch.get_manager().device_info(torch.device("cpu"))
    reason = req.unmet_reason(local)
    assert reason is not None and "is importable (from " in reason and "not the vendor library" in reason
    assert str(tmp_path) in reason
    # A module that is its distribution's passes (pluggy is installed with metadata); a vendor SDK module that may
    # come without pip metadata is taken as it is unless the requirement asks for the distribution.
    assert opdispatch.Requirement("pluggy", "pluggy", "1.0", verify_distribution=True).unmet_reason(local) is None
    assert opdispatch.Requirement("flash_attn", "flash-attn", "2.6.0").unmet_reason(local) is None
    from opdispatch.vendors.nvidia._attention import FLASH_ATTN

    assert "not the vendor library" in FLASH_ATTN.unmet_reason(local)


def test_a_dotted_vendor_module_whose_package_is_missing_is_a_reason_not_a_crash():
    """FA4 is `flash_attn.cute`: without flash_attn installed, finding it raises ModuleNotFoundError (its parent
    is imported to look); that is the library missing, named with its install hint — `opdispatch list` and every
    explain once crashed on it."""
    local = opdispatch.get_manager().device_info(torch.device("cpu"))
    req = opdispatch.Requirement("ghost_pkg_xyz.cute", "ghost-pkg", "4.0")
    assert req.unmet_reason(local) == ("library 'ghost_pkg_xyz.cute' is not installed; install it with: "
                                       "pip install 'ghost-pkg>=4.0'")
