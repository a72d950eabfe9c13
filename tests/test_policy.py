"""The policy engine: conditions, how matching rules combine, precedence of overrides, provenance, reload."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl
from opdispatch.policies import load_policy, parse_policy
from tests.conftest import device_descriptor

F32 = frozenset({torch.float32, torch.bfloat16, torch.float16})


def _impl(vendor: str, name: str) -> AttentionImpl:
    cls = type(f"T_{vendor}_{name}", (AttentionImpl,), dict(
        vendor=vendor, name=name, caps=AttentionCaps(dtypes=F32, gqa=True, window=True, softcap=True, lse=True, backward=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"})),
        run=lambda self, call: call.q * 1.0))
    return cls()


@pytest.fixture
def four(basic_manager):
    """basic_manager plus fast.a, fast.b, slow.c (all eligible for plain fp32 calls)."""
    for vendor, name in (("fast", "a"), ("fast", "b"), ("slow", "c")):
        basic_manager.register_impl(_impl(vendor, name))
    return basic_manager


def use(manager, text: str) -> None:
    manager.set_policy(parse_policy(text, "<test>"))


def q(s=16, h=4, d=32, dtype=torch.float32, grad=False):
    t = torch.randn(1, s, h, d, dtype=dtype)
    return t.requires_grad_(grad)


def chosen(**kw) -> opdispatch.Decision:
    x = kw.pop("x", None)
    if x is None:
        x = q()
    return opdispatch.explain(x, x, x, **kw)


# -- conditions -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("when,call_kw,matches", [
    ("dtype: bf16", {}, False),
    ("dtype: [fp32, bf16]", {}, True),
    ("head_dim: '>=64'", {}, False),
    ("head_dim: '>=16,<=32'", {}, True),
    ("head_dim: [32, 64]", {}, True),
    ("seqlen_q: '>=1024'", {}, False),
    ("seqlen_k: 16", {}, True),
    ("batch: 1", {}, True),
    ("heads_q: '>4'", {}, False),
    ("gqa_ratio: 1", {}, True),
    ("layout: [bshd, sbhd]", {}, True),
    ("causal: true", {"causal": True}, True),
    ("causal: true", {}, False),
    ("window: true", {"window": (4, 0), "causal": True}, True),
    ("softcap: true", {"softcap": 20.0}, True),
    ("dropout: false", {}, True),
    ("varlen: true", {}, False),
    ("return_lse: true", {"return_lse": True}, True),
    ("deterministic: true", {}, False),
    ("vendor: cpu", {}, True),
    ("vendor: [nvidia, amd]", {}, False),
    ("device_type: cpu", {}, True),
    ("arch: '>=sm80'", {}, False),
    ("capability: '>=8.0'", {}, False),
    ("libraries: {torch: '>=2.0'}", {}, True),
    ("libraries: {torch: '<2.0'}", {}, False),
    ("libraries: {surely_not_installed_lib: missing}", {}, True),
    ("libraries: {surely_not_installed_lib: installed}", {}, False),
    ("module: 'model.*'", {}, False),
])
def test_each_condition(four, when, call_kw, matches):
    use(four, f"ops:\n  attention:\n    order: [fast.a, slow.c]\n    rules:\n      - name: r\n        when: {{{when}}}\n"
              f"        prefer: [slow.c]\n")
    assert (chosen(**call_kw).chosen_id == "slow.c") is matches


def test_requires_grad_condition(four):
    use(four, "ops:\n  attention:\n    order: [fast.a, slow.c]\n    rules:\n      - name: training\n"
              "        when: {requires_grad: true}\n        deny: ['fast.*']\n")
    assert chosen().chosen_id == "fast.a"
    x = q(grad=True)
    d = opdispatch.explain(x, x, x)
    assert d.chosen_id == "slow.c"
    assert d.candidate("fast.a").status == "denied by policy"
    assert "rule 'training'" in d.candidate("fast.a").reasons[0]


def test_device_conditions_on_simulated_descriptors(four):
    use(four, "ops:\n  attention:\n    order: [fast.a, slow.c]\n    rules:\n"
              "      - name: hopper\n        when: {vendor: nvidia, arch: '>=sm90', capability: '>=9.0'}\n"
              "        prefer: [slow.c]\n")
    x = torch.empty(1, 16, 4, 32, device="meta")
    sim_cpu = opdispatch.DeviceInfo(vendor="cpu", type="cpu", arch="x86_64", name="c", simulated=True, source="s")
    hopper = opdispatch.DeviceInfo(vendor="nvidia", type="cpu", arch="sm90", name="H100", capability=(9, 0),
                                   simulated=True, source="s")
    ampere = opdispatch.DeviceInfo(vendor="nvidia", type="cpu", arch="sm80", name="A100", capability=(8, 0),
                                   simulated=True, source="s")
    assert opdispatch.explain(x, x, x, device=sim_cpu).chosen_id == "fast.a"
    assert opdispatch.explain(x, x, x, device=hopper).chosen_id == "slow.c"
    assert opdispatch.explain(x, x, x, device=ampere).chosen_id == "fast.a"


def test_arch_ranges_order_within_a_family():
    from opdispatch.policies._match import ArchSpec

    spec = ArchSpec.parse(">=gfx90a,<gfx950")
    assert spec.matches("gfx942") and spec.matches("gfx90a") and not spec.matches("gfx950")
    assert not spec.matches("sm90") and not spec.matches("x86_64")
    assert ArchSpec.parse(["sm80", ">=sm100"]).matches("sm120")
    assert ArchSpec.parse("ivcore11").matches("ivcore11")


# -- combining rules --------------------------------------------------------------------------------------

COMBINE = """
ops:
  attention:
    order: [slow.c, fast.b, fast.a, cpu.flash, reference.math]
    rules:
      - name: first-prefer
        when: {dtype: fp32}
        prefer: [fast.a]
      - name: second-prefer
        when: {dtype: fp32}
        prefer: [fast.b, fast.a]
      - name: deny-c
        deny: [slow.c]
      - name: only-fast-or-reference
        when: {causal: true}
        require: ['fast.*', reference.math]
      - name: only-fast-b
        when: {causal: true, head_dim: 32}
        require: [fast.b, reference.math]
