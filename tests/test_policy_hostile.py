"""Hostile and large policy files: alias bombs, recursive aliases, deep nesting, bad encodings and stray control
characters are refused with file:line errors; a large policy parses once, quickly."""

from __future__ import annotations

import time

import pytest

from opdispatch import PolicyError
from opdispatch.policies import parse_policy
from opdispatch.policies._policy import read_policy_file


def _bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + f"\nops:\n  attention:\n    order: *a{levels}\n"


def test_an_alias_bomb_is_refused_before_it_expands():
    text = _bomb(7)  # 10^8 nodes once expanded, from a few hundred bytes
    assert len(text) < 600
    start = time.perf_counter()
    with pytest.raises(PolicyError, match=r"<bomb>:7: .*expands to more than 2,000,000 nodes through aliases"):
        parse_policy(text, "<bomb>")
    assert time.perf_counter() - start < 2.0  # refused while counting, not after expanding


def test_a_small_alias_is_still_fine():
    policy = parse_policy("ops:\n  attention:\n    order: &cpu [cpu.flash, reference.math]\n    rules:\n"
                          "      - name: r\n        prefer: *cpu\n", "<a>")
    assert policy.model.ops["attention"].rules[0].prefer == ["cpu.flash", "reference.math"]


def test_a_recursive_alias_is_refused_with_its_line():
    with pytest.raises(PolicyError, match=r"<rec>:2: .*recursive alias"):
        parse_policy("ops:\n  attention: &a\n    order: [*a]\n", "<rec>")


@pytest.mark.parametrize("depth, message", [(500, "nests deeper than 200 levels"),
                                            (3000, "<deep>:1: invalid YAML: .*nesting depth|nests deeper")])
def test_deep_nesting_is_refused_not_a_crash(depth, message):
    text = "ops: " + "[" * depth + "]" * depth + "\n"
    with pytest.raises(PolicyError, match=message):
        parse_policy(text, "<deep>")


def test_encoding_and_control_characters(tmp_path):
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("# caf\xe9\nops: {}\n".encode("latin-1"))
    with pytest.raises(PolicyError, match=r"latin1.yaml:1: the policy file is not UTF-8 text \(byte 0xe9 at offset "
                                          r"5\); save it as UTF-8"):
        read_policy_file(latin)
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"version: 1\nops:\n  attention:\x00\n")
    with pytest.raises(PolicyError, match=r"nul.yaml:3: invalid YAML: character '\\x00' at offset 28 is not allowed"):
        read_policy_file(nul)


def test_a_20000_rule_policy_parses_in_seconds(tmp_path):
    rules = "".join(f"      - name: r{i}\n        when: {{head_dim: {i % 512}}}\n        prefer: [cpu.flash]\n"
                    for i in range(20000))
    path = tmp_path / "big.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n" + rules, encoding="utf-8")
    start = time.perf_counter()
    layer = read_policy_file(path)
    elapsed = time.perf_counter() - start
    assert len(layer.model.ops["attention"].rules) == 20000
    assert layer.where("ops", "attention", "rules", 19999) == f"{path}:{5 + 3 * 19999}"
    print(f"20,000 rules: {elapsed:.2f} s")  # the figure; no timed pass/fail
