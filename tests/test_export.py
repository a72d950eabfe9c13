"""torch.export of routed SDPA code and of `opdispatch.attention`: the exported graph holds ``opdispatch::attention``.

Strict (Dynamo) and non-strict (FakeTensors, torch 2.13's default) export, static and dynamic batch/sequence
dims (named `Dim`s and `Dim.AUTO`), causal, boolean and float masks, GQA; an unbacked (data-dependent) length.
The exported program runs at sizes other than the example's and matches a float64 oracle, through ``ep.module()``
and a ``torch.export.save``/``load`` round trip (in this process and in a fresh one). Its kernel decides every
call on the real sizes (an implementation chosen at export time for a short example is not used where its
``caps.max_seqlen`` excludes the call).
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import opdispatch
from opdispatch.compile import _compile
from opdispatch.compat import routed_sdpa, torch_sdpa

from tests._test_impls import ShortOnly, prefer_test_impls

HEADS, HEADS_KV, DIM = 4, 2, 8
EXAMPLE = (2, 16)  # (batch, seqlen) of the example inputs
OTHER_SIZES = [(3, 7), (1, 33), (2, 16), (4, 2)]  # run sizes within the dynamic range, the example's included


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention in float64 from its definition, (batch, heads, seq, dim); k/v heads repeated for GQA."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    return torch.softmax(scores, -1) @ v


class Sdpa(torch.nn.Module):
    """Model code calling torch's function, as transformers' sdpa attention does."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.kind == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.kind == "gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Direct(torch.nn.Module):
    """Model code calling opdispatch.attention itself."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.kind == "mask":
            return opdispatch.attention(q, k, v, layout="bhsd", attn_mask=mask)  # type: ignore[return-value]
        if self.kind == "plain":
            return opdispatch.attention(q, k, v, layout="bhsd")  # type: ignore[return-value]
        return opdispatch.attention(q, k, v, layout="bhsd", causal=True)  # type: ignore[return-value]


def _inputs(kind: str, batch: int, seqlen: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    heads_kv = HEADS_KV if kind == "gqa" else HEADS
    q = torch.randn(batch, HEADS, seqlen, DIM, generator=gen)
    k, v = (torch.randn(batch, heads_kv, seqlen, DIM, generator=gen) for _ in range(2))
    if kind == "float_mask":
        mask: torch.Tensor = torch.randn(batch, 1, seqlen, seqlen, generator=gen)
    else:  # a random boolean mask in which every query sees at least itself
        mask = (torch.rand(batch, 1, seqlen, seqlen, generator=gen) > 0.5) | torch.eye(seqlen, dtype=torch.bool)
    return q, k, v, mask


def _expected(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if kind in ("causal", "gqa"):
        return oracle(q, k, v, causal=True)
    if kind == "plain":
        return oracle(q, k, v)
    return oracle(q, k, v, mask=mask)


def _dynamic_shapes(dynamic: str) -> Any:
    if dynamic == "static":
        return None
    if dynamic == "auto":
        b = s = Dim.AUTO
    else:
        b, s = Dim("b", min=1, max=64), Dim("s", min=2, max=1024)
    return ({0: b, 2: s}, {0: b, 2: s}, {0: b, 2: s}, {0: b, 2: s, 3: s})


def _targets(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def _assert_opdispatch_op(ep: torch.export.ExportedProgram) -> None:
    targets = _targets(ep)
    assert "opdispatch.attention.default" in targets, targets
    assert not any("scaled_dot_product" in t for t in targets), targets


def _check_runs(program: Any, kind: str, sizes: list[tuple[int, int]], gen: torch.Generator) -> None:
    for batch, seqlen in sizes:
        q, k, v, mask = _inputs(kind, batch, seqlen, gen)
        out = program(q, k, v, mask)
        assert out.shape == (batch, HEADS, seqlen, DIM)
        torch.testing.assert_close(out.double(), _expected(kind, q, k, v, mask), atol=2e-5, rtol=2e-5)


def _export(model: torch.nn.Module, kind: str, strict: bool, dynamic: str) -> torch.export.ExportedProgram:
    example = _inputs(kind, *EXAMPLE, torch.Generator().manual_seed(0))
    return torch.export.export(model, example, strict=strict, dynamic_shapes=_dynamic_shapes(dynamic))


STRICT = pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
DYNAMIC = pytest.mark.parametrize("dynamic", ["static", "dims", "auto"])


@STRICT
@DYNAMIC
@pytest.mark.parametrize("kind", ["causal", "mask", "float_mask", "gqa"])
def test_routed_sdpa_exports_opdispatch_op(basic_manager, strict, dynamic, kind):
    with routed_sdpa():
        ep = _export(Sdpa(kind), kind, strict, dynamic)
    _assert_opdispatch_op(ep)
    gen = torch.Generator().manual_seed(1)
    # Run outside routing: the program holds opdispatch's op, not a call of F.scaled_dot_product_attention.
    _check_runs(ep.module(), kind, OTHER_SIZES if dynamic != "static" else [EXAMPLE] * 2, gen)
    if dynamic != "static":  # torch's own function exports and agrees on the same sizes
        reference = torch.export.export(Sdpa(kind), _inputs(kind, *EXAMPLE, gen), strict=strict,
                                        dynamic_shapes=_dynamic_shapes(dynamic)).module()
        q, k, v, mask = _inputs(kind, 3, 7, gen)
        torch.testing.assert_close(ep.module()(q, k, v, mask), reference(q, k, v, mask), atol=2e-5, rtol=2e-5)


@STRICT
@pytest.mark.parametrize("dynamic", ["static", "dims"])
@pytest.mark.parametrize("kind", ["causal", "mask"])
def test_direct_attention_exports_and_round_trips(basic_manager, tmp_path, strict, dynamic, kind):
    ep = _export(Direct(kind), kind, strict, dynamic)
    _assert_opdispatch_op(ep)
    path = tmp_path / "attention.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    _assert_opdispatch_op(loaded)
    sizes = OTHER_SIZES if dynamic != "static" else [EXAMPLE]
    _check_runs(loaded.module(), kind, sizes, torch.Generator().manual_seed(2))


class _UnbackedKeys(torch.nn.Module):
    """The keys' length is data-dependent (an unbacked size, ``u0``): the first n positions of the cache."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        m = n.item()
        torch._check(m >= 1)
        torch._check(m <= k.shape[2])
        return F.scaled_dot_product_attention(q, k[:, :, :m], v[:, :, :m])


