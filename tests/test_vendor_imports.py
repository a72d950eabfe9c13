"""Built-in vendors are plugins like any other: they import only opdispatch's public names, the public toolkit
for plugin authors (`opdispatch.plugins.toolkit`), their own package's modules and third-party libraries — never
opdispatch's private modules and never another vendor."""

from __future__ import annotations

import ast

from tests.conftest import REPO

PUBLIC = {"opdispatch", "opdispatch.plugins", "opdispatch.plugins.toolkit", "opdispatch.plugins.hookspec"}


def _violations(path):
    vendor = path.parent.name
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: must stay inside the vendor's own package
                if node.level > 1:
                    yield node.lineno, f"from {'.' * node.level}{node.module or ''} (leaves the {vendor} package)"
                continue
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if not name.startswith("opdispatch"):
                continue
            if name.startswith("opdispatch.vendors."):
                if name.split(".")[2] != vendor:
                    yield node.lineno, f"{name} (another vendor)"
            elif name not in PUBLIC:
                yield node.lineno, f"{name} (private to opdispatch; use opdispatch or opdispatch.plugins.toolkit)"


def test_vendors_import_only_public_opdispatch_modules():
    files = sorted((REPO / "vendors" / "opdispatch" / "vendors").glob("*/*.py"))
    assert len(files) > 15
    bad = [f"{path.relative_to(REPO)}:{line}: {what}" for path in files for line, what in _violations(path)]
    assert bad == []


def test_the_rule_catches_a_private_and_a_cross_vendor_import(tmp_path):
    pkg = tmp_path / "vendors" / "acme"
    pkg.mkdir(parents=True)
    bad = pkg / "_attention.py"
    bad.write_text("from opdispatch.ops._attention import shift_rows\nimport opdispatch.vendors.nvidia._attention\n"
                   "from ..nvidia import x\nfrom opdispatch.plugins.toolkit import shift_rows\nfrom ._rms import y\n")
    assert [line for line, _ in _violations(bad)] == [1, 2, 3]
