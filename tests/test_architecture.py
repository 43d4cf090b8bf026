"""The import graph is one-way: a test fails on a cycle, on an import against the layers, and on a
function-level distft import (which is how cycles hide). One exception, by design: the CLI imports
a command's module when that command runs (`distft.cli.COMMANDS`), and the tests read that table as
the CLI's imports. Lazy imports of heavy third-party modules inside functions stay allowed.
docs/architecture.md draws the same layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lower layers never import higher ones; a package may import its own modules. Keep in step with
# docs/architecture.md.
LAYERS = {
    "distft.errors": 0,
    "distft.tensors": 0,
    "distft.hub": 0,
    "distft.signals": 0,  # SIGINT/SIGTERM: stop at a step boundary (the loop, the launcher, the CLI)
    "distft.textfiles": 0,  # what a file's bytes look like (UTF-16, Parquet, binary), for errors that say so
    "distft.text": 0,  # counts in what is printed: "1 step", "2 steps"
    "distft.host_memory": 0,  # CPU tensors: glibc's malloc keeps what a step frees
    "distft.config": 1,
    "distft.exits": 1,  # how every command ends: one line and an exit code
    "distft.model": 2,
    "distft.data": 2,
    "distft.distributed": 2,
    "distft.layout": 2,  # a run's layout, described once: mesh dimensions, strategy specs, their rules (no torch)
    "distft.io": 3,
    "distft.health": 3,  # pre-flight checks: the environment, a roll call, all-reduce timings
    "distft.launch": 3,  # torchrun: ranks exec'd (CUDA) or forked from the caller (CPU)
    "distft.parallel": 4,
    "distft.measure": 5,
    "distft.plan": 6,  # below train: a run's expected bytes are the planner's formula
    "distft.commands": 6,  # every command's flags, light (no torch): the commands above read their defaults
    "distft.train": 7,
    "distft.infer": 8,
    "distft.bench": 9,
    "distft.export": 9,  # on top of distft.infer (8), whose load_trained it reuses
    "distft.doctor": 9,  # the health check alone, with plan's byte units (6) and the hooks of train (7)
    "distft.export_gguf": 10,  # --format gguf: on top of distft.export (9), whose check_run and merged_model it reuses
    "distft.export_command": 11,  # `distft export`: either format, on top of distft.export_gguf (10)
    "distft.cli": 12,
    "distft.__main__": 13,
}


def module_name(path: Path, root: Path = SRC) -> str:
    """The dotted name of the module at `path`, a file under `root` (tests/changed.py: `root` the checkout)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def distft_imports(
    tree: ast.AST, name: str, is_package: bool, packages: tuple[str, ...] = ("distft",)
) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level?) for every import of distft (or of `packages`:
    tests/changed.py follows `tests` too)."""
    found = []
    package = name if is_package else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]  # a module or a name in one
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target.partition(".")[0] in packages:
                found.append((target, node.lineno, id(node) in top_level))
    if name == "distft.cli":  # each command's module, imported when it runs: checked as a top-level import
        found += command_modules(tree)
    return found


def command_modules(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """The modules of the CLI's `COMMANDS` table ("module:function" per command)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["COMMANDS"]:
            return [(value.value.partition(":")[0], value.lineno, True) for value in node.value.values]
    raise AssertionError("distft.cli has no COMMANDS table")


def modules() -> dict[str, tuple[Path, ast.AST]]:
    return {
        module_name(p): (p, ast.parse(p.read_text(encoding="utf-8")))
        for p in sorted((SRC / "distft").rglob("*.py"))
    }


def layer_of(module: str) -> tuple[str, int]:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and docs/architecture.md)")


def test_no_function_level_distft_imports():
    lazy = [
        f"{path.relative_to(SRC)}:{line} imports {target} inside a function"
        for name, (path, tree) in modules().items()
        for target, line, top in distft_imports(tree, name, path.name == "__init__.py")
        if not top
    ]
    assert not lazy, "\n".join(lazy)


def test_imports_follow_the_layers():
    wrong = []
    for name, (path, tree) in modules().items():
        if name == "distft":
            continue
        package, layer = layer_of(name)
        for target, line, _ in distft_imports(tree, name, path.name == "__init__.py"):
            target_package, target_layer = layer_of(target)
            if target_package != package and target_layer >= layer:
                wrong.append(
                    f"{path.relative_to(SRC)}:{line}: {name} (layer {layer}) imports {target} "
                    f"(layer {target_layer})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {
        name: {t for t, _, _ in distft_imports(tree, name, path.name == "__init__.py")}
        for name, (path, tree) in modules().items()
    }
    # `from distft.x import y` names module distft.x.y when y is one, else distft.x.
    graph = {
        name: {f"{t}" for t in targets if t in graph}
        | {t.rpartition(".")[0] for t in targets if t not in graph}
        for name, targets in graph.items()
    }
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_size_limits():
    """No file in src/ over 350 lines and no function over 80: a file reads in one sitting."""
    too_long = []
    for path in sorted((SRC / "distft").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 350:
            too_long.append(f"{path.relative_to(SRC)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    too_long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}(): {length} lines")
    assert not too_long, "\n".join(too_long)


def test_the_longest_files_named_for_scheduling_exist():
    """`make test` starts the files of `LONGEST_FIRST` first; a renamed one would start last."""
    from tests.conftest import LONGEST_FIRST  # here: tests/changed.py imports this file without torch

    tests = Path(__file__).parent
    assert [name for name in LONGEST_FIRST if not (tests / name).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_matplotlib_is_imported_only_where_a_plot_is_drawn():
    """Every distft command imports the CLI, and with it every module: matplotlib at module level
    would add ~0.8 s to each start (`distft.bench.plots.pyplot` imports it when a plot is drawn)."""
    found = []
    for path in sorted((SRC / "distft").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "matplotlib" for name in names):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


# ---- docs/architecture.md names what exists, and every top-level module ------------------------

DOC = SRC.parent / "docs" / "architecture.md"
PACKAGE = SRC / "distft"


def doc_parts() -> tuple[str, str, list[tuple[str, list[str], str]]]:
    """The doc's text, its diagram (the first code block) and its layer table's rows as (layer,
    the backticked names of its package column, its "holds" column)."""
    text = DOC.read_text(encoding="utf-8")
    diagram = text.split("```", 2)[1]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[0].isdigit():
            rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1]), cells[2]))
    return text, diagram, rows


