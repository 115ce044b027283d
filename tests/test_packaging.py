"""pyproject.toml declares every package that srt imports, each with a lower bound that the
installed version meets."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# Imported by srt but installed by another declared package rather than declared itself.
COMES_WITH = {"triton": "torch (its CUDA wheels pin the matching triton)"}
# The distribution of a module that may not be installed here (optional accelerator packages).
DISTRIBUTION = {"flashinfer": "flashinfer-python"}


def imported_top_level_modules() -> set[str]:
    names = set()
    for path in (REPO / "srt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "srt"}


def declared() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {_norm(r.name): r for r in map(Requirement, reqs)}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def test_every_imported_package_is_declared() -> None:
    deps = declared()
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module in sorted(imported_top_level_modules() - set(COMES_WITH)):
        names = {_norm(d) for d in dists.get(module, [DISTRIBUTION.get(module, module)])}
        if not names & set(deps):
            missing.append(f"{module} (from {sorted(names)})")
    assert not missing, f"imported by srt, not in pyproject.toml: {missing}"


def test_runtime_dependencies_have_lower_bounds_met_here() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for req in map(Requirement, project["dependencies"]):
        lower = [s for s in req.specifier if s.operator in (">=", "==", "~=")]
        assert lower, f"{req.name} has no lower bound"
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), (req, installed)
