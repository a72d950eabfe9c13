"""One import package `opdispatch` assembled from the top-level folders: every subpackage is listed, importable,
and shipped (with the YAML configs, py.typed and the entry points) in a real wheel."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]
PACKAGE_DIR = PYPROJECT["tool"]["setuptools"]["package-dir"]


def _folder_of(package: str) -> Path:
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in PACKAGE_DIR:
            return REPO / PACKAGE_DIR[prefix] / Path(*parts[i:])
    raise AssertionError(f"{package} has no package-dir mapping")


def _source_packages() -> set[str]:
    """Every folder with an __init__.py under the mapped top-level folders, as a dotted package name."""
    found = set()
    for package, folder in PACKAGE_DIR.items():
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    return found


def test_every_source_package_is_listed_in_pyproject():
    assert _source_packages() == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_subpackage_is_importable_from_its_folder(package):
    module = importlib.import_module(package)
    assert Path(module.__file__).resolve().parent == _folder_of(package).resolve()


def test_top_level_layout_is_exactly_as_specified():
    assert PACKAGE_DIR == {"opdispatch": "core/opdispatch", "opdispatch.plugins": "plugins/opdispatch/plugins",
                           "opdispatch.policies": "policies/opdispatch/policies",
                           "opdispatch.vendors": "vendors/opdispatch/vendors", "opdispatch.configs": "configs"}


@pytest.mark.parametrize("package", [p for p in PACKAGES if not p.startswith("opdispatch.configs")])
def test_every_code_folder_path_is_its_import_path(package):
    """Each top-level folder holds its part of the package under its import name, so a tool that reads paths
    resolves `opdispatch.plugins.toolkit` to plugins/opdispatch/plugins/toolkit.py (configs/ is YAML data)."""
    top = _folder_of(package).relative_to(REPO).parts[0]
    assert _folder_of(package) == REPO / top / Path(*package.split("."))


@pytest.mark.parametrize("folder", ["plugins", "policies", "vendors"])
def test_the_name_folders_above_a_part_are_not_packages(folder):
    """plugins/opdispatch/ is only a name on the path: an __init__.py there would be a second `opdispatch`."""
    assert not (REPO / folder / "opdispatch" / "__init__.py").exists()


@pytest.mark.slow
def test_a_real_wheel_ships_everything(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(tmp_path), str(REPO)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("opdispatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in PACKAGES:
        assert "/".join(package.split(".")) + "/__init__.py" in names, package
    assert "opdispatch/py.typed" in names and "opdispatch/base/_native.cpp" in names  # opdispatch build compiles it
    for folder in ("core", "plugins", "policies", "vendors"):  # every module of every layer, at its folder path
        for source in (REPO / folder).rglob("*.py"):
            assert source.relative_to(REPO / folder).as_posix() in names, source
    assert "opdispatch/configs/default.yaml" in names
    assert {f"opdispatch/configs/devices/{d}.yaml" for d in ("h100", "mi300x", "bi-v150", "p800", "cpu")} <= names
    assert "opdispatch/plugins/hookspec.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[opdispatch.plugins]" in text and "reference = opdispatch.vendors.reference" in text
    assert "opdispatch = opdispatch.tools._cli:main" in text
