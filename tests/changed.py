"""The test files a change can reach, for `make test-changed`: a quick loop, not a replacement for
`make test` (CI runs everything).

    python -m tests.changed [--base REV]

prints the test files to run, one a line, or `tests` when everything must run, and says on stderr
how many it picked and why. The changed files are those since the merge-base with `main` (or REV),
committed, staged, unstaged or untracked (deleted ones count). Each rule below falls back to
everything when it cannot tell:

- a Python file under src/ or tests/ selects the test files whose reach holds it. A test file's
  reach is its import closure (distft and tests.* modules, the packages above each, the CLI's
  `COMMANDS`, the conftest.py files above it) plus the strategies it names;
- a file under docs/ or configs/, or a Markdown file at the top, selects the test files that
  name it (its path or file name) or its top folder alone in a string literal (`ROOT / "configs"`,
  then a glob), themselves or in a test module they reach;
- anything else (pyproject.toml, the Makefile, .ci, scripts, data files in src) selects everything.

Strategies are plug-ins. The registry imports every strategy module, and the planner and the
measurements import some of them for a constant or a type (`plan/counts.py` reads
`tensor_parallel.COLUMN`); following those edges would make every test depend on every strategy.
So a strategy's modules (its class's and its bases', under distft) are reached only from another
strategy module (`fsdp_tp.py` imports `tensor_parallel.py`), from a test module's own import, or
through a name: a test module that names a strategy in a string literal, as a whole token
("--strategy tp", "parallel.strategy=fsdp+tp"; "fsdp+tp" is neither "tp" nor "fsdp"), reaches its
modules and their closure, and one that mentions `STRATEGIES`, `SPECS` or `strategy_table` reaches
every strategy. tests/test_changed.py checks that each strategy is reached by name somewhere.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tests.test_architecture import SRC, distft_imports, module_name

ROOT = SRC.parent
TESTS = ROOT / "tests"
EVERYTHING = "tests"  # what pytest is given when everything runs
NAMED_FILES = ("docs/", "configs/")  # changed files that tests read by name
REGISTRY_NAMES = {"STRATEGIES", "SPECS", "strategy_table"}  # a test that iterates the registry


class Unsure(Exception):
    """The selection cannot be trusted (a file does not parse, git fails): run everything."""


@dataclass
class Selection:
    """The test files a change reaches (paths from the checkout's root), or everything."""

    files: set[str] = field(default_factory=set)
    everything: bool = False
    why: list[str] = field(default_factory=list)  # each fallback's reason, for stderr

    def run_all(self, reason: str) -> None:
        self.everything = True
        self.why.append(reason)


# ---- the graph: modules, their imports, the strategies' modules --------------------------------


@dataclass(frozen=True)
class Module:
    """A module's file and its syntax tree, parsed once."""

    path: Path
    tree: ast.Module


@cache
def modules() -> dict[str, Module]:
    """Every module of src/distft and tests/, by dotted name (`distft.train.loop`, `tests.helpers`)."""
    found = {}
    for path in sorted([*(SRC / "distft").rglob("*.py"), *TESTS.rglob("*.py")]):
        name = module_name(path) if path.is_relative_to(SRC) else module_name(path, ROOT)
        try:
            found[name] = Module(path, ast.parse(path.read_text(encoding="utf-8")))
        except SyntaxError as err:
            raise Unsure(f"{path.relative_to(ROOT)} does not parse ({err.msg}, line {err.lineno})") from err
    return found


@cache
def imports(name: str) -> frozenset[str]:
    """The modules `name` imports, anywhere in it. `from a.b import c` imports a.b.c when that is a
    module, else a.b; a name that is no module (a deleted file's) counts as both."""
    module = modules()[name]
    found = set()
    targets = distft_imports(module.tree, name, module.path.name == "__init__.py", ("distft", "tests"))
    for target, _, _ in targets:
        found |= {target} if target in modules() else {target, target.rpartition(".")[0]}
    return frozenset(found)


@cache
def strategy_classes() -> dict[str, list[type]]:
    """Each registered strategy's name -> its class and the bases it is built on, under distft."""
    try:
        import distft
        from distft.parallel.base import Strategy
        from distft.parallel.registry import STRATEGIES
    except Exception as err:  # a broken or deleted strategy module: the registry does not import
        raise Unsure(f"the strategy registry does not import ({type(err).__name__}: {err})") from err
    if not Path(distft.__file__).is_relative_to(SRC):
        raise Unsure(f"distft is imported from {Path(distft.__file__).parent}, not from {SRC}")
    return {
        name: [c for c in cls.__mro__ if c.__module__.startswith("distft.") and c is not Strategy]
        for name, cls in STRATEGIES.items()
    }


@cache
def strategy_modules() -> dict[str, set[str]]:
    """Each strategy's name -> the modules of its class and of its bases (`hsdp+tp`: hsdp_tp.py,
    fsdp_tp.py, tp_experts.py); `Strategy`'s own module, the seam every one shares, is no plug-in."""
    return {name: {c.__module__ for c in classes} for name, classes in strategy_classes().items()}


def named_strategies(tree: ast.Module) -> set[str]:
    """The strategies a test module names in a string literal, as a whole token, and every one if it
    mentions the registry."""
    names = {n for node in ast.walk(tree) for n in (getattr(node, "id", None), getattr(node, "attr", None))}
    names |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    if names & REGISTRY_NAMES:
        return set(strategy_modules())
    return strategies_named_in(literals(tree))


def strategies_named_in(strings: list[str]) -> set[str]:
    text = "\n".join(strings)
    return {name for name in strategy_modules() if re.search(token(name), text)}


def token(word: str) -> str:
    """A regex for `word` standing alone: not inside `fsdp+tp`, `tp-sp`, `ddp_pp`, `model.tp`."""
    return rf"(?<![\w+\-.]){re.escape(word)}(?![\w+\-])"


def literals(tree: ast.Module) -> list[str]:
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@cache
def edges(name: str) -> frozenset[str]:
    """What running module `name` runs next: its package, its imports and, for a test module, the
    strategies it names and the modules it names whole ("-m", "tests.rank_probe"). Edges into a
    strategy's modules are kept only from strategy modules and from tests."""
    if name not in modules():
        return frozenset()  # a name in a module (`distft.cli.main`), or a deleted file
    plugins = set().union(*strategy_modules().values())
    found = set(imports(name))
    if name.startswith("distft.") and name not in plugins:
        found -= plugins
    if name.startswith("tests"):
        tree = modules()[name].tree
        for strategy in named_strategies(tree):
            found |= strategy_modules()[strategy]
        found |= set(literals(tree)) & set(modules())
    if "." in name:
        found.add(name.rpartition(".")[0])  # importing a.b runs a/__init__.py first
    return frozenset(found)


def conftests(test_file: Path) -> set[str]:
    """The conftest.py modules pytest loads for `test_file`: the one in each folder above it."""
    return {
        module_name(folder / "conftest.py", ROOT)
        for folder in test_file.parents
        if folder.is_relative_to(TESTS) and (folder / "conftest.py").is_file()
    }


@cache
def reach(test: str) -> frozenset[str]:
    """The modules a test module can run: its closure over `edges`, its conftest.py files' with it."""
    seen: set[str] = set()
    todo = [test, *conftests(modules()[test].path)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges(name) - seen)
    return frozenset(seen)


@cache
def all_test_files() -> dict[str, str]:
    """Every test file pytest collects, as a path from the root -> its module's name."""
    return {
        module.path.relative_to(ROOT).as_posix(): name
        for name, module in modules().items()
        if name.startswith("tests") and module.path.name.startswith("test_")
    }


# ---- the selection -------------------------------------------------------------------------------


def select(changed: Iterable[str]) -> Selection:
    """The test files that `changed` (paths from the checkout's root, deleted ones included) reach."""
    selection = Selection()
    try:
        for path in sorted(set(changed)):
            select_one(path, selection)
    except Unsure as err:
        selection.run_all(str(err))
    return selection


def select_one(path: str, selection: Selection) -> None:
    if path.endswith(".py") and path.startswith(("src/distft/", "tests/")):
        file = ROOT / path
        name = module_name(file) if file.is_relative_to(SRC) else module_name(file, ROOT)
        found = {test for test, module in all_test_files().items() if name in reach(module)}
        if not found and file.is_file():  # run some other way than by import: unsure
            selection.run_all(f"{path}: no test file imports it")
        selection.files |= found
    elif path.startswith(NAMED_FILES) or ("/" not in path and path.endswith(".md")):
        selection.files |= mentions(path)
    else:
        selection.run_all(f"{path}: neither a module, a doc nor a config, so any test may depend on it")


def mentions(path: str) -> set[str]:
    """The test files that reach a tests.* module whose string literals name `path`, its file name,
    or its top folder alone."""
    top = path.split("/")[0]
    words = [token(path), token(Path(path).name)]
    readers = set()
    for name, module in modules().items():
        strings = literals(module.tree) if name.startswith("tests") else []
        text = "\n".join(strings)
        if any(re.search(word, text) for word in words) or {top, f"{top}/"} & set(strings):
            readers.add(name)
    return {test for test, name in all_test_files().items() if reach(name) & readers}


# ---- git and the command line --------------------------------------------------------------------


def git(*args: str) -> list[str]:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = (getattr(err, "stderr", None) or str(err)).strip()
        raise Unsure(f"git {' '.join(args)} failed ({detail})") from err
    return [line for line in done.stdout.splitlines() if line]


def changed_files(base: str) -> list[str]:
    """Files that differ from the merge-base of HEAD and `base` (committed, staged, unstaged,
    deleted), and untracked files git does not ignore. A rename is a deletion and an addition."""
    merge_base = git("merge-base", base, "HEAD")[0]
    committed_or_not = git("diff", "--name-only", "--no-renames", merge_base)  # against the work tree
    return sorted({*committed_or_not, *git("ls-files", "--others", "--exclude-standard")})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.changed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", metavar="REV", help="compare with its merge-base (main)")
    base = parser.parse_args(argv).base
    try:
        changed = changed_files(base)
    except Unsure as err:
        changed, selection = [], Selection(everything=True, why=[str(err)])
    else:
        if not changed:
            print(
                f"test-changed: nothing changed since the merge-base with {base}: no tests to run",
                file=sys.stderr,
            )
            return 0
        selection = select(changed)
    for reason in selection.why:
        print(f"test-changed: {reason}: running every test file", file=sys.stderr)
    if selection.everything:
        print(EVERYTHING)
    else:
        counts = f"{len(selection.files)} of {len(all_test_files())} test files"
        files = f"{len(changed)} changed file{'s' * (len(changed) != 1)}"
        print(f"test-changed: {files} since {base} reach {counts}", file=sys.stderr)
        for test in sorted(selection.files):
            print(test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
