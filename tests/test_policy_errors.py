"""Malformed policies: each fails at load with the file, the line and the field, and never runs code."""

from __future__ import annotations

import pytest

import opdispatch
from opdispatch import PolicyError
from opdispatch.policies import load_policy

HEAD = "version: 1\nops:\n  attention:\n"  # lines 1-3; op-level keys start on line 4


def op(body: str) -> str:
    return HEAD + "\n".join("    " + line for line in body.strip("\n").splitlines()) + "\n"


def rule(when: str = "", action: str = "deny: [cpu.flash]", name: str = "r1") -> str:
    """A policy with one rule whose `when:` body starts on line 7 (rules: 4, - name: 5, when: 6)."""
    lines = ["rules:", f"  - name: {name}"]
    if when:
        lines.append("    when:")
        lines += ["      " + w for w in when.strip("\n").splitlines()]
    lines += ["    " + a for a in action.strip("\n").splitlines()]
    return op("\n".join(lines))


# (id, yaml text, expected line, expected field (substring), expected message (substring))
CASES: list[tuple[str, str, int | None, str, str]] = [
    # YAML syntax
    ("unclosed bracket", "ops:\n  attention:\n    order: [cpu.flash\n", 4, "(syntax)", "invalid YAML"),
    ("bad indentation", "ops:\n  attention:\n    order:\n   - cpu.flash\n  deny: x\n", None, "(syntax)", "invalid YAML"),
    ("tab indentation", "ops:\n\tattention: {}\n", 2, "(syntax)", "invalid YAML"),
    ("unclosed quote", "ops:\n  attention:\n    order: ['cpu.flash]\n", None, "(syntax)", "invalid YAML"),
    ("mapping in sequence mix", "ops:\n  attention:\n    order:\n      - a.b\n      c: d\n", None, "(syntax)", "invalid YAML"),
    ("python tag refused", "ops: !!python/object/apply:os.system ['echo hacked']\n", 1, "(syntax)", "invalid YAML"),
    ("python name tag refused", "settings: !!python/name:os.system\n", 1, "(syntax)", "invalid YAML"),
    ("duplicate top key", "ops: {}\nops: {}\n", 2, "ops", "duplicate key 'ops' (first at line 1)"),
    ("duplicate op key", "ops:\n  attention: {}\n  attention: {}\n", 3, "ops.attention", "duplicate key 'attention'"),
    ("duplicate rule key", rule(action="deny: [cpu.flash]\ndeny: [reference.math]"), 7, "ops.attention.rules.0.deny",
     "duplicate key 'deny'"),
    # root and top-level
    ("root is a list", "- a\n- b\n", 1, "(top level)", "must be a mapping"),
    ("root is a string", "hello\n", 1, "(top level)", "must be a mapping"),
    ("root is a number", "42\n", 1, "(top level)", "must be a mapping"),
    ("unknown top key", "version: 1\nopz: {}\n", 2, "opz", "unknown key 'opz'"),
    ("version 2", "version: 2\n", 1, "version", "version must be the integer 1"),
    ("version string", "version: one\n", 1, "version", "version must be the integer 1"),
    ("version true", "version: true\n", 1, "version", "version must be the integer 1"),
    ("version float", "version: 1.0\n", 1, "version", "version must be the integer 1"),
    ("fallback quoted off", "settings:\n  fallback_on_error: 'off'\n", 2, "settings.fallback_on_error",
     "must be true or false, unquoted"),
    ("fallback 0.0", "settings:\n  fallback_on_error: 0.0\n", 2, "settings.fallback_on_error", "must be true or false"),
    ("fallback quoted yes", "settings:\n  fallback_on_error: 'yes'\n", 2, "settings.fallback_on_error",
     "must be true or false"),
    ("strict 1", "settings:\n  strict: 1\n", 2, "settings.strict", "must be true or false"),
    ("order set", HEAD + "    order: !!set {cpu.flash, reference.math}\n", 4, "ops.attention.order",
     "a !!set has no order"),
    ("order tuple-ish mapping", HEAD + "    order: {cpu.flash: 1}\n", 4, "ops.attention.order", "must be a YAML list"),
    ("order duplicate", HEAD + "    order: [cpu.flash, reference.math, cpu.flash]\n", 4, "ops.attention.order",
     "names 'cpu.flash' twice"),
    ("deny duplicate", HEAD + "    deny: ['cpu.*', 'cpu.*']\n", 4, "ops.attention.deny", "names 'cpu.*' twice"),
    ("order unclosed glob", HEAD + "    order: ['cpu.[fl']\n", 4, "ops.attention.order", "never closed"),
    ("extends bad", "extends: parent\n", 1, "extends", "'default' or 'none'"),
    ("ops is a list", "ops: [attention]\n", 1, "ops", "must be a mapping"),
    ("unknown op", "ops:\n  convolution: {}\n", 2, "ops.convolution", "unknown op 'convolution'; known ops: attention"),
    ("op is a list", "ops:\n  attention: [cpu.flash]\n", 2, "ops.attention", "must be a mapping"),
    # settings
    ("settings unknown key", "settings:\n  fallback: true\n", 2, "settings.fallback", "unknown key 'fallback'"),
    ("settings bad bool", "settings:\n  strict: maybe\n", 2, "settings.strict", "must be true or false"),
    ("settings fallback int", "settings:\n  fallback_on_error: 3\n", 2, "settings.fallback_on_error", "must be true or false"),
    ("settings is list", "settings: [strict]\n", 1, "settings", "must be a mapping"),
    # op-level
    ("unknown op key", op("ordr: [cpu.flash]"), 4, "ops.attention.ordr", "unknown key 'ordr'"),
    ("order not a list", op("order: cpu.flash"), 4, "ops.attention.order", "must be a YAML list"),
    ("order bad id", op("order: [cpuflash]"), 4, "ops.attention.order", "'cpuflash' is not an implementation id"),
    ("order upper case", op("order: [CPU.flash]"), 4, "ops.attention.order", "is not an implementation id"),
    ("order int item", op("order:\n  - cpu.flash\n  - 3"), 6, "ops.attention.order.1", "must be a string"),
    ("order spaces", op("order: ['cpu. flash']"), 4, "ops.attention.order", "is not an implementation id"),
    ("deny not a list", op("deny: 5"), 4, "ops.attention.deny", "must be a YAML list"),
    ("deny bad id", op("deny: ['nvidia']"), 4, "ops.attention.deny", "'nvidia' is not an implementation id"),
    ("deny dict", op("deny: {a: b}"), 4, "ops.attention.deny", "must be a YAML list"),
    ("rules not a list", op("rules: {name: x}"), 4, "ops.attention.rules", "must be a YAML list"),
    ("options not a dict", op("options: [a]"), 4, "ops.attention.options", "must be a mapping"),
    ("options glob key", op("options:\n  'rocm.*': {fa_library: ck}"), 4, "ops.attention.options",
     "options key 'rocm.*' is a glob"),
    ("options bad key", op("options:\n  rocm: {fa_library: ck}"), 4, "ops.attention.options", "'rocm' is not an implementation id"),
    ("options value not dict", op("options:\n  rocm.ck: fast"), 5, "ops.attention.options.rocm.ck", "must be a mapping"),
    ("autotune not a string", op("autotune: [a, b]"), 4, "ops.attention.autotune", "must be a string"),
    # rules: structure
    ("rule missing name", op("rules:\n  - deny: [cpu.flash]"), 5, "ops.attention.rules.0.name", "Field required"),
    ("rule empty name", rule(name="''"), 5, "ops.attention.rules.0.name", "at least 1 character"),
    ("rule bad name chars", rule(name="'has space'"), 5, "ops.attention.rules.0.name", "should match pattern"),
    ("rule unknown key", rule(action="deny: [cpu.flash]\nprefers: [reference.math]"), 7,
     "ops.attention.rules.0.prefers", "unknown key 'prefers'"),
    ("rule without action", rule(when="dtype: bf16", action="reason: nothing"), 5, "ops.attention.rules.0",
     "rule 'r1' has no action"),
    ("rule is a string", op("rules:\n  - deny cpu.flash"), 5, "ops.attention.rules.0", "must be a mapping"),
    ("duplicate rule names", op("rules:\n  - name: a\n    deny: [cpu.flash]\n  - name: a\n    deny: [reference.math]"), 7,
     "ops.attention.rules.1.name", "rule name 'a' is used twice"),
    ("empty require", rule(action="require: []"), 6, "ops.attention.rules.0.require", "at least 1 item"),
    ("empty prefer", rule(action="prefer: []"), 6, "ops.attention.rules.0.prefer", "at least 1 item"),
    ("empty deny", rule(action="deny: []"), 6, "ops.attention.rules.0.deny", "at least 1 item"),
    ("prefer bad id", rule(action="prefer: [fast]"), 6, "ops.attention.rules.0.prefer", "'fast' is not an implementation id"),
    ("require bad id", rule(action="require: ['nvidia..cudnn']"), 6, "ops.attention.rules.0.require", "is not an implementation id"),
    ("pin glob", rule(action="pin: 'nvidia.*'"), 6, "ops.attention.rules.0.pin", "a pin names exactly one"),
    ("pin list", rule(action="pin: [cpu.flash]"), 6, "ops.attention.rules.0.pin", "must be a string"),
    ("pin bad id", rule(action="pin: cpu"), 6, "ops.attention.rules.0.pin", "'cpu' is not an implementation id"),
    ("conflicting pin and deny", rule(action="pin: cpu.flash\ndeny: [reference.math]"), 5, "ops.attention.rules.0",
     "pins 'cpu.flash' and also has deny"),
    ("conflicting pin and prefer", rule(action="pin: cpu.flash\nprefer: [cpu.flash]"), 5, "ops.attention.rules.0",
     "cannot be combined with other actions"),
    ("conflicting pin and require", rule(action="pin: cpu.flash\nrequire: [cpu.flash]"), 5, "ops.attention.rules.0",
     "pins 'cpu.flash' and also has require"),
    ("prefer and deny same", rule(action="prefer: [cpu.flash]\ndeny: [cpu.flash]"), 5, "ops.attention.rules.0",
     "both prefers and denies ['cpu.flash']"),
    ("require and deny same", rule(action="require: [cpu.flash]\ndeny: [cpu.flash]"), 5, "ops.attention.rules.0",
     "both requires and denies"),
    ("reason not a string", rule(action="deny: [cpu.flash]\nreason: [a]"), 7, "ops.attention.rules.0.reason", "must be a string"),
    ("when is a list", op("rules:\n  - name: r\n    when: [dtype]\n    deny: [cpu.flash]"), 6, "ops.attention.rules.0.when",
     "must be a mapping"),
    ("when unknown key", rule(when="dtyp: bf16"), 7, "ops.attention.rules.0.when.dtyp", "unknown key 'dtyp'"),
    ("when unknown key 2", rule(when="seq_len: 5"), 7, "ops.attention.rules.0.when.seq_len", "unknown key 'seq_len'"),
    # rules: device conditions
    ("arch bad range", rule(when="arch: '>=smX'"), 7, "ops.attention.rules.0.when.arch", "'smX' is not an arch with an order"),
    ("arch range unknown family", rule(when="arch: '>=ivcore11'"), 7, "ops.attention.rules.0.when.arch",
     "ranges work on 'smNN'"),
    ("arch mixed family", rule(when="arch: '>=sm80,<gfx942'"), 7, "ops.attention.rules.0.when.arch", "mixes families"),
    ("arch empty", rule(when="arch: ''"), 7, "ops.attention.rules.0.when.arch", "must be a string such as 'sm90'"),
    ("arch number", rule(when="arch: 90"), 7, "ops.attention.rules.0.when.arch", "must be a string such as 'sm90'"),
    ("arch bad name", rule(when="arch: 'SM 90'"), 7, "ops.attention.rules.0.when.arch", "is not an arch name"),
    ("arch empty list", rule(when="arch: []"), 7, "ops.attention.rules.0.when.arch", "must not be an empty list"),
    ("arch bad comparison", rule(when="arch: '>=>sm80'"), 7, "ops.attention.rules.0.when.arch", "is not an arch"),
    ("capability text", rule(when="capability: '>=eight'"), 7, "ops.attention.rules.0.when.capability",
     "compute capability 'eight' must look like '8.0'"),
    ("capability bool", rule(when="capability: true"), 7, "ops.attention.rules.0.when.capability",
     "must be a string such as '>=8.0'"),
    ("capability dict", rule(when="capability: {min: 8}"), 7, "ops.attention.rules.0.when.capability",
     "must be a string such as '>=8.0'"),
    ("capability three parts", rule(when="capability: '>=8.0.1'"), 7, "ops.attention.rules.0.when.capability",
     "must look like '8.0'"),
    ("vendor number", rule(when="vendor: 5"), 7, "ops.attention.rules.0.when.vendor", "5 is not a name"),
    ("vendor empty list", rule(when="vendor: []"), 7, "ops.attention.rules.0.when.vendor", "must not be an empty list"),
    ("device_type dict", rule(when="device_type: {a: 1}"), 7, "ops.attention.rules.0.when.device_type", "is not a name"),
    ("device_name number", rule(when="device_name: 100"), 7, "ops.attention.rules.0.when.device_name", "is not a glob"),
    ("libraries not a mapping", rule(when="libraries: cudnn"), 7, "ops.attention.rules.0.when.libraries",
     "libraries must be a non-empty mapping"),
    ("libraries empty", rule(when="libraries: {}"), 7, "ops.attention.rules.0.when.libraries", "non-empty mapping"),
    ("library bad range", rule(when="libraries: {cudnn: '>>9'}"), 7, "ops.attention.rules.0.when.libraries",
     "library version range '>>9' is not valid"),
    ("library bool", rule(when="libraries: {cudnn: true}"), 7, "ops.attention.rules.0.when.libraries",
     "must be 'installed', 'missing' or a version range"),
    ("library list", rule(when="libraries: {cudnn: [9]}"), 7, "ops.attention.rules.0.when.libraries",
     "must be 'installed', 'missing'"),
    ("library garbage", rule(when="libraries: {flag_gems: 'new-ish'}"), 7, "ops.attention.rules.0.when.libraries",
     "is not valid"),
    # rules: call conditions
    ("dtype unknown", rule(when="dtype: fp7"), 7, "ops.attention.rules.0.when.dtype", "unknown dtype 'fp7'"),
    ("dtype number", rule(when="dtype: 16"), 7, "ops.attention.rules.0.when.dtype", "must be a name such as 'bf16'"),
    ("dtype list with junk", rule(when="dtype: [bf16, half-ish]"), 7, "ops.attention.rules.0.when.dtype",
     "unknown dtype 'half-ish'"),
    ("dtype empty list", rule(when="dtype: []"), 7, "ops.attention.rules.0.when.dtype", "must not be an empty list"),
    ("layout number", rule(when="layout: 4"), 7, "ops.attention.rules.0.when.layout", "is not a name"),
    ("head_dim text", rule(when="head_dim: big"), 7, "ops.attention.rules.0.when.head_dim", "'big' in range 'big' is not"),
    ("head_dim bool", rule(when="head_dim: true"), 7, "ops.attention.rules.0.when.head_dim", "is not a number or range"),
    ("head_dim float", rule(when="head_dim: 64.5"), 7, "ops.attention.rules.0.when.head_dim", "is not a number or range"),
    ("head_dim bad op", rule(when="head_dim: '=>64'"), 7, "ops.attention.rules.0.when.head_dim", "is not an integer"),
    ("head_dim list junk", rule(when="head_dim: [64, x]"), 7, "ops.attention.rules.0.when.head_dim",
     "must be a non-empty list of integers"),
    ("head_dim empty list", rule(when="head_dim: []"), 7, "ops.attention.rules.0.when.head_dim", "non-empty list"),
    ("seqlen_q float range", rule(when="seqlen_q: '>=1.5k'"), 7, "ops.attention.rules.0.when.seqlen_q", "is not an integer"),
    ("seqlen_k dict", rule(when="seqlen_k: {min: 4}"), 7, "ops.attention.rules.0.when.seqlen_k", "is not a number"),
    ("batch text", rule(when="batch: many"), 7, "ops.attention.rules.0.when.batch", "is not an integer"),
    ("heads_q list of str", rule(when="heads_q: ['8']"), 7, "ops.attention.rules.0.when.heads_q", "list of integers"),
    ("heads_kv range junk", rule(when="heads_kv: '<=x'"), 7, "ops.attention.rules.0.when.heads_kv", "'x' in range"),
    ("gqa_ratio empty", rule(when="gqa_ratio: ''"), 7, "ops.attention.rules.0.when.gqa_ratio", "is not a comparison"),
    ("causal text", rule(when="causal: sometimes"), 7, "ops.attention.rules.0.when.causal", "must be true or false"),
    ("window number", rule(when="window: 128"), 7, "ops.attention.rules.0.when.window", "must be true or false"),
    ("softcap number", rule(when="softcap: 30"), 7, "ops.attention.rules.0.when.softcap", "must be true or false"),
    ("alibi list", rule(when="alibi: [true]"), 7, "ops.attention.rules.0.when.alibi", "must be true or false"),
    ("dropout text", rule(when="dropout: '0.1'"), 7, "ops.attention.rules.0.when.dropout", "must be true or false"),
    ("mask number", rule(when="mask: 1"), 7, "ops.attention.rules.0.when.mask", "must be true or false"),
    ("bias text", rule(when="bias: none"), 7, "ops.attention.rules.0.when.bias", "must be true or false"),
    ("varlen text", rule(when="varlen: thd"), 7, "ops.attention.rules.0.when.varlen", "must be true or false"),
    ("requires_grad text", rule(when="requires_grad: training"), 7, "ops.attention.rules.0.when.requires_grad",
     "must be true or false"),
    ("deterministic number", rule(when="deterministic: 0"), 7, "ops.attention.rules.0.when.deterministic",
     "must be true or false"),
    ("return_lse text", rule(when="return_lse: lse"), 7, "ops.attention.rules.0.when.return_lse", "must be true or false"),
    ("module number", rule(when="module: 3"), 7, "ops.attention.rules.0.when.module", "is not a glob"),
    ("module empty", rule(when="module: ''"), 7, "ops.attention.rules.0.when.module", "is not a glob"),
    ("layout typo", rule(when="layout: bsdh"), 7, "ops.attention.rules.0.when.layout", "did you mean 'bshd'"),
    ("layout list typo", rule(when="layout: [bshd, thdd]"), 7, "ops.attention.rules.0.when.layout",
     "'thdd' is not one of bhsd, bshd, sbhd, thd"),
    ("vendor typo", rule(when="vendor: nvida"), 7, "ops.attention.rules.0.when.vendor", "did you mean 'nvidia'"),
    ("device_type typo", rule(when="device_type: cdua"), 7, "ops.attention.rules.0.when.device_type",
     "did you mean 'cuda'"),
    ("arch empty range", rule(when="arch: '>=sm90,<sm80'"), 7, "ops.attention.rules.0.when.arch", "admits no arch"),
    ("arch name typo", rule(when="arch: sm9O"), 7, "ops.attention.rules.0.when.arch", "is not an arch"),
    ("capability empty", rule(when="capability: '>=9.0,<8.0'"), 7, "ops.attention.rules.0.when.capability",
     "admits no value"),
    ("library empty range", rule(when="libraries: {cudnn: '>=9,<8'}"), 7, "ops.attention.rules.0.when.libraries",
     "admits no version"),
    ("seqlen empty range", rule(when="seqlen_q: '>10,<5'"), 7, "ops.attention.rules.0.when.seqlen_q",
     "admits no value"),
    ("device_name unclosed glob", rule(when="device_name: '*H100['"), 7, "ops.attention.rules.0.when.device_name",
     "never closed"),
    ("module unclosed glob", rule(when="module: 'model.[a'"), 7, "ops.attention.rules.0.when.module", "never closed"),
    ("prefer duplicate", op("rules:\n  - name: a\n    prefer: [cpu.flash, cpu.flash]"), 6,
     "ops.attention.rules.0.prefer", "names 'cpu.flash' twice"),
    ("second rule bad", op("rules:\n  - name: ok\n    deny: [cpu.flash]\n  - name: bad\n    when:\n      arch: '>=smZ'\n"
                           "    deny: [cpu.flash]"), 9, "ops.attention.rules.1.when.arch", "'smZ' is not an arch"),
]


