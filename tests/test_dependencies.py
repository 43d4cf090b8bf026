"""pyproject.toml's dependencies are true: every installed one meets its floor (a floor above the
installed version means the suite never ran on what it promises), and every third-party package
that src/distft imports, at module level or inside a function, is declared, as a dependency or in
an extra; and constraints.txt, the versions `make install` takes, pins each of them within its range,
as installed here."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def key(name: str) -> str:
    """A distribution name as the index compares them (PEP 503): `rouge_score` is `rouge-score`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> list[Requirement]:
    extras = PROJECT.get("optional-dependencies", {}).values()
    return [Requirement(r) for r in [*PROJECT["dependencies"], *(r for group in extras for r in group)]]


def imported_top_level_names() -> dict[str, str]:
    """Every top-level name src/distft imports (absolute imports) -> the first file:line doing so."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "distft").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_installed_versions_meet_the_floors():
    below = []
    for req in declared():
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # an extra not installed here (wandb, mlflow, trackio)
        if not req.specifier.contains(version, prereleases=True):
            below.append(f"{req.name} {version} is installed; pyproject.toml requires {req}")
    assert not below, "\n".join(below)


def test_the_python_floor_holds_here():
    floor = PROJECT["requires-python"].removeprefix(">=")
    assert sys.version_info >= tuple(int(p) for p in floor.split(".")), PROJECT["requires-python"]


def test_every_third_party_import_is_declared():
    names = {key(r.name) for r in declared()}
    distributions = metadata.packages_distributions()  # import name -> the distributions providing it
    missing = []
    for module, where in sorted(imported_top_level_names().items()):
        if module == "distft" or module in sys.stdlib_module_names:
            continue
        # An import name no installed distribution provides (an extra not installed here): the
        # name itself, as wandb, mlflow and trackio are published.
        provided_by = distributions.get(module, [module])
        if not any(key(dist) in names for dist in provided_by):
            missing.append(f"{module} ({where}): from {', '.join(provided_by)}, not in pyproject.toml")
    assert not missing, "imported by src/distft but not declared:\n" + "\n".join(missing)


def pins() -> dict[str, str]:
    """constraints.txt as {distribution key: version}."""
    lines = (line.split("#")[0].strip() for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines())
    return {key(name): version for name, version in (line.split("==") for line in lines if line)}


def test_constraints_pin_every_declared_package_within_its_range_as_installed():
    pinned, wrong = pins(), []
    for req in declared():
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if key(req.name) == "torch":  # pinned in the Makefile: the CPU or the CUDA build, by the machine
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # an extra not installed here (wandb, mlflow, trackio): left to the user's pip
        version = pinned.get(key(req.name))
        if version is None:
            wrong.append(f"{req.name}: not pinned in constraints.txt")
        elif not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req.name}=={version} (constraints.txt) is outside pyproject.toml's {req}")
        elif installed != version:
            wrong.append(
                f"{req.name} {installed} is installed; constraints.txt pins {version} (make install)"
            )
    assert not wrong, "\n".join(wrong)