def defines(module: Path, name: str) -> bool:
    """Whether `module` (a .py file) binds `name` at its top level."""
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        imports = node.names if isinstance(node, ast.Import | ast.ImportFrom) else []
        if any((a.asname or a.name).split(".")[0] == name for a in imports):
            return True
    return False


def resolves(path: str, base: Path) -> bool:
    """`path` (`io/`, `parallel/ddp.py`, `model/lm.run_layers`, `parallel/dims`) under `base`: a
    folder, a module, or a name a module defines."""
    if path.endswith("/"):
        return (base / path).is_dir()
    if path.endswith(".py"):
        return (base / path).is_file()
    if (base / f"{path}.py").is_file() or (base / path / "__init__.py").is_file():
        return True
    module, _, name = path.rpartition(".")
    candidates = [base / f"{module}.py", base / module / "__init__.py"] if module else []
    return any(c.is_file() and defines(c, name) for c in candidates)


def module_path_problem(token: str, bases: list[Path]) -> str | None:
    """Why backticked `token` names no file of the checkout, if it is a path or a module name at all
    (`parallel/ddp.py`, `pipeline/cost.py` under a row's package, `distft.plan.memory`,
    `tests/...`); None when it resolves or names something else (a setting, a class)."""
    if token.startswith(("tests/", "docs/")):
        return None if (SRC.parent / token.rstrip("/")).exists() else "no such file in the checkout"
    if token.startswith("distft."):
        token = token.removeprefix("distft.").replace(".", "/")
        bases = [PACKAGE]
    elif "/" not in token and not token.endswith(".py"):
        return None  # `parallel.pp_split`, `Layout.cut`: settings and names, not module paths
    if " " in token or any(part.removesuffix(".py").isupper() for part in token.split("/")):
        return None  # `model/families/NAME.py`: a placeholder
    token = token.removeprefix("src/distft/")
    found = any(resolves(token, base) for base in bases)
    return None if found else f"not found under {', '.join(str(b.relative_to(SRC)) for b in bases)}"


def test_every_module_path_the_architecture_doc_names_exists():
    text, diagram, rows = doc_parts()
    anywhere = [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    wrong = []
    # A layer table row's bare names are files of its own packages (`step.py` in `measure/`).
    row_text = set()
    for layer, packages, holds in rows:
        row_text.add(holds)
        bases = [PACKAGE, *(PACKAGE / p for p in packages if p.endswith("/"))]
        for token in [*packages, *re.findall(r"`([^`]+)`", holds)]:
            if problem := module_path_problem(token, bases):
                wrong.append(f"layer {layer}: `{token}`: {problem}")
    # Elsewhere a bare name may be a file of any package (`fsdp_tp.py` beside `parallel/`).
    rest = "\n".join(line for line in text.splitlines() if not any(h in line for h in row_text))
    for token in re.findall(r"`([^`]+)`", rest):
        if problem := module_path_problem(token, anywhere):
            wrong.append(f"`{token}`: {problem}")
    # The diagram names top-level modules and packages, unquoted.
    for name in re.findall(r"(?<![\w/.])([a-z_0-9]+(?:\.py|/))", diagram):
        if not resolves(name, PACKAGE):
            wrong.append(f"the diagram's {name}: not in src/distft")
    assert not wrong, "docs/architecture.md names what does not exist:\n" + "\n".join(wrong)


def test_the_architecture_doc_draws_every_top_level_module_in_its_layer():
    """Every module and package directly under src/distft is in the diagram and in the layer table,
    in the row of its layer in `LAYERS`."""
    _, diagram, rows = doc_parts()
    drawn = set(re.findall(r"(?<![\w/.])([a-z_0-9]+(?:\.py|/))", diagram))
    tabled = {name: int(layer) for layer, packages, _ in rows for name in packages}
    wrong = []
    for path in sorted(PACKAGE.iterdir()):
        if path.name == "__init__.py" or path.name == "__pycache__":
            continue
        if path.suffix == ".py":
            name, module = path.name, f"distft.{path.stem}"
        elif (path / "__init__.py").is_file():
            name, module = f"{path.name}/", f"distft.{path.name}"
        else:
            continue  # py.typed
        if name not in drawn:
            wrong.append(f"{name}: not in the diagram")
        if name not in tabled:
            wrong.append(f"{name}: not in the layer table")
        elif tabled[name] != LAYERS[module]:
            wrong.append(f"{name}: layer {tabled[name]} in the table, {LAYERS[module]} in LAYERS")
    assert not wrong, "docs/architecture.md is missing or misplaces:\n" + "\n".join(wrong)