"""


def test_prefers_stack_in_rule_order_and_denies_accumulate(four):
    use(four, COMBINE)
    d = chosen()
    ids = [c.impl_id for c in d.candidates if c.status in ("chosen", "eligible")]
    assert ids[:2] == ["fast.a", "fast.b"]  # the first matching rule's prefer outranks the second's
    assert d.decided_by.rule == "first-prefer"
    assert d.candidate("slow.c").status == "denied by policy"


def test_requires_intersect(four):
    use(four, COMBINE)
    d = chosen(causal=True)
    assert d.chosen_id == "fast.b"
    assert d.candidate("fast.a").status == "denied by policy"
    assert "not in required fast.b, reference.math" in d.candidate("fast.a").reasons[0]
    assert d.candidate("cpu.flash").status == "denied by policy"


def test_first_matching_pin_wins_and_outranks_deny(four):
    use(four, """
ops:
  attention:
    deny: [fast.a]
    rules:
      - name: pin-a
        when: {head_dim: 32}
        pin: fast.a
      - name: pin-b
        pin: fast.b
""")
    d = chosen()
    assert d.chosen_id == "fast.a" and d.decided_by.rule == "pin-a"
    assert chosen(x=q(d=64)).chosen_id == "fast.b"


def test_pinned_rule_that_cannot_take_the_call_raises(four):
    use(four, "ops:\n  attention:\n    rules:\n      - name: cpu-only\n        pin: cpu.flash\n")
    x = q()
    with pytest.raises(opdispatch.PinnedImplementationError, match=r"'cpu.flash' pinned by <test>:\d+ rule 'cpu-only'"
                                                                    r".*dropout_p=0.1 not supported"):
        opdispatch.attention(x, x, x, dropout_p=0.1)


def test_require_with_nothing_fitting_raises_with_every_reason(four):
    use(four, "ops:\n  attention:\n    rules:\n      - name: cpu-only\n        require: [cpu.flash]\n")
    x = q()
    with pytest.raises(opdispatch.NoImplementationError) as info:
        opdispatch.attention(x, x, x, dropout_p=0.1)
    text = str(info.value)
    assert "cpu.flash" in text and "dropout_p=0.1 not supported" in text and "not in required cpu.flash" in text


# -- layering and precedence ------------------------------------------------------------------------------

def test_user_file_layers_over_default_unless_extends_none(four, tmp_path):
    user = tmp_path / "user.yaml"
    user.write_text("ops:\n  attention:\n    rules:\n      - name: mine\n        prefer: [slow.c]\n")
    policy = load_policy(user, environ={})
    assert [layer.source for layer in policy.layers][0] == str(user)
    assert [layer.source.rsplit("/", 1)[-1] for layer in policy.layers[1:]] == ["default.yaml", "quarantine.yaml"]
    four.set_policy(policy)
    d = chosen()
    assert d.chosen_id == "slow.c" and d.decided_by.source == f"{user}:4"
    # the default's order still ranks the rest
    assert [c.impl_id for c in d.candidates][1] == "cpu.flash"
    user.write_text("extends: none\nops:\n  attention:\n    order: [fast.b]\n")
    policy = load_policy(user, environ={})
    assert [layer.source for layer in policy.layers if not layer.quarantine] == [str(user)]  # quarantine stays


def test_precedence_argument_context_env_user_default(four, tmp_path, monkeypatch):
    user = tmp_path / "user.yaml"
    user.write_text("ops:\n  attention:\n    rules:\n      - name: user-pin\n        pin: slow.c\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(user))
    four.reload()
    assert chosen().decided_by.rule == "user-pin"  # user YAML over shipped default
    monkeypatch.setenv("OPDISPATCH_IMPL_ATTENTION", "fast.b")
    four.reload()
    d = chosen()
    assert d.chosen_id == "fast.b" and d.decided_by.source == "OPDISPATCH_IMPL_ATTENTION"  # env over YAML
    with opdispatch.policy_override(pin="fast.a"):
        d = chosen()
        assert d.chosen_id == "fast.a" and d.decided_by.kind == "context"  # context over env
        assert "test_policy.py" in d.decided_by.source
        assert chosen(impl="reference.math").chosen_id == "reference.math"  # argument over everything
    assert chosen().chosen_id == "fast.b"


def test_plan_collects_each_layers_actions_highest_first(four, tmp_path, monkeypatch):
    from opdispatch.policies import Override
    from opdispatch.policies._plan import LAYERS

    user = tmp_path / "user.yaml"
    user.write_text("ops:\n  attention:\n    rules:\n      - name: mine\n        prefer: [slow.c]\n"
                    "        require: ['*.*']\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(user))
    monkeypatch.setenv("OPDISPATCH_DENY", "fast.a")
    four.reload()
    policy, device = four.policy, four.device_info("cpu")
    x = q()
    call = opdispatch.validate_attention(x, x, x)
    ids = [impl.id for impl in four.implementations("attention")]
    scope = Override(op=None, prefer=("fast.b",), where="scope at test")
    plan = policy.plan("attention", ids, call, device, [scope])
    layer_names = [layer.name for layer in LAYERS]
    assert [(a.layer, a.verb) for a in plan.actions] == [
        ("scope", "prefer"), ("env", "deny"), ("user", "prefer"), ("user", "require")]
    assert [a.layer for a in plan.actions] == sorted((a.layer for a in plan.actions), key=layer_names.index)
    order = [(impl_id, prov.kind, prov.source) for impl_id, prov in plan.order]
    assert order[:2] == [("fast.b", "context", "scope at test"), ("slow.c", "policy", f"{user}:4")]
    assert [impl_id for impl_id, _, _ in order[2:]] == ["cpu.flash", "reference.math"]
    assert all(kind == "policy" and "default.yaml:" in source for _, kind, source in order[2:])  # its order
    assert plan.denied["fast.a"].source == "OPDISPATCH_DENY" and plan.pin is None
    assert plan.matched_rules == ["mine"]
    # the call's impl= is the argument layer: a pin above every other layer, through the same plan
    pinned = policy.plan("attention", ids, call, device, [scope], impl="reference.math")
    assert pinned.pin is not None and pinned.pin[0] == "reference.math"
    assert (pinned.pin[1].kind, pinned.pin[1].source) == ("argument", "impl=")
    assert pinned.actions[0].layer == "argument" and pinned.order == []


def test_env_prefer_and_deny(four, monkeypatch):
    monkeypatch.setenv("OPDISPATCH_PREFER", "slow.c")
    monkeypatch.setenv("OPDISPATCH_DENY", "cpu.flash")
    four.reload()
    d = chosen()
    assert d.chosen_id == "slow.c" and d.decided_by.source == "OPDISPATCH_PREFER"
    assert d.candidate("cpu.flash").decided_by.source == "OPDISPATCH_DENY"


def test_context_override_is_per_thread_and_per_task(four):
    results = {}
    barrier = threading.Barrier(2)

    def worker(name, pin):
        with opdispatch.policy_override(pin=pin):
            barrier.wait()
            results[name] = chosen().chosen_id
            barrier.wait()

    threads = [threading.Thread(target=worker, args=("t1", "fast.a")),
               threading.Thread(target=worker, args=("t2", "slow.c"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"t1": "fast.a", "t2": "slow.c"}

    async def task(pin):
        with opdispatch.policy_override(pin=pin):
            await asyncio.sleep(0.01)
            return chosen().chosen_id

    async def main():
        return await asyncio.gather(task("fast.b"), task("reference.math"))

    assert asyncio.run(main()) == ["fast.b", "reference.math"]
    assert chosen().chosen_id == "cpu.flash"


def test_nested_overrides_innermost_first(four):
    with opdispatch.policy_override(prefer=["slow.c"], deny=["fast.a"]):
        with opdispatch.policy_override(prefer=["fast.b"]):
            d = chosen()
            assert d.chosen_id == "fast.b"
            assert d.candidate("fast.a").status == "denied by policy"
        assert chosen().chosen_id == "slow.c"


def test_module_scope_targets_layers(four):
    use(four, "ops:\n  attention:\n    rules:\n      - name: first-layers\n        when: {module: 'model.layers.[01].*'}\n"
              "        pin: reference.math\n")
    with opdispatch.scope("model.layers.0.self_attn"):
        assert chosen().chosen_id == "reference.math"
    with opdispatch.scope("model.layers.7.self_attn"):
        assert chosen().chosen_id == "cpu.flash"
    x = q()
    with opdispatch.scope("model.layers.1.self_attn"):  # the real call path, not only explain
        out = opdispatch.attention(x, x, x)
    torch.testing.assert_close(out, opdispatch.attention(x, x, x, impl="reference.math"))


# -- cache and reload -------------------------------------------------------------------------------------

def test_no_stale_decision_survives_reload_or_override(four, tmp_path, monkeypatch):
    user = tmp_path / "p.yaml"
    user.write_text("ops:\n  attention:\n    order: [fast.a]\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(user))
    four.reload()
    x = q()
    call = opdispatch.validate_attention(x, x, x)
    first = four.resolve("attention", call)
    assert first.chosen_id == "fast.a"
    user.write_text("ops:\n  attention:\n    order: [fast.b]\n")
    assert four.resolve("attention", call).chosen_id == "fast.a"  # cached until reload
    four.reload()
    second = four.resolve("attention", call)
    assert second.chosen_id == "fast.b" and second.policy_hash != first.policy_hash
    with opdispatch.policy_override(pin="slow.c"):
        assert four.resolve("attention", call).chosen_id == "slow.c"
    assert four.resolve("attention", call).chosen_id == "fast.b"


def test_public_reload_swaps_the_global_policy(manager, tmp_path, monkeypatch):
    user = tmp_path / "p.yaml"
    user.write_text("ops:\n  attention:\n    order: [reference.math]\n")
    x = q()
    assert opdispatch.explain(x, x, x).chosen_id == "cpu.flash"
    monkeypatch.setenv("OPDISPATCH_POLICY", str(user))
    opdispatch.policies.reload()
    assert opdispatch.explain(x, x, x).chosen_id == "reference.math"


def test_reload_is_atomic_under_concurrent_calls(four, tmp_path, monkeypatch):
    user = tmp_path / "p.yaml"
    monkeypatch.setenv("OPDISPATCH_POLICY", str(user))
    x = q()
    errors = []
    stop = threading.Event()

    def caller():
        while not stop.is_set():
            try:
                d = four.resolve("attention", opdispatch.validate_attention(x, x, x))
                assert d.chosen_id in ("fast.a", "fast.b")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

    user.write_text("ops:\n  attention:\n    order: [fast.a]\n")
    four.reload()
    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(30):
        user.write_text(f"ops:\n  attention:\n    order: [{'fast.a' if i % 2 else 'fast.b'}]\n")
        four.reload()
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert four.resolve("attention", opdispatch.validate_attention(x, x, x)).chosen_id == "fast.a"  # last write


def test_options_reach_the_implementation(manager, tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text("ops:\n  attention:\n    options:\n      rocm.aotriton: {fa_library: ck}\n")
    manager.set_policy(path)
    assert manager.implementation("attention", "rocm.aotriton").options.fa_library == "ck"
    # the registered object is not changed: the policy's options live in its own configured copy
    assert manager.registry.get("attention", "rocm.aotriton").impl.options.fa_library == "aotriton"
    manager.set_policy(parse_policy("ops: {attention: {}}", "<none>"))
    # the default again once the policy stops setting it
    assert manager.implementation("attention", "rocm.aotriton").options.fa_library == "aotriton"


def test_explain_table_shows_rule_file_and_line(four, tmp_path):
    path = tmp_path / "explain.yaml"
    path.write_text("ops:\n  attention:\n    rules:\n      - name: prefer-slow\n        when: {dtype: fp32}\n"
                    "        prefer: [slow.c]\n        reason: measured faster on this box\n")
    four.set_policy(path)
    text = str(chosen())
    assert f"{path}:4 rule 'prefer-slow' (prefer 'slow.c'; measured faster on this box)" in text


def test_simulated_descriptor_from_file(four):
    x = torch.empty(1, 16, 4, 32, device="meta")
    d = opdispatch.explain(x, x, x, device=device_descriptor("cpu"))
    assert d.device.simulated and d.chosen_id == "cpu.flash"


def test_an_id_listed_exactly_is_placed_where_listed_not_by_an_earlier_glob(four):
    from opdispatch.policies._plan import match_any

    assert match_any("reference.math", ["*", "reference.math"]) == "reference.math"
    assert match_any("fast.a", ["*", "reference.math"]) == "*"
    assert match_any("fast.a", ["nope.*", "fast.*", "*"]) == "fast.*"
    use(four, "ops:\n  attention:\n    order: ['*', reference.math]\n")
    x = q()
    ids = [c.impl_id for c in opdispatch.explain(x, x, x).candidates]
    assert ids[-1] == "reference.math" and len(ids) > 2


@pytest.mark.parametrize("sq, sk, kwargs, blind", [
    (24, 9, dict(causal=True, causal_alignment="bottom_right"), True),  # the first 15 rows see no key
    (9, 24, dict(causal=True, causal_alignment="bottom_right"), False),
    (24, 9, dict(causal=True), False),  # top-left: row i sees keys 0..i
    (30, 9, dict(window=(2, 0)), True),  # rows 11.. are past every key's window
    (9, 9, dict(window=(2, 0)), False),
    (24, 9, {}, False),
])
def test_when_keyless_rows_matches_calls_whose_pattern_leaves_a_row_without_keys(basic_manager, sq, sk, kwargs,
                                                                                 blind):
    basic_manager.set_policy(parse_policy(
        "ops: {attention: {rules: [{name: blind, when: {keyless_rows: true}, deny: [cpu.flash]}]}}", "<p>"))
    q, k = torch.randn(1, sq, 2, 8), torch.randn(1, sk, 2, 8)
    call = opdispatch.validate_attention(q, k, k, **kwargs)
    assert call.keyless_rows is blind
    # The decision follows the key, not a cached decision of the same class with other lengths.
    assert opdispatch.explain(q, k, k, **kwargs).chosen_id == ("reference.math" if blind else "cpu.flash")
