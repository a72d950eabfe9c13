"""The typing stub of ``import opdispatch`` (core/opdispatch/__init__.pyi) is generated from the ops' argument definitions, and a
user's mypy reads it: a wrong argument name or type fails, correct calls type their returns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

STUB = REPO / "core" / "opdispatch" / "__init__.pyi"

GOOD = """\
import torch

import opdispatch

q = torch.zeros(1, 2, 3, 4)
out: torch.Tensor = opdispatch.attention(q, q, q, causal=True, window=(4, 0))
out2, lse = opdispatch.attention(q, q, q, return_lse=True)
y: torch.Tensor = opdispatch.rms_norm(q)
y2, h2 = opdispatch.rms_norm(q, None, 1e-6, q)
y3, h3 = opdispatch.rms_norm(q, residual=q)
qo, ko = opdispatch.rotary_embedding(q, q, q, q, interleaved=True)
packed: torch.Tensor = opdispatch.attention_packed(q, layout="bs3hd", causal=True)
decision: opdispatch.Decision = opdispatch.explain(q, q, q, causal=True)
either = opdispatch.attention(q, q, q, return_lse=bool(q.numel()))
reveal_type(either)
"""

BAD = {
    'opdispatch.attention(q, q, q, causal="yes", no_such_argument=1)':
        'Unexpected keyword argument "no_such_argument" for overloaded function "attention"',
    'opdispatch.attention(q, q, q, causal="yes")': 'No overload variant of "attention" matches argument types',
    "opdispatch.rms_norm(q, epsilon=1e-5)": 'Unexpected keyword argument "epsilon" for overloaded function "rms_norm"',
    "opdispatch.rotary_embedding(q, q, q)": 'Missing positional argument "sin" in call to "rotary_embedding"',
    "opdispatch.explain_rms_norm(q, device=3)": 'Argument "device" to "explain_rms_norm" has incompatible type "int"',
    "opdispatch.attention_packed(q, causal=True)": 'No overload variant of "attention_packed" matches',
    "t: torch.Tensor = opdispatch.rms_norm(q, residual=q)": "Incompatible types in assignment",
}


def test_the_checked_in_stub_is_generated_from_the_definitions():
    from opdispatch.tools._stubs import init_stub

    assert STUB.read_text() == init_stub(), \
        "core/opdispatch/__init__.pyi is stale: regenerate it with `opdispatch stubs > core/opdispatch/__init__.pyi`"


def test_every_door_made_from_an_op_definition_is_typed_in_the_stub():
    from opdispatch.tools._stubs import stub_functions

    typed = set(stub_functions())
    assert {"attention", "attention_packed", "rms_norm", "rotary_embedding", "explain", "explain_rms_norm",
            "explain_rotary_embedding", "plan"} <= typed
    text = STUB.read_text()
    assert all(f"def {name}(" in text for name in typed)


def _link_tree(root: Path) -> Path:
    """The package as it imports (core/opdispatch/ is `opdispatch`, plugins/opdispatch/plugins/ `opdispatch.plugins`…),
    as .ci/typecheck builds it."""
    package = root / "opdispatch"
    package.mkdir(parents=True)
    for f in (REPO / "core" / "opdispatch").iterdir():
        (package / f.name).symlink_to(f)
    for d in ("plugins", "policies", "vendors"):
        (package / d).symlink_to(REPO / d / "opdispatch" / d)
    (package / "configs").symlink_to(REPO / "configs")
    return root


def _mypy(tmp_path: Path, source: str, *, mypypath: Path | None) -> str:
    pytest.importorskip("mypy", reason="mypy is in the lint extra: pip install -e '.[lint]'")
    user = tmp_path / "user_code.py"
    user.write_text(source)
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    if mypypath is not None:
        env["MYPYPATH"] = str(mypypath)
    cache = REPO / "build" / "mypy-user-cache"  # torch's types are read once, not per test run
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
                             "--python-executable", sys.executable, "--cache-dir", str(cache), str(user)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    return result.stdout + result.stderr


def _check_user_code(tmp_path: Path, mypypath: Path | None) -> None:
    good = _mypy(tmp_path, GOOD, mypypath=mypypath)
    lines = [line for line in good.splitlines() if line.strip()]
    assert lines == [f"user_code.py:{GOOD.count(chr(10))}: note: Revealed type is "
                     '"torch._tensor.Tensor | tuple[torch._tensor.Tensor, torch._tensor.Tensor]"'], good
    header = "import torch\n\nimport opdispatch\n\nq = torch.zeros(1, 2, 3, 4)\n"
    bad = _mypy(tmp_path, header + "\n".join(BAD) + "\n", mypypath=mypypath)
    for number, (call, message) in enumerate(BAD.items(), start=header.count("\n") + 1):
        errors = [line for line in bad.splitlines() if line.startswith(f"user_code.py:{number}: error:")]
        assert any(message in line for line in errors), f"{call!r}: expected {message!r}, mypy said:\n{bad}"


@pytest.mark.slow
def test_a_users_mypy_rejects_wrong_arguments_and_types_returns(tmp_path):
    _check_user_code(tmp_path, _link_tree(tmp_path / "tree"))


@pytest.mark.slow
def test_the_installed_package_is_visible_to_mypy(tmp_path):
    """Through the install itself: a wheel, or `pip install -e . --config-settings editable_mode=strict` (the default
    editable mode installs an import hook, which type checkers cannot follow)."""
    probe = _mypy(tmp_path, "import opdispatch\n", mypypath=None)
    if 'Cannot find implementation or library stub for module named "opdispatch"' in probe:
        pytest.skip("opdispatch is installed editable in setuptools' default (import-hook) mode, invisible to type "
                    "checkers; reinstall with `pip install -e . --config-settings editable_mode=strict`")
    _check_user_code(tmp_path, None)
