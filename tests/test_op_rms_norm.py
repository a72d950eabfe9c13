"""The op layer with a second op: `rms_norm` end to end — validation, numerics against a float64 oracle,
autograd, the FlagGems adapter against a fake, selection on simulated devices, its own policy section, `when:`
keys per op and the env pin per op."""

from __future__ import annotations

import textwrap

import pytest
import torch

import opdispatch
from opdispatch import PolicyError, RegistrationError, RmsNormCaps, RmsNormImpl, validate_rms_norm

from tests.conftest import TOLERANCES, device_descriptor
from tests.fakes import flag_gems as fake_flag_gems


def oracle(x, weight, eps, residual=None):
    """float64 RMSNorm written out (independent of every implementation): (y, h) or y."""
    h = x.double() if residual is None else x.double() + residual.double()
    y = h / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    if weight is not None:
        y = y * weight.double()
    return y if residual is None else (y, h)


def _inputs(shape, dtype, gen, strided=False, grad=False):
    hidden = shape[-1]
    x = torch.randn(*shape[:-1], 2 * hidden if strided else hidden, generator=gen).to(dtype)
    if strided:
        x = x[..., ::2]  # hidden dim not unit-stride
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    r = torch.randn(*shape, generator=gen).to(dtype)
    return x.requires_grad_(grad), w.requires_grad_(grad), r.requires_grad_(grad)


@pytest.mark.parametrize("impl", ["reference.rms_norm", "torch.rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,strided", [((3, 5, 64), False), ((7, 33), True), ((1, 1, 1), False)])
@pytest.mark.parametrize("with_weight,with_residual", [(True, False), (False, False), (True, True)])
def test_rms_norm_matches_float64_oracle(basic_manager, impl, dtype, shape, strided, with_weight, with_residual):
    gen = torch.Generator().manual_seed(hash((impl, str(dtype), shape)) % 2**31)
    x, w, r = _inputs(shape, dtype, gen, strided)
    weight = w if with_weight else None
    residual = r if with_residual else None
    before = (x.clone(), r.clone())
    got = opdispatch.rms_norm(x, weight, 1e-5, residual, impl=impl)
    want = oracle(x, weight, 1e-5, residual)
    tol = TOLERANCES[dtype]
    if with_residual:
        torch.testing.assert_close(got[0].double(), want[0], **tol)
        torch.testing.assert_close(got[1].double(), want[1], **tol)
        assert got[0].dtype == got[1].dtype == dtype
    else:
        torch.testing.assert_close(got.double(), want, **tol)
        assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])  # inputs untouched


@pytest.mark.parametrize("impl", ["reference.rms_norm", "torch.rms_norm"])
def test_rms_norm_gradients_match_float64_oracle(basic_manager, impl):
    gen = torch.Generator().manual_seed(3)
    x, w, r = _inputs((4, 6, 24), torch.float64, gen, strided=True, grad=True)
    y, h = opdispatch.rms_norm(x, w, 1e-6, r, impl=impl)
    gy, gh = torch.randn(y.shape, generator=gen, dtype=torch.float64), torch.randn(h.shape, generator=gen,
                                                                                  dtype=torch.float64)
    got = torch.autograd.grad((y, h), (x, w, r), (gy, gh))
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, r)]
    wy, wh = oracle(leaves[0], leaves[1], 1e-6, leaves[2])
    want = torch.autograd.grad((wy, wh), leaves, (gy, gh))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **TOLERANCES[torch.float64])


def test_flagos_adapter_against_a_fake_flag_gems(basic_manager, monkeypatch):
    from opdispatch.vendors.flagos import FlagGemsRmsNorm

    fake_flag_gems.install(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    x, w, r = _inputs((5, 48), torch.float32, gen)
    impl = FlagGemsRmsNorm()
    before = (x.clone(), r.clone())
    y, h = impl.run(validate_rms_norm(x, w, 1e-5, r))
    assert fake_flag_gems.calls[-1] == ("rms_norm", {"eps": 1e-5})  # of x + residual
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])
    want_y, want_h = oracle(x, w, 1e-5, r)
    torch.testing.assert_close(y.double(), want_y, **TOLERANCES[torch.float32])
    torch.testing.assert_close(h.double(), want_h, **TOLERANCES[torch.float32])
    y = impl.run(validate_rms_norm(x, w, 1e-5))
    assert fake_flag_gems.calls[-1] == ("rms_norm", {"eps": 1e-5})
    torch.testing.assert_close(y.double(), oracle(x, w, 1e-5), **TOLERANCES[torch.float32])


def _meta(*shape, grad=False):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=grad)


