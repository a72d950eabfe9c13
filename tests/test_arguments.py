"""One argument definition per op: front doors generated from it, entry points checked against it, and a new op
added end to end from nothing but its spec (definition, validator, implementations, policy section)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import opdispatch
from opdispatch import Impl
from opdispatch.base import _native, _ops
from opdispatch.base._arguments import Arg, OpArguments
from opdispatch.tools._cli import ops_markdown

from .conftest import randn

F32_64 = frozenset({torch.float32, torch.float64})


# -- a new op, defined in this test only ---------------------------------------------------------------------

SCALED_ADD_ARGS = OpArguments("scaled_add", (
    Arg("x", "torch.Tensor", key="tensor", positional=True, doc="the scaled tensor"),
    Arg("y", "torch.Tensor", key="tensor", positional=True, doc="added as is"),
    Arg("alpha", "float", 1.0, doc="the scale"),
    Arg("bias", "torch.Tensor | None", None, key="tensor?", doc="optional, added too"),
    Arg("impl", "str | None", None, doc="pin"),
), bound=("x", "y", "bias"))


class ScaledAddCall:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, alpha: float, bias: torch.Tensor | None,
                 module: str | None) -> None:
        self.x, self.y, self.alpha, self.bias, self.module = x, y, alpha, bias, module
        self.dtype, self.device = x.dtype, x.device
        self.requires_grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)

    def with_tensors(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> ScaledAddCall:
        new = ScaledAddCall.__new__(ScaledAddCall)
        new.__dict__.update(self.__dict__)
        new.x, new.y, new.bias = x, y, bias
        return new

    def stripped(self) -> ScaledAddCall:  # what bound functions keep: no tensors
        return self.with_tensors(None, None, None)

    def signature(self) -> tuple[Any, ...]:
        return (tuple(self.x.shape), self.dtype, str(self.device), self.bias is not None, self.requires_grad)

    def describe(self) -> str:
        return f"x {tuple(self.x.shape)} alpha {self.alpha:g}"


VALIDATIONS: list[tuple[int, ...]] = []


def validate_scaled_add(x: Any, y: Any, *, alpha: Any = 1.0, bias: Any = None,
                        module: str | None = None) -> ScaledAddCall:
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"scaled_add: x and y must be tensors, got {type(x).__name__}, {type(y).__name__}")
    if x.shape != y.shape:
        raise ValueError(f"scaled_add: x {tuple(x.shape)} and y {tuple(y.shape)} must have one shape")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"scaled_add: alpha must be a number, got {alpha!r}")
    VALIDATIONS.append(tuple(x.shape))
    return ScaledAddCall(x, y, float(alpha), bias, module)


class ScaledAddImpl(Impl):
    op: ClassVar[str] = "scaled_add"
    dtypes: ClassVar[frozenset[torch.dtype]] = F32_64

    def not_supported_reasons(self, call: ScaledAddCall, device: Any) -> list[str]:
        return [] if call.dtype in self.dtypes else [f"dtype {call.dtype} not supported"]


class FusedAdd(ScaledAddImpl):
    vendor, name = "toy", "fused"
    dtypes = frozenset({torch.float32})

    def run(self, call: ScaledAddCall) -> torch.Tensor:
        out = torch.add(call.y, call.x, alpha=call.alpha)
        return out if call.bias is None else out.add_(call.bias)


class LoopAdd(ScaledAddImpl):
    vendor, name = "toy", "loop"

    def run(self, call: ScaledAddCall) -> torch.Tensor:
        flat_x, flat_y = call.x.reshape(-1), call.y.reshape(-1)
        out = torch.stack([flat_y[i] + call.alpha * flat_x[i] for i in range(flat_x.numel())]).reshape(call.x.shape)
        return out if call.bias is None else out + call.bias


@pytest.fixture
def scaled_add(basic_manager, monkeypatch):
    """The toy op registered (only for this test), its two implementations, and its generated front door."""
    monkeypatch.setitem(_ops._OPS, "scaled_add", _ops.OpSpec(
        name="scaled_add", impl_base=ScaledAddImpl, call_features=lambda call: {"dtype": call.dtype},
        features={"dtype": "dtype"}, description="x * alpha + y", arguments=SCALED_ADD_ARGS,
        validator=validate_scaled_add))
    basic_manager.register_impl(FusedAdd())
    basic_manager.register_impl(LoopAdd())
    VALIDATIONS.clear()
    return opdispatch.define_front_door("scaled_add", doc="x * alpha + y (+ bias)")


def oracle(x, y, alpha, bias=None):
    out = y.double() + alpha * x.double()
    return out if bias is None else out + bias.double()


def test_a_new_op_runs_end_to_end_from_its_spec(scaled_add, basic_manager, rng):
    # The Python front door carries the annotations; a compiled one (a builtin) the same parameters without them.
    python = _native.python_of(scaled_add)
    assert str(inspect.signature(python)).startswith("(x: 'torch.Tensor', y: 'torch.Tensor', *, alpha")
    bare = [(p.name, p.kind, p.default) for p in inspect.signature(python).parameters.values()]
    assert [(p.name, p.kind, p.default) for p in inspect.signature(scaled_add).parameters.values()] == bare
    x, y = randn(3, 5, gen=rng), randn(3, 5, gen=rng)
    out = scaled_add(x, y, alpha=0.5)
    torch.testing.assert_close(out.double(), oracle(x, y, 0.5))
    decision = basic_manager.resolve("scaled_add", validate_scaled_add(x, y, alpha=0.5))
    assert decision.chosen_id == "toy.fused"  # registry order: no policy names the op
    # float64: the fused one declines with its reason; the loop takes it
    x64, y64 = x.double(), y.double()
    torch.testing.assert_close(scaled_add(x64, y64, alpha=-2.0), oracle(x, y, -2.0))
    explained = basic_manager.explain("scaled_add", validate_scaled_add(x64, y64))
    assert explained.chosen_id == "toy.loop"
    assert "dtype torch.float64 not supported" in explained.candidate("toy.fused").reasons[0]


def test_the_generated_fast_path_validates_each_signature_once(scaled_add, basic_manager, rng):
    x, y, bias = randn(4, 2, gen=rng), randn(4, 2, gen=rng), randn(4, 2, gen=rng)
    for _ in range(3):
        torch.testing.assert_close(scaled_add(x, y, alpha=2.0, bias=bias).double(), oracle(x, y, 2.0, bias))
    assert len(VALIDATIONS) == 1
    scaled_add(x, y, alpha=3.0, bias=bias)  # a value argument is part of the key
    scaled_add(x, y, alpha=3.0)  # so is an optional tensor's presence
    scaled_add(x[:2], y[:2], alpha=3.0)  # and the shapes
    assert len(VALIDATIONS) == 4
    x2, y2 = randn(4, 2, gen=rng), randn(4, 2, gen=rng)  # new data, same signature: no validation
    torch.testing.assert_close(scaled_add(x2, y2, alpha=3.0).double(), oracle(x2, y2, 3.0))
    assert len(VALIDATIONS) == 4


def test_the_generated_front_door_pins_and_reports_errors(scaled_add, rng):
    x, y = randn(2, 3, gen=rng), randn(2, 3, gen=rng)
    torch.testing.assert_close(scaled_add(x, y, alpha=1.5, impl="toy.loop").double(), oracle(x, y, 1.5))
    with pytest.raises(opdispatch.PinnedImplementationError, match="toy.fused.*dtype torch.float64"):
        scaled_add(x.double(), y.double(), impl="toy.fused")
    with pytest.raises(ValueError, match=r"x \(2, 3\) and y \(3,\) must have one shape"):
        scaled_add(x, y[0])
    with pytest.raises(TypeError, match="alpha must be a number"):
        scaled_add(x, y, alpha="big")
    with pytest.raises(TypeError, match="unexpected keyword argument 'beta'"):
        scaled_add(x, y, beta=1.0)


def test_the_new_op_takes_a_policy_section(scaled_add, basic_manager, rng):
    from opdispatch.policies import parse_policy

    basic_manager.set_policy(parse_policy("ops:\n  scaled_add:\n    order: [toy.loop, toy.fused]\n", "<t>"))
    x, y = randn(2, 2, gen=rng), randn(2, 2, gen=rng)
    decision = basic_manager.resolve("scaled_add", validate_scaled_add(x, y))
    assert decision.chosen_id == "toy.loop"
    assert "order 'toy.loop'" in str(decision.decided_by)


def test_the_new_op_under_torch_compile_runs_eagerly_without_fake_outputs(scaled_add, rng):
    x, y = randn(3, 4, gen=rng), randn(3, 4, gen=rng)
    compiled = torch.compile(lambda a, b: scaled_add(a, b, alpha=0.25) * 2.0, backend="eager")
    torch.testing.assert_close(compiled(x, y).double(), 2.0 * oracle(x, y, 0.25))


def test_the_new_op_with_fake_outputs_compiles_to_one_node_with_autograd(basic_manager, monkeypatch, rng):
    monkeypatch.setitem(_ops._OPS, "scaled_add", _ops.OpSpec(
        name="scaled_add", impl_base=ScaledAddImpl, call_features=lambda call: {"dtype": call.dtype},
        features={"dtype": "dtype"}, arguments=SCALED_ADD_ARGS, validator=validate_scaled_add,
        fake_outputs=lambda x, y, alpha, bias, impl: [torch.empty_like(x)]))
    basic_manager.register_impl(FusedAdd())
    scaled_add = opdispatch.define_front_door("scaled_add")
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: scaled_add(a, b, alpha=0.5, bias=c).sin(), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    for rows in (3, 6):
        x, y, bias = (randn(rows, 4, gen=rng).requires_grad_() for _ in range(3))
        out = compiled(x, y, bias)
        want = oracle(x, y, 0.5, bias).sin()
        torch.testing.assert_close(out.double(), want)
        gx, gy, gb = torch.autograd.grad(out.sum(), (x, y, bias))
        cos = oracle(x, y, 0.5, bias).cos()
        for got, scale in ((gx, 0.5), (gy, 1.0), (gb, 1.0)):
            torch.testing.assert_close(got.double(), scale * cos)
    torch._dynamo.reset()


# -- the definition's own checks -------------------------------------------------------------------------------

@pytest.mark.parametrize("args, bound, problem", [
    ((Arg("x", "T", positional=True), Arg("x", "T")), (), "duplicate argument names"),
    ((Arg("class", "T", positional=True),), (), "'class' is not a Python identifier"),
    ((Arg("x", "T", key="hashed"),), (), "key kind 'hashed'; allowed: tensor, strided"),
    ((Arg("x", "T"), Arg("y", "T", positional=True)), (), "positional arguments must come before"),
    ((Arg("x", "T", 1, positional=True), Arg("y", "T", positional=True)), (), "'y' without a default follows"),
    ((Arg("x", "T", positional=True),), ("y",), "bound names ['y'] are not arguments"),
])
def test_malformed_definitions_are_refused(args, bound, problem):
    with pytest.raises(ValueError, match="op 'toy': malformed argument definition: .*" + _escape(problem)):
        OpArguments("toy", args, bound=bound)


@pytest.mark.parametrize("optional", [("w",), ("x",), ("z",)])
def test_bound_optional_names_must_be_index_arguments_outside_bound(optional):
    args = (Arg("x", "T", key="tensor", positional=True), Arg("n", "T", None, key="tensor?"),
            Arg("i", "T", None, key="index"), Arg("w", "int", 0))
    with pytest.raises(ValueError, match=f"bound_optional name '{optional[0]}' must be an argument of key kind "
                                         "'index' or 'tensor[?]', not in bound"):
        OpArguments("toy", args, bound=("x",), bound_optional=optional)
    OpArguments("toy", args, bound=("x",), bound_optional=("i", "n"))  # an index and an optional tensor: fine


def test_bound_optional_tensors_reach_the_bound_function_only_when_given():
    args = (Arg("x", "T", key="tensor", positional=True), Arg("i", "T", None, key="index"),
            Arg("j", "T", None, key="index"))
    spec = OpArguments("toy", args, bound=("x",), bound_optional=("i", "j"))
    assert spec.bound_tensors({"x": 1, "i": None, "j": None}) == (1,)
    assert spec.bound_tensors({"x": 1, "i": None, "j": 3}) == (1, None, 3)
    source = spec.front_door_source(compiled="c", slow="s", failed="f")
    import re

    assert re.search(r"if i is None and j is None:\n +return fn\(x\)\n +return fn\(x, i, j\)\n", source), source
    assert "None if i is None else _index_key(i)" in source


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_validator_that_disagrees_with_the_definition_is_refused_at_registration():
    def validate(x: Any, y: Any, *, alpha: Any = 2.0, module: str | None = None) -> None:  # default differs
        return None

    with pytest.raises(TypeError, match=r"validator validate takes \(x, y, alpha=2.0 \(keyword\)\); the op's "
                                        r"argument definition says \(x, y, alpha=1.0 \(keyword\), bias=None"):
        _ops.register_op(_ops.OpSpec(name="scaled_add", impl_base=ScaledAddImpl, call_features=dict, features={},
                                     arguments=SCALED_ADD_ARGS, validator=validate))
    assert "scaled_add" not in _ops.known_ops()


@pytest.mark.parametrize("op", ["attention", "rms_norm", "rotary_embedding"])
def test_every_entry_point_takes_exactly_the_defined_arguments(op):
    from opdispatch.compile._compile import attention_for_compile

    spec = opdispatch.op_spec(op)
    if op == "attention":  # its trace-time decision has a hand-written entry, checked here
        spec.arguments.check_callable(attention_for_compile, "attention_for_compile")
    else:  # the others' compiled op is generated: its schema lists the definition's arguments in order
        schema = getattr(torch.ops.opdispatch, op).default._schema
        names = [a.name.removesuffix("_tensor") for a in schema.arguments if not a.name.endswith("_int")]
        assert names == [*spec.arguments.names, "scopes"]  # plus the scopes entered inside the traced function
    front_door = _native.python_of(getattr(opdispatch, op))  # the compiled one's signature has no annotations
    assert inspect.signature(front_door) == spec.arguments.signature(
        return_annotation=inspect.signature(front_door).return_annotation)
    bare = [(p.name, p.kind, p.default) for p in inspect.signature(front_door).parameters.values()]
    assert [(p.name, p.kind, p.default) for p in inspect.signature(getattr(opdispatch, op)).parameters.values()] == bare
    explain = opdispatch.explain if op == "attention" else getattr(opdispatch, f"explain_{op}")
    assert list(inspect.signature(explain).parameters) == [*spec.arguments.names, "device"]


def test_attention_call_record_holds_every_defined_argument_but_the_pin():
    names = opdispatch.op_spec("attention").arguments.names
    assert [n for n in names if n != "impl"] == list(opdispatch.AttentionCall.__slots__[:len(names) - 1])


def test_docs_ops_md_is_generated_from_the_definitions():
    path = Path(__file__).resolve().parents[1] / "docs" / "ops.md"
    assert path.read_text(encoding="utf-8") == ops_markdown(), \
        "docs/ops.md is stale: regenerate it with `opdispatch ops > docs/ops.md`"


def test_explain_rms_norm_binds_like_the_front_door(basic_manager, rng):
    x, w = randn(2, 8, gen=rng), randn(8, gen=rng)
    decision = opdispatch.explain_rms_norm(x, w, 1e-5)
    assert decision.chosen_id is not None and "eps 1e-05" in decision.call
    with pytest.raises(TypeError, match=r"explain_rms_norm\(x: 'torch.Tensor'.*too many positional"):
        opdispatch.explain_rms_norm(x, w, 1e-5, None, "extra")
    torch.testing.assert_close(opdispatch.rms_norm(x, w, 1e-5).double(), oracle_rms(x, w, 1e-5),
                               rtol=1e-5, atol=1e-6)


def oracle_rms(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def test_the_compiled_attention_schema_derives_from_the_definition(monkeypatch):
    import opdispatch.ops._attention as attention_module
    from opdispatch.compile import _compile

    tensors, scalars = _compile._lowered_arguments()
    assert tensors[:3] == ["Tensor q", "Tensor k", "Tensor v"] and "Tensor? attn_mask" in tensors
    assert "SymInt window_left" in scalars and "str impl_id" in scalars and "str layout" in scalars
    base = attention_module.ATTENTION_ARGS
    grown = OpArguments("attention", (*base.args[:-1], Arg("temperature", "float", 1.0), base.args[-1]),
                        bound=base.bound, context=base.context)
    monkeypatch.setattr(attention_module, "ATTENTION_ARGS", grown)
    assert "float temperature" in _compile._lowered_arguments()[1]  # a new argument reaches the schema by itself
    odd = OpArguments("attention", (*base.args, Arg("extra", "list[int]", None)), bound=base.bound)
    monkeypatch.setattr(attention_module, "ATTENTION_ARGS", odd)
    with pytest.raises(TypeError, match="argument 'extra' of type 'list\\[int\\]' has no schema type"):
        _compile._lowered_arguments()


def test_plan_op_binds_any_op_once(basic_manager, rng):
    x, w, r = randn(3, 16, gen=rng), randn(16, gen=rng), randn(3, 16, gen=rng)
    fn = opdispatch.plan_op("rms_norm", x, w, 1e-5, r)
    assert fn.decision.chosen_id == "torch.rms_norm"
    made = basic_manager.decisions_made
    x2, r2 = randn(3, 16, gen=rng), randn(3, 16, gen=rng)
    y, h = fn(x2, w, r2)  # the bound tensors, in the definition's order
    want_y, want_h = oracle_rms(x2 + r2, w, 1e-5), (x2 + r2).double()
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.double(), want_h)
    assert basic_manager.decisions_made == made
    pinned = opdispatch.plan_op("rms_norm", x, w, impl="reference.rms_norm")
    assert pinned.decision.chosen_id == "reference.rms_norm"
    with pytest.raises(TypeError, match=r"plan_op\('rms_norm', ...\).*unexpected keyword argument 'bias'"):
        opdispatch.plan_op("rms_norm", x, bias=w)


def test_generated_doors_show_their_source_in_tracebacks_and_inspect():
    import linecache
    import traceback

    for door in (opdispatch.attention, opdispatch.rms_norm, opdispatch.rotary_embedding):
        python = _native.python_of(door)
        filename = python.__code__.co_filename
        assert filename == f"<opdispatch front door {python.__name__}>"
        assert linecache.getline(filename, 1).startswith(f"def {python.__name__}(")
        assert inspect.getsource(python) == python.__opdispatch_source__
    try:
        _native.python_of(opdispatch.rms_norm)("not a tensor")
    except TypeError:
        frames = traceback.extract_tb(sys.exc_info()[2])
    door_frame = next(f for f in frames if f.filename == "<opdispatch front door rms_norm>")
    assert door_frame.line == "return _slow(manager, key, x, weight, eps, residual, impl)"
    linecache.checkcache()  # the entries have no file behind them: kept, not dropped
    assert linecache.getline("<opdispatch front door rms_norm>", 1).startswith("def rms_norm(")