@pytest.mark.parametrize("name,text,line,field,message", CASES, ids=[c[0] for c in CASES])
def test_malformed_policy_names_file_line_and_field(tmp_path, name, text, line, field, message):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path, environ={})
    error = info.value
    text_out = str(error)
    assert text_out.startswith(f"{path}:"), text_out
    assert error.path == str(path)
    if line is not None:
        assert error.line == line, text_out
        assert text_out.startswith(f"{path}:{line}:"), text_out
    else:
        assert isinstance(error.line, int) and error.line >= 1, text_out
    assert error.field is not None and field in error.field, (error.field, text_out)
    assert message in text_out, text_out


def test_there_are_at_least_a_hundred_cases():
    assert len(CASES) >= 100


def test_policy_never_executes_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "p.yaml"
    path.write_text(f"ops: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(PolicyError):
        load_policy(path, environ={})
    assert not marker.exists()


def test_unknown_impl_ids_fail_in_strict_mode_with_file_and_line(tmp_path, basic_manager):
    path = tmp_path / "strict.yaml"
    path.write_text("settings:\n  strict: true\nops:\n  attention:\n    order: [cpu.flash, nvidia.cudnnn]\n"
                    "    rules:\n      - name: r\n        deny: ['vendorx.*']\n")
    with pytest.raises(PolicyError) as info:
        basic_manager.set_policy(path)
    text = str(info.value)
    assert f"{path}:5: order 'nvidia.cudnnn'" in text and f"{path}:8: rule 'r' deny 'vendorx.*'" in text
    assert "Registered: cpu.flash, reference.math" in text


def test_unknown_impl_ids_are_tolerated_without_strict(tmp_path, basic_manager):
    path = tmp_path / "lenient.yaml"
    path.write_text("ops:\n  attention:\n    order: [nvidia.cudnn, cpu.flash]\n")
    basic_manager.set_policy(path)  # another machine may have the nvidia plugin: not an error
    import torch

    q = torch.randn(1, 4, 2, 8)
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"


def test_bad_option_value_names_the_option(tmp_path, manager):
    path = tmp_path / "opts.yaml"
    path.write_text("ops:\n  attention:\n    options:\n      rocm.aotriton: {fa_library: turbo}\n")
    with pytest.raises(PolicyError) as info:
        manager.set_policy(path)
    assert f"{path}:4: field ops.attention.options.rocm.aotriton" in str(info.value)
    assert "fa_library" in str(info.value)


def test_bad_env_override_is_an_error(monkeypatch):
    monkeypatch.setenv("OPDISPATCH_DENY", "cpu.flash,notanid")
    with pytest.raises(PolicyError, match=r"OPDISPATCH_DENY='cpu.flash,notanid': 'notanid' is not an implementation id"):
        load_policy()
    monkeypatch.delenv("OPDISPATCH_DENY")
    monkeypatch.setenv("OPDISPATCH_IMPL_CONV", "cpu.flash")
    with pytest.raises(PolicyError, match=r"OPDISPATCH_IMPL_CONV='cpu.flash': unknown op 'conv'"):
        load_policy()


def test_missing_policy_file(tmp_path):
    with pytest.raises(PolicyError, match=r"cannot read policy file .*nope.yaml.*No such file"):
        load_policy(tmp_path / "nope.yaml", environ={})