def test_selection_and_reasons_on_simulated_devices(manager):
    h100 = str(device_descriptor("h100"))
    x, w, r = _meta(8, 4096), _meta(4096), _meta(8, 4096)
    d = opdispatch.explain_rms_norm(x, w, residual=r, device=h100)
    assert d.chosen_id == "torch.rms_norm"
    flagos = next(c for c in d.candidates if c.impl_id == "flagos.rms_norm")
    assert flagos.status == "eligible"
    # no weight: FlagGems' kernel needs one
    d = opdispatch.explain_rms_norm(x, None, device=h100, impl=None)
    flagos = next(c for c in d.candidates if c.impl_id == "flagos.rms_norm")
    assert "without weight not supported" in " ".join(flagos.reasons)
    # training with the residual add: the add, then FlagGems' kernel with its backward
    d = opdispatch.explain_rms_norm(_meta(8, 4096, grad=True), w, residual=r, device=h100)
    assert next(c for c in d.candidates if c.impl_id == "flagos.rms_norm").status == "eligible"
    # large inputs: FlagGems by the measured default-policy rule (tokens = rows of x)
    d = opdispatch.explain_rms_norm(_meta(4, 8192, 4096), w, device=h100)
    assert d.chosen_id == "flagos.rms_norm" and "flagos-for-large-rms-norm" in str(d)
    assert opdispatch.explain_rms_norm(_meta(8191, 4096), w, device=h100).chosen_id == "torch.rms_norm"
    # on other devices FlagGems is not available; torch's kernel runs everywhere, except where the vendor's own
    # kernel is installed (AMD aiter, Iluvatar ixformer, KunLunXin kunlun_ops: tests/test_rms_norm_vendors.py)
    for device, chosen in (("mi300x", "rocm.aiter_rms_norm"), ("bi-v150", "iluvatar.ixformer_rms_norm"),
                           ("p800", "kunlunxin.rms_norm"), ("cpu", "torch.rms_norm")):
        assert opdispatch.explain_rms_norm(x, w, device=str(device_descriptor(device))).chosen_id == chosen


