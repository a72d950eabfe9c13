"""The `rotary_embedding` op: numerics of every implementation against a float64 complex-rotation oracle (dense and
packed, NeoX and GPT-J pairs, partial rotary, GQA, offsets and explicit positions, strided inputs), autograd,
validation errors, the FlagGems and flash-attn adapters against fakes, selection on simulated devices, and its
policy section."""

from __future__ import annotations

import textwrap

import pytest
import torch

import opdispatch
from opdispatch import PolicyError, validate_rotary_embedding

from tests.conftest import TOLERANCES, device_descriptor
from tests.fakes import flag_gems as fake_flag_gems
from tests.fakes import flash_attn_rotary as fake_rotary


def _freqs(rotary_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


def caches(max_positions: int, rotary_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    theta = torch.arange(max_positions, dtype=torch.float64)[:, None] * _freqs(rotary_dim)[None]
    return theta.cos().to(dtype), theta.sin().to(dtype)


def oracle(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """float64: each pair as a complex number times exp(i * position * freq), angles computed exactly."""
    theta = positions.double()[..., None] * _freqs(rotary_dim)
    rot = torch.polar(torch.ones_like(theta), theta).unsqueeze(-2)
    xd = x.detach().double()
    head = xd[..., :rotary_dim]
    if interleaved:
        z = torch.complex(head[..., 0::2], head[..., 1::2]) * rot
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        z = torch.complex(head[..., :half], head[..., half:]) * rot
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, xd[..., rotary_dim:]), dim=-1)


def dense_positions(batch: int, seqlen: int, offsets=None) -> torch.Tensor:
    pos = torch.zeros(batch, seqlen, dtype=torch.long)
    for b in range(batch):
        shift = 0 if offsets is None else int(offsets[b]) if isinstance(offsets, torch.Tensor) else offsets
        for s in range(seqlen):
            pos[b, s] = s + shift
    return pos


def packed_positions(lengths: list[int], offsets=None) -> torch.Tensor:
    out = []
    for i, n in enumerate(lengths):
        shift = 0 if offsets is None else int(offsets[i]) if isinstance(offsets, torch.Tensor) else offsets
        out.extend(range(shift, shift + n))
    return torch.tensor(out)


def _qk(shape_q, shape_k, dtype, gen, strided=False, grad=False):
    if strided:  # q and k sliced out of one fused projection, as attention layers do
        heads_q, heads_k = shape_q[-2], shape_k[-2]
        fused = torch.randn(*shape_q[:-2], heads_q + 2 * heads_k, shape_q[-1], generator=gen).to(dtype)
        q, k = fused[..., :heads_q, :], fused[..., heads_q:heads_q + heads_k, :]
        assert not q.is_contiguous()
    else:
        q = torch.randn(*shape_q, generator=gen).to(dtype)
        k = torch.randn(*shape_k, generator=gen).to(dtype)
    if grad:
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    return q, k


CASES = [  # (layout, interleaved, rotary_dim, head_dim, position mode)
    ("bshd", False, 64, 64, "default"),
    ("bshd", True, 64, 64, "default"),
    ("bshd", False, 24, 40, "offset_int"),
    ("bshd", True, 16, 24, "offset_tensor"),
    ("bshd", False, 32, 32, "positions"),
    ("thd", False, 32, 48, "default"),
    ("thd", True, 32, 32, "offset_tensor"),
    ("thd", False, 16, 16, "positions"),
]


def _case(layout, rotary_dim, head_dim, mode, dtype, gen, strided=False, grad=False, max_positions=64):
    hq, hk = 6, 2
    kwargs: dict = {}
    if layout == "bshd":
        batch, seqlen = 3, 7
        q, k = _qk((batch, seqlen, hq, head_dim), (batch, seqlen, hk, head_dim), dtype, gen, strided, grad)
        offsets = {"offset_int": 5, "offset_tensor": torch.tensor([0, 9, 30])}.get(mode)
        pos = dense_positions(batch, seqlen, offsets)
    else:
        lengths = [5, 1, 9, 3]
        q, k = _qk((sum(lengths), hq, head_dim), (sum(lengths), hk, head_dim), dtype, gen, strided, grad)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        kwargs.update(layout="thd", cu_seqlens=cu, max_seqlen=max(lengths))
        offsets = {"offset_tensor": torch.tensor([3, 0, 40, 11])}.get(mode)
        pos = packed_positions(lengths, offsets)
    if offsets is not None:
        kwargs["seqlen_offsets"] = offsets
    if mode == "positions":
        pos = torch.randint(0, max_positions, pos.shape, generator=gen)
        kwargs["positions"] = pos.to(torch.int32)
    cos, sin = caches(max_positions, rotary_dim)
    return q, k, cos, sin, kwargs, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout,interleaved,rotary_dim,head_dim,mode", CASES)
def test_reference_matches_float64_oracle(basic_manager, dtype, layout, interleaved, rotary_dim, head_dim, mode):
    gen = torch.Generator().manual_seed(hash((layout, interleaved, rotary_dim, mode)) % 2**31)
    q, k, cos, sin, kwargs, pos = _case(layout, rotary_dim, head_dim, mode, dtype, gen, strided=mode == "default")
    before = (q.clone(), k.clone())
    q_out, k_out = opdispatch.rotary_embedding(q, k, cos, sin, interleaved=interleaved, **kwargs)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # inputs untouched
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    tol = TOLERANCES[torch.float32] if dtype == torch.float64 else TOLERANCES[dtype]  # fp32 caches bound fp64
    torch.testing.assert_close(q_out.double(), oracle(q, pos, rotary_dim, interleaved), **tol)
    torch.testing.assert_close(k_out.double(), oracle(k, pos, rotary_dim, interleaved), **tol)


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_gradients(basic_manager, interleaved):
    gen = torch.Generator().manual_seed(3)
    q, k, cos, sin, kwargs, pos = _case("bshd", 16, 24, "offset_tensor", torch.float64, gen, grad=True)
    cos, sin = caches(64, 16, torch.float64)
    assert torch.autograd.gradcheck(
        lambda q_, k_: opdispatch.rotary_embedding(q_, k_, cos, sin, interleaved=interleaved, **kwargs), (q, k))
    # a rotation's gradient is the inverse rotation: check against the oracle's transpose
    gq = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    q_out, _ = opdispatch.rotary_embedding(q, k, cos, sin, interleaved=interleaved, **kwargs)
    (got,) = torch.autograd.grad(q_out, q, gq)
    torch.testing.assert_close(got, oracle(gq, -pos, 16, interleaved), **TOLERANCES[torch.float64])


def test_reference_propagates_gradients_into_learned_caches(basic_manager):
    gen = torch.Generator().manual_seed(5)
    q, k = _qk((2, 3, 2, 8), (2, 3, 1, 8), torch.float64, gen)
    cos, sin = (c.requires_grad_() for c in caches(8, 8, torch.float64))
    assert torch.autograd.gradcheck(lambda c, s: opdispatch.rotary_embedding(q, k, c, s), (cos, sin))


@pytest.mark.parametrize("layout,interleaved,rotary_dim,head_dim,mode", [c for c in CASES if c[2] == c[3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flagos_adapter_against_a_fake_flag_gems(basic_manager, monkeypatch, layout, interleaved, rotary_dim,
                                                 head_dim, mode, dtype):
    from opdispatch.vendors.flagos import FlagGemsRotary

    fake_flag_gems.install(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    q, k, cos, sin, kwargs, pos = _case(layout, rotary_dim, head_dim, mode, dtype, gen, strided=True)
    q, k = q.requires_grad_(), k.requires_grad_()
    call = validate_rotary_embedding(q, k, cos, sin, interleaved=interleaved, **kwargs)
    assert call.requires_grad and FlagGemsRotary().not_supported_reasons(call, None) == []
    q_out, k_out = FlagGemsRotary().run(call)
    plain = layout == "bshd" and mode == "default"
    assert fake_flag_gems.calls[-1] == ("apply_rotary_pos_emb", {"position_ids": not plain,
                                                                 "rotary_interleaved": interleaved})
    torch.testing.assert_close(q_out.double(), oracle(q, pos, rotary_dim, interleaved), **TOLERANCES[dtype])
    torch.testing.assert_close(k_out.double(), oracle(k, pos, rotary_dim, interleaved), **TOLERANCES[dtype])
    # backward: the same kernel with -sin, i.e. the inverse rotation of the incoming gradient (k's left unused)
    gq = torch.randn(q.shape, generator=gen).to(dtype)
    got_q, got_k = torch.autograd.grad(q_out, (q, k), gq)
    assert fake_flag_gems.calls[-1][0] == "apply_rotary_pos_emb"
    torch.testing.assert_close(got_q.double(), oracle(gq, -pos, rotary_dim, interleaved), **TOLERANCES[dtype])
    assert torch.count_nonzero(got_k) == 0


@pytest.mark.parametrize("layout,interleaved,rotary_dim,head_dim,mode", [c for c in CASES if c[4] != "positions"])
def test_flash_rotary_adapter_against_a_fake_flash_attn(basic_manager, monkeypatch, layout, interleaved, rotary_dim,
                                                       head_dim, mode):
    from opdispatch.vendors.nvidia import FlashRotary

    fake_rotary.install(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    q, k, cos, sin, kwargs, pos = _case(layout, rotary_dim, head_dim, mode, torch.float32, gen, strided=True,
                                        grad=True)
    call = validate_rotary_embedding(q, k, cos, sin, interleaved=interleaved, **kwargs)
    assert FlashRotary().not_supported_reasons(call, None) == []
    q_out, k_out = FlashRotary().run(call)
    assert fake_rotary.calls[-1] == ("apply_rotary_emb", {"interleaved": interleaved, "varlen": layout == "thd"})
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(q_out.double(), oracle(q, pos, rotary_dim, interleaved), **tol)
    torch.testing.assert_close(k_out.double(), oracle(k, pos, rotary_dim, interleaved), **tol)
    gq = torch.randn(q.shape, generator=gen)
    (got,) = torch.autograd.grad(q_out, q, gq)
    torch.testing.assert_close(got.double(), oracle(gq, -pos, rotary_dim, interleaved), **tol)


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def _explain(device, *, q=None, cos_cols=64, **kwargs):
    q = _meta(2, 16, 8, 128) if q is None else q
    k = _meta(*q.shape[:-2], 2, q.shape[-1], grad=q.requires_grad)
    cos = _meta(4096, cos_cols, dtype=torch.float32)
    return opdispatch.explain_rotary_embedding(q, k, cos, cos.clone(), device=str(device_descriptor(device)),
                                               **kwargs)


def _reasons(decision, impl_id):
    return " ".join(next(c for c in decision.candidates if c.impl_id == impl_id).reasons)


def test_selection_and_reasons_on_simulated_devices(manager):
    # H100 as lent (flag_gems, no flash-attn): FlagGems' kernel for inference
    d = _explain("h100")
    assert d.chosen_id == "flagos.rotary_embedding"
    assert "not declared in the device descriptor" in _reasons(d, "nvidia.flash_rotary")
    # training too (its backward is the inverse rotation); partial rotary: FlagGems declines, the reference takes it
    assert _explain("h100", q=_meta(2, 16, 8, 128, grad=True)).chosen_id == "flagos.rotary_embedding"
    d = _explain("h100", q=_meta(2, 16, 8, 128, grad=True), cos_cols=32)
    assert d.chosen_id == "reference.rotary_embedding"
    assert "partial rotary (rotary_dim 64 < head_dim 128)" in _reasons(d, "flagos.rotary_embedding")
    # MI300X with flash-attn's ROCm build: its Triton kernel, also for training and packed sequences
    assert _explain("mi300x").chosen_id == "nvidia.flash_rotary"
    assert _explain("mi300x", q=_meta(2, 16, 8, 128, grad=True)).chosen_id == "nvidia.flash_rotary"
    d = _explain("mi300x", positions=_meta(2, 16, dtype=torch.int64))
    assert d.chosen_id == "reference.rotary_embedding"
    assert "explicit positions not supported" in _reasons(d, "nvidia.flash_rotary")
    # devices without either library: the reference, with each candidate's reason
    for device in ("bi-v150", "p800", "cpu"):
        d = _explain(device)
        assert d.chosen_id == "reference.rotary_embedding", device
        assert _reasons(d, "flagos.rotary_embedding")


def test_policy_section_with_its_own_when_keys(manager, tmp_path, monkeypatch):
    policy = tmp_path / "policy.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        ops:
          rotary_embedding:
            rules:
              - name: no-flagos-for-interleaved
                when: {vendor: nvidia, interleaved: true, rotary_dim: '>=128'}
                deny: [flagos.rotary_embedding]
                reason: test rule
    """))
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    opdispatch.get_manager().reload()
    d = _explain("h100", interleaved=True)
    assert d.chosen_id == "reference.rotary_embedding"
    assert "denied by" in _reasons(d, "flagos.rotary_embedding") and "policy.yaml:5" in str(d)
    assert _explain("h100", interleaved=False).chosen_id == "flagos.rotary_embedding"
    assert _explain("h100", interleaved=True, q=_meta(2, 16, 8, 64), cos_cols=32).chosen_id == \
        "flagos.rotary_embedding"
    policy.write_text("version: 1\nops:\n  rotary_embedding:\n    rules:\n      - name: r\n        when:\n"
                      "          hidden_size: 128\n        deny: [flagos.rotary_embedding]\n")
    with pytest.raises(PolicyError, match=r"policy.yaml:7: .*'hidden_size' is not a feature of op 'rotary_embedding'"):
        opdispatch.get_manager().reload()


def test_the_env_pin_pins_rotary_only(basic_manager, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    q, k, cos, sin, kwargs, pos = _case("bshd", 16, 16, "default", torch.float32, gen)
    monkeypatch.setenv("OPDISPATCH_IMPL_ROTARY_EMBEDDING", "flagos.rotary_embedding")
    basic_manager.reload()
    with pytest.raises(opdispatch.PinnedImplementationError, match="flagos.rotary_embedding"):
        opdispatch.rotary_embedding(q, k, cos, sin)
    x = torch.randn(4, 32, generator=gen)
    torch.testing.assert_close(opdispatch.rms_norm(x).double(),
                               x.double() / x.double().square().mean(-1, keepdim=True).add(1e-6).sqrt(),
                               **TOLERANCES[torch.float32])


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("args,kwargs,message", [
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)), {"layout": "sbhd"}, "layout='sbhd'; allowed: bshd, thd"),
    ((_t(2, 3, 4, 8), _t(2, 4, 4, 8), _t(16, 4), _t(16, 4)), {}, "must agree in every dim but heads"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 5), _t(16, 5)), {}, "rotary_dim is 10; it must be in 2..head_dim (8)"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(8, 4)), {}, "must both be (max_positions, rotary_dim / 2)"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(4, 4), _t(4, 4)), {"seqlen_offsets": 2},
     "tokens reach position 4 (seqlen_offsets + seqlen - 1); the cos/sin caches hold positions 0..3"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)), {"positions": torch.tensor([[0, 1, 2], [3, 16, 5]])},
     "positions span 0..16; the cos/sin caches hold positions 0..15"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)),
     {"positions": torch.zeros(2, 3, dtype=torch.long), "seqlen_offsets": 1}, "not both"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)), {"seqlen_offsets": torch.tensor([1, 2, 3])},
     "seqlen_offsets is (3,) on cpu; it must be (2,)"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)), {"seqlen_offsets": -1}, "seqlen_offsets=-1"),
    ((_t(7, 4, 8), _t(7, 4, 8), _t(16, 4), _t(16, 4)), {"layout": "thd"}, "layout 'thd' needs cu_seqlens"),
    ((_t(7, 4, 8), _t(7, 4, 8), _t(16, 4), _t(16, 4)),
     {"layout": "thd", "cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32), "max_seqlen": 3},
     "must start at 0, not decrease, and end at the token count of q (7)"),
    ((_t(2, 3, 4, 8).int(), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)), {}, "q has dtype int32; allowed: fp16"),
    ((_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(16, 4), _t(16, 4)), {"cu_seqlens": torch.tensor([0, 6], dtype=torch.int32),
                                                              "max_seqlen": 6}, "pass layout='thd' with them"),
])
def test_validation_errors_name_the_value_and_the_fix(basic_manager, args, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.").replace("+", r"\+")):
        opdispatch.rotary_embedding(*args, **kwargs)


def test_repeated_calls_take_the_fast_path_but_cpu_positions_are_checked_every_call(basic_manager):
    gen = torch.Generator().manual_seed(8)
    q, k, cos, sin, kwargs, pos = _case("bshd", 16, 16, "offset_int", torch.float32, gen)
    for _ in range(3):
        q_out, _ = opdispatch.rotary_embedding(q, k, cos, sin, **kwargs)
    assert basic_manager.decisions_made == 1 and len(basic_manager.fast) == 1
    torch.testing.assert_close(q_out.double(), oracle(q, pos, 16, False), **TOLERANCES[torch.float32])
    # explicit CPU positions are range-checked on every call: never cached
    good = torch.zeros(q.shape[:2], dtype=torch.long)
    opdispatch.rotary_embedding(q, k, cos, sin, positions=good)
    with pytest.raises(ValueError, match="positions span 64..64; the cos/sin caches hold positions 0..63"):
        opdispatch.rotary_embedding(q, k, cos, sin, positions=good + 64)
    assert len(basic_manager.fast) == 1


def test_every_rotary_capability_refuses_with_its_reason_in_order():
    """`RotaryCaps` through the op's rule table (`opdispatch.base._impl.unmet_capabilities`): a call that uses every
    feature against caps that declare none gets each reason once, in the table's order; declared, none."""
    from opdispatch.base._impl import unmet_capabilities
    from opdispatch.ops._rotary import ROTARY_CAPABILITY_RULES, RotaryCall, RotaryCaps

    q = torch.randn(10, 4, 64, dtype=torch.float16, requires_grad=True)  # thd: 10 tokens, 4 heads
    k = torch.randn(10, 2, 64, dtype=torch.float16)
    cos, sin = (torch.randn(16, 16, requires_grad=True) for _ in range(2))  # rotary_dim 32 of 64, learned
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    call = RotaryCall(q, k, cos, sin, torch.arange(10), torch.tensor([1, 2]), True, "thd", cu, 6)
    bare = RotaryCaps(dtypes=frozenset({torch.float32}), max_head_dim=32)
    assert unmet_capabilities(bare, call, ROTARY_CAPABILITY_RULES) == [
        "dtype fp16 not supported (supported: fp32)",
        "interleaved (GPT-J) pairs not supported",
        "partial rotary (rotary_dim 32 < head_dim 64) not supported",
        "packed varlen (layout thd) not supported",
        "explicit positions not supported (pass seqlen_offsets instead where they fit)",
        "seqlen_offsets not supported",
        "k with 2 heads and q with 4 (GQA) not supported",
        "backward not supported (forward only)",
        "gradients into cos/sin not supported (they are taken as constants)",
        "head_dim 64 above the supported maximum 32"]
    neox = RotaryCall(q.detach(), k, cos.detach(), sin.detach(), None, 0, False, "thd", cu, 6)
    assert unmet_capabilities(bare, neox, ROTARY_CAPABILITY_RULES)[1:3] == [
        "half-rotated (GPT-NeoX) pairs not supported", "partial rotary (rotary_dim 32 < head_dim 64) not supported"]
    assert "seqlen_offsets not supported" not in unmet_capabilities(bare, neox, ROTARY_CAPABILITY_RULES)  # 0: none
    full = RotaryCaps(dtypes=frozenset({torch.float16}), neox=True, interleaved=True, partial=True, varlen=True,
                      positions=True, offsets=True, gqa=True, backward=True, cos_sin_grad=True, max_head_dim=64)
    assert unmet_capabilities(full, call, ROTARY_CAPABILITY_RULES) == []
    assert unmet_capabilities(full, neox, ROTARY_CAPABILITY_RULES) == []
