"""What the wheel installs: the runtime packages only (issue 19 §5).

The package list is the one setuptools computes from pyproject.toml's
``[tool.setuptools] packages.find`` (what ``pip install .`` puts in site-packages); and no
runtime module imports bench/, tests/ or testing/, which are not installed."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import setuptools

REPO = Path(__file__).resolve().parent.parent
RUNTIME = {"agent", "infra", "p2p", "scheduler_link", "manifests", "placer", "cli"}
NOT_INSTALLED = {"bench", "tests", "testing"}


def installed_packages() -> list[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return setuptools.find_packages(where=str(REPO), include=cfg.get("include", ["*"]),
                                    exclude=cfg.get("exclude", ()))


def test_the_wheel_holds_the_runtime_packages_only():
    pkgs = installed_packages()
    top = {p.split(".")[0] for p in pkgs}
    assert top == RUNTIME, top
    # every runtime package with an __init__ is in (no subpackage left out)
    for root in RUNTIME:
        for init in (REPO / root).rglob("__init__.py"):
            dotted = ".".join(init.parent.relative_to(REPO).parts)
            assert dotted in pkgs, dotted
    assert "cli" in pkgs and (REPO / "cli" / "localcluster.py").exists()   # herd demo's harness stays in cli/


def test_runtime_code_imports_nothing_that_is_not_installed():
    bad: list[str] = []
    for root in sorted(RUNTIME):
        for path in (REPO / root).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                        if n.split(".")[0] in NOT_INSTALLED]
    assert bad == [], bad


def test_the_console_script_points_into_an_installed_package():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module = target.split(":")[0]
        assert module.split(".")[0] in RUNTIME, target