def test_rms_norm_policy_section_with_its_own_when_keys(manager, tmp_path, monkeypatch):
    policy = tmp_path / "policy.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        ops:
          rms_norm:
            rules:
              - name: wide-on-flagos
                when: {vendor: nvidia, hidden_size: '>=8192', residual: false}
                prefer: [flagos.rms_norm]
                reason: test rule
    """))
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    opdispatch.get_manager().reload()
    h100 = str(device_descriptor("h100"))
    w = _meta(8192)
    d = opdispatch.explain_rms_norm(_meta(2, 8192), w, device=h100)
    assert d.chosen_id == "flagos.rms_norm" and "wide-on-flagos" in str(d) and "policy.yaml:5 rule" in str(d)
    assert opdispatch.explain_rms_norm(_meta(2, 8192), w, residual=_meta(2, 8192),
                                       device=h100).chosen_id == "torch.rms_norm"
    assert opdispatch.explain_rms_norm(_meta(2, 4096), _meta(4096), device=h100).chosen_id == "torch.rms_norm"


def test_a_when_key_of_another_op_is_an_error_with_its_line(tmp_path):
    from opdispatch.policies import read_policy_file

    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nops:\n  rms_norm:\n    rules:\n      - name: r\n        when:\n"
                      "          head_dim: 128\n        deny: [flagos.rms_norm]\n")
    with pytest.raises(PolicyError, match=r"policy.yaml:7: field ops.rms_norm.rules.0.when.head_dim: 'head_dim' is "
                                          r"not a feature of op 'rms_norm'; its call features: dtype, hidden_size"):
        read_policy_file(policy)
    policy.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: r\n        when:\n"
                      "          hidden_size: 128\n        deny: [cpu.flash]\n")
    with pytest.raises(PolicyError, match="'hidden_size' is not a feature of op 'attention'"):
        read_policy_file(policy)


def test_the_env_pin_of_one_op_leaves_the_others_alone(basic_manager, monkeypatch):
    monkeypatch.setenv("OPDISPATCH_IMPL_RMS_NORM", "reference.rms_norm")
    basic_manager.reload()
    x = torch.randn(2, 16)
    d = opdispatch.explain_rms_norm(x, torch.ones(16))
    assert d.chosen_id == "reference.rms_norm" and "OPDISPATCH_IMPL_RMS_NORM" in str(d)
    q = torch.randn(1, 4, 2, 8)
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"  # attention unaffected
    torch.testing.assert_close(opdispatch.attention(q, q, q), opdispatch.attention(q, q, q, impl="reference.math"))
    monkeypatch.setenv("OPDISPATCH_IMPL_LAYER_NORM", "x.y")
    with pytest.raises(PolicyError, match="unknown op 'layer_norm'; known ops: attention, rms_norm"):
        basic_manager.reload()


@pytest.mark.parametrize("args,message", [
    ((torch.ones(2, 4, dtype=torch.int32),), "dtype int32; allowed: fp16"),
    ((torch.ones(2, 4), torch.ones(5)), r"weight has shape \(5,\); it must be \(4,\)"),
    ((torch.ones(2, 4), None, 0.0), "eps=0.0; it must be a finite number > 0"),
    ((torch.ones(2, 4), None, 1e-6, torch.ones(2, 5)), r"residual is \(2, 5\) fp32 on cpu; it must match x"),
    ((torch.ones(2, 0),), "needs a non-empty last"),
])
def test_validation_errors_name_the_value_and_the_fix(basic_manager, args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        opdispatch.rms_norm(*args)


def test_registration_checks_the_op_and_its_base_class(basic_manager):
    class WrongBase(opdispatch.AttentionImpl):
        op = "rms_norm"
        vendor, name = "acme", "norm"
        caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

        def run(self, call):
            return call.x

    with pytest.raises(RegistrationError, match="must subclass opdispatch.RmsNormImpl"):
        basic_manager.register_impl(WrongBase())

    class UnknownOp(RmsNormImpl):
        op = "layer_norm"
        vendor, name = "acme", "ln"
        caps = RmsNormCaps(dtypes=frozenset({torch.float32}))

        def run(self, call):
            return call.x

    with pytest.raises(RegistrationError, match="op='layer_norm' is not a known op; known ops: attention, rms_norm"):
        basic_manager.register_impl(UnknownOp())


def test_repeated_calls_take_the_fast_path_and_a_policy_swap_resets_it(basic_manager, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    x, w, r = _inputs((6, 40), torch.float32, gen)
    for _ in range(3):
        y, h = opdispatch.rms_norm(x, w, 1e-5, r)
    assert basic_manager.decisions_made == 1 and len(basic_manager.fast) == 1
    want_y, want_h = oracle(x, w, 1e-5, r)
    torch.testing.assert_close(y.double(), want_y, **TOLERANCES[torch.float32])
    torch.testing.assert_close(h.double(), want_h, **TOLERANCES[torch.float32])
    # a new signature (no residual, another eps) decides once more; an env pin swapped in applies at once
    opdispatch.rms_norm(x, w, 1e-6)
    assert basic_manager.decisions_made == 2
    monkeypatch.setenv("OPDISPATCH_IMPL_RMS_NORM", "reference.rms_norm")
    basic_manager.reload()
    assert basic_manager.fast == {}
    opdispatch.rms_norm(x, w, 1e-6)
    fn = next(iter(basic_manager.fast.values()))
    assert fn.decision.chosen_id == "reference.rms_norm"


def test_every_rms_norm_capability_refuses_with_its_reason_in_order():
    """`RmsNormCaps` through the op's rule table (`opdispatch.base._impl.unmet_capabilities`): a call that uses every
    feature against caps that declare none gets each reason once, in the table's order; declared, none."""
    from opdispatch.ops._rms_norm import RMS_NORM_CAPABILITY_RULES, RmsNormCall, RmsNormCaps
    from opdispatch.base._impl import unmet_capabilities

    x = torch.randn(3, 40, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(3, 40, dtype=torch.bfloat16)
    bare = RmsNormCaps(dtypes=frozenset({torch.float16}), weight_dtype_of_x=True, max_hidden_size=32)
    without_weight = RmsNormCall(x, None, residual, 1e-6)
    assert unmet_capabilities(bare, without_weight, RMS_NORM_CAPABILITY_RULES) == [
        "dtype bf16 not supported (supported: fp16)",
        "a call without weight not supported (pass weight=torch.ones(hidden))",
        "the fused residual add not supported",
        "backward not supported (forward only)",
        "hidden size 40 above the supported maximum 32"]
    mixed_weight = RmsNormCall(x, torch.ones(40), None, 1e-6)
    assert unmet_capabilities(bare, mixed_weight, RMS_NORM_CAPABILITY_RULES)[1] == (
        "weight dtype fp32 differs from x's bf16 (the kernel takes one dtype; cast the weight, e.g. "
        "weight.to(x.dtype))")
    full = RmsNormCaps(dtypes=frozenset({torch.bfloat16}), weight_optional=True, residual=True, backward=True,
                       max_hidden_size=40)
    for call in (without_weight, mixed_weight):
        assert unmet_capabilities(full, call, RMS_NORM_CAPABILITY_RULES) == []
    with torch.no_grad():  # no autograd recorded: a forward-only implementation takes it
        assert "backward not supported (forward only)" not in unmet_capabilities(
            bare, RmsNormCall(x, None, None, 1e-6), RMS_NORM_CAPABILITY_RULES)
