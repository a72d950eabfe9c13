"""The dispatch state: a policy with its configured implementations and caches, built whole, swapped atomically,
never changed in place — a rejected policy leaves no trace, options never leak between policies, and a fork or
swap starts from empty caches."""

from __future__ import annotations

import textwrap

import pytest
import torch

import opdispatch
from opdispatch import PolicyError

from tests.conftest import device_descriptor


def _policy(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_a_rejected_policy_leaves_the_installed_state_whole(manager, tmp_path):
    good = _policy(tmp_path, "good.yaml", """\
        ops:
          attention:
            options:
              rocm.aiter: {how_v3_bf16_cvt: 1}
    """)
    manager.set_policy(good)
    state = manager.state
    # the bad policy changes aiter's option (valid) and gives rocm.ck an option it does not have (invalid)
    bad = _policy(tmp_path, "bad.yaml", """\
        ops:
          attention:
            options:
              rocm.aiter: {how_v3_bf16_cvt: 2}
              rocm.ck: {no_such_knob: true}
    """)
    with pytest.raises(PolicyError, match=r"(?s)bad.yaml:5: field ops.attention.options.rocm.ck: .*no_such_knob"):
        manager.set_policy(bad)
    assert manager.state is state and manager.policy.source.startswith(str(good))
    assert manager.implementation("attention", "rocm.aiter").options.how_v3_bf16_cvt == 1
    # the registered object never carried either policy's options
    assert manager.registry.get("attention", "rocm.aiter").impl.options.how_v3_bf16_cvt is None


def test_options_do_not_leak_between_managers_or_policies(tmp_path):
    a, b = opdispatch.OpManager(), opdispatch.OpManager()
    a.set_policy(_policy(tmp_path, "a.yaml", "ops:\n  attention:\n    options:\n      rocm.ck: "
                                            "{deterministic_backward: true}\n"))
    b.set_policy(_policy(tmp_path, "b.yaml", "ops: {attention: {}}\n"))
    assert a.implementation("attention", "rocm.ck").options.deterministic_backward is True
    assert b.implementation("attention", "rocm.ck").options.deterministic_backward is None  # its default


def test_availability_follows_an_options_change_without_clear_cache(manager, tmp_path):
    p800 = str(device_descriptor("p800"))
    q = torch.empty(1, 128, 8, 128, device="meta", dtype=torch.float16)

    def kunlun():
        return opdispatch.explain(q, q, q, device=p800).candidate("kunlunxin.prefill")

    assert kunlun().status in ("chosen", "eligible")  # the descriptor declares kunlun_ops
    manager.set_policy(_policy(tmp_path, "x.yaml", "ops:\n  attention:\n    options:\n      kunlunxin.prefill: "
                                                   "{ops_module: xtorch_ops}\n"))
    cand = kunlun()  # a new state: the availability answer is asked again, for the new option
    assert cand.status == "unavailable" and "'xtorch_ops' is not declared in the device descriptor" in cand.reasons[0]


def test_a_swap_starts_from_empty_caches_and_the_fast_path_follows(basic_manager, rng):
    q = torch.randn(1, 4, 2, 8, generator=rng)
    opdispatch.attention(q, q, q)
    old = basic_manager.state
    assert old.decisions and old.fast and basic_manager.fast is old.fast
    basic_manager.reload()
    new = basic_manager.state
    assert new is not old and not new.decisions and basic_manager.fast is new.fast == {}
    assert old.decisions and old.fast  # the old state was not cleared in place: a reader holding it stays valid