@STRICT
def test_unbacked_key_length_exports_and_runs(basic_manager, strict):
    gen = torch.Generator().manual_seed(3)
    q, k, v, _ = _inputs("causal", 2, 16, gen)
    # torch's own function exports this model; so must the routed one, without guarding on u0.
    torch.export.export(_UnbackedKeys(), (q, k, v, torch.tensor(5)), strict=strict)
    with routed_sdpa():
        ep = torch.export.export(_UnbackedKeys(), (q, k, v, torch.tensor(5)), strict=strict)
    _assert_opdispatch_op(ep)
    program = ep.module()
    for n in (1, 2, 9, 16):
        out = program(q, k, v, torch.tensor(n))
        torch.testing.assert_close(out.double(), oracle(q, k[:, :, :n], v[:, :, :n]), atol=2e-5, rtol=2e-5)


@STRICT
def test_exported_kernel_decides_each_call_on_real_sizes(basic_manager, tmp_path, strict):
    """test.short (caps.max_seqlen=20, preferred) fits the example; at 40 the program must not run it."""
    basic_manager.register_impl(ShortOnly())
    prefer_test_impls(basic_manager, tmp_path)
    ep = _export(Direct("plain"), "plain", strict, "dims")
    node = next(n for n in ep.graph.nodes if str(n.target) == "opdispatch.attention.default")
    token = node.args[_compile._OP_ARGS.index("token")]
    gen = torch.Generator().manual_seed(4)
    program = ep.module()
    for seqlen, expected in ((16, "test.short"), (40, "cpu.flash"), (20, "test.short"), (21, "cpu.flash")):
        q, k, v, mask = _inputs("plain", 2, seqlen, gen)
        torch.testing.assert_close(program(q, k, v, mask).double(), oracle(q, k, v), atol=2e-5, rtol=2e-5)
        assert _compile._LAST_CHOICE[token] == expected


def test_real_subclass_masks_still_go_to_torch_under_export(basic_manager):
    """A CausalBias mask is not a FakeTensor standing for a plain tensor: torch's function handles it."""
    from torch.nn.attention.bias import causal_lower_right

    class Biased(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))

    q, k, v, _ = _inputs("causal", 2, 16, torch.Generator().manual_seed(5))
    try:
        expected_targets = _targets(torch.export.export(Biased(), (q, k, v), strict=False))
    except Exception as exc:  # noqa: BLE001 - whatever torch's own function does, routed must do the same
        with routed_sdpa(), pytest.raises(type(exc)):
            torch.export.export(Biased(), (q, k, v), strict=False)
        return
    with routed_sdpa():
        ep = torch.export.export(Biased(), (q, k, v), strict=False)
    assert "opdispatch.attention.default" not in _targets(ep)
    assert _targets(ep) == expected_targets
    torch.testing.assert_close(ep.module()(q, k, v), torch_sdpa(q, k, v, is_causal=True), atol=1e-6, rtol=1e-6)


def test_saved_program_runs_in_a_fresh_process(basic_manager, tmp_path):
    """The op's context token spells the context (no index into this process's tables): a program exported here
    runs where only ``import opdispatch`` registered the op."""
    ep = _export(Direct("causal"), "causal", False, "dims")
    path = tmp_path / "attention.pt2"
    torch.export.save(ep, path)
    script = textwrap.dedent(f"""
        import math, torch, opdispatch
        import opdispatch.compile._compile  # registers opdispatch::attention (a plain `import opdispatch` does not yet)
        program = torch.export.load({str(path)!r}).module()
        gen = torch.Generator().manual_seed(6)
        q, k, v = (torch.randn(3, {HEADS}, 11, {DIM}, generator=gen) for _ in range(3))
        out = program(q, k, v, torch.ones(3, 1, 11, 11, dtype=torch.bool))
        s = q.double() @ k.double().transpose(-1, -2) / math.sqrt({DIM})
        s = s.masked_fill(~torch.ones(11, 11, dtype=torch.bool).tril(), -math.inf)
        print(float((out.double() - torch.softmax(s, -1) @ v.double()).abs().max()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 2e-5


def test_exported_inner_scope_unknown_to_the_process_is_refused(basic_manager, monkeypatch):
    """A token naming scopes entered inside the exported function cannot be rebuilt elsewhere: a clear error,
    never a decision made without them."""

    class Scoped(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with opdispatch.scope("model.layers.0.self_attn"):
                return opdispatch.attention(q, k, v, layout="bhsd", causal=True)  # type: ignore[return-value]

    q, k, v, _ = _inputs("causal", 2, 16, torch.Generator().manual_seed(7))
    ep = torch.export.export(Scoped(), (q, k, v), strict=False)
    torch.testing.assert_close(ep.module()(q, k, v).double(), oracle(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
    monkeypatch.setattr(_compile, "_EXPORTED", {})  # as in a process that did not export it
    with pytest.raises(RuntimeError, match="scope\\(\\)/policy_override\\(\\) entered inside the exported"):
        ep.module()(q, k, v)


@STRICT
def test_exported_program_is_differentiable(basic_manager, strict):
    """Exported from inputs without gradients, run on inputs that need them: exact gradients (float64 oracle)."""
    with routed_sdpa():
        ep = _export(Sdpa("gqa"), "gqa", strict, "dims")
    gen = torch.Generator().manual_seed(8)
    q, k, v, mask = _inputs("gqa", 3, 9, gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ep.module()(q, k, v, mask)
    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(oracle(*leaves, causal=True), leaves, grad_out.double())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@STRICT
def test_override_active_while_exporting_is_kept_by_the_program(basic_manager, strict):
    """A policy_override(pin=...) around export is part of the exported program: its calls run the pinned
    implementation afterwards, outside the override, at every size."""
    with opdispatch.policy_override(pin="reference.math"):
        ep = _export(Direct("causal"), "causal", strict, "dims")
    node = next(n for n in ep.graph.nodes if str(n.target) == "opdispatch.attention.default")
    token = node.args[_compile._OP_ARGS.index("token")]
    program = ep.module()
    gen = torch.Generator().manual_seed(9)
    for batch, seqlen in OTHER_SIZES[:2]:
        _check_runs(program, "causal", [(batch, seqlen)], gen)
        assert _compile._LAST_CHOICE[token] == "reference.math"
    _check_runs(_export(Direct("causal"), "causal", strict, "dims").module(), "causal", [(3, 7)], gen)
    assert _compile._LAST_CHOICE[token] == "reference.math"  # another export's token is another context


class _Heads(torch.nn.Module):
    """torch's SDPA over (..., heads, seq, dim) inputs whose head count (or 3-D leading dim) is exported dynamic."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("rank", [3, 4])
def test_a_dynamic_head_count_exports_as_torchs_function_does(basic_manager, strict, rank):
    """The compiled op specialises heads (selection reads them); a model exported with dynamic heads — or 3-D
    inputs, whose leading dim is the head dim — folds them into the batch (no GQA, no mask: every head is
    independent) instead of failing where torch's function exports. The program runs other head counts exactly."""
    gen = torch.Generator().manual_seed(4)
    heads, seq = Dim("heads", min=2, max=64), Dim("seq", min=2, max=64)
    shape = (4, 9, DIM) if rank == 3 else (2, 4, 9, DIM)
    dims = {0: heads, 1: seq} if rank == 3 else {1: heads, 2: seq}
    example = tuple(torch.randn(shape, generator=gen) for _ in range(3))
    with routed_sdpa():
        ep = torch.export.export(_Heads(), example, strict=strict, dynamic_shapes=({**dims}, {**dims}, {**dims}))
    _assert_opdispatch_op(ep)
    for h, s in ((3, 7), (6, 12)):
        size = (h, s, DIM) if rank == 3 else (2, h, s, DIM)
        q, k, v = (torch.randn(size, generator=gen) for _ in range(3))
        out = ep.module()(q, k, v)
        as4 = (lambda t: t.unsqueeze(0)) if rank == 3 else (lambda t: t)
        want = oracle(as4(q), as4(k), as4(v), causal=True)
        torch.testing.assert_close(as4(out).double(), want, atol=2e-5, rtol=2e-5)
