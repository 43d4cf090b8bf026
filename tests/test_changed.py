"""`make test-changed`'s selection (tests/changed.py), on lists of changed files given here: no git.

A selection that misses a test is the failure that matters (a change looks tested and is not), so
most tests say what must be in it; the sizes say that the loop is still quick where it can be."""

from __future__ import annotations

import ast

from tests.changed import (
    all_test_files,
    imports,
    literals,
    modules,
    named_strategies,
    select,
    strategies_named_in,
    strategy_modules,
)

TP = "src/distft/parallel/tensor_parallel.py"


def importers(module: str) -> set[str]:
    """The test files that import `module` themselves."""
    return {test for test, name in all_test_files().items() if module in imports(name)}


def test_a_strategy_file_selects_its_tests_and_the_strategies_built_on_it():
    selection = select([TP])
    assert not selection.everything
    assert {
        "tests/parallel/test_tensor_parallel.py",
        "tests/parallel/test_fsdp_tp.py",  # fsdp_tp.py imports tensor_parallel.py
        "tests/parallel/test_hsdp.py",  # hsdp+tp, on fsdp_tp.py
        "tests/parallel/test_megatron.py",  # tp-sp shards with tensor_parallel's functions
    } <= selection.files
    assert "tests/parallel/test_zero1.py" not in selection.files
    assert "tests/data/test_formats.py" not in selection.files
    assert len(selection.files) < 0.4 * len(all_test_files())  # 17 files iterate the registry


def test_a_change_to_the_training_loop_selects_far_more():
    loop, strategy = select(["src/distft/train/loop.py"]), select([TP])
    assert not loop.everything
    assert importers("tests.helpers") <= loop.files  # every multi-process test
    assert len(loop.files) > 2.5 * len(strategy.files)


def test_a_test_helper_selects_the_files_that_import_it():
    helpers = select(["tests/helpers.py"])
    assert importers("tests.helpers") <= helpers.files
    fabricated = select(["tests/bench/fabricated.py"]).files - {"tests/test_changed.py"}  # names it
    assert fabricated == importers("tests.bench.fabricated")
    assert "tests/bench/test_bench.py" in fabricated and all(t.startswith("tests/bench/") for t in fabricated)


def test_a_conftest_selects_every_test_file_below_its_folder():
    data = {test for test in all_test_files() if test.startswith("tests/data/")}
    assert select(["tests/data/conftest.py"]).files == data


def test_a_test_file_selects_itself():
    assert select(["tests/io/test_lock.py"]).files == {"tests/io/test_lock.py"}


def test_a_file_run_by_module_name_is_reached_through_the_name():
    """tests/rank_probe.py is imported by nothing: test_launch.py runs it as `-m tests.rank_probe`."""
    assert "tests/test_launch.py" in select(["tests/rank_probe.py"]).files


def test_the_build_and_ci_files_select_everything():
    for path in ("pyproject.toml", "Makefile", ".ci/run", "src/distft/data/sample/train.jsonl"):
        selection = select([path])
        assert selection.everything, path
        assert path in selection.why[0]


def test_a_docs_page_or_a_config_selects_the_tests_that_read_it():
    reliability = select(["docs/reliability.md"])
    assert not reliability.everything
    assert "tests/config/test_ranges.py" in reliability.files  # reads its table of ranges
    assert "tests/parallel/test_tensor_parallel.py" not in reliability.files
    assert len(reliability.files) < 10
    demo = select(["configs/demo-base.toml"]).files
    assert {"tests/test_demo.py", "tests/test_configs.py"} <= demo  # by name; every config, by a glob


def test_a_deleted_module_selects_what_still_imports_it_and_nothing_else():
    assert select(["src/distft/no_such_module.py"]).files == set()


def test_a_strategy_is_named_as_a_whole_token():
    def names(source: str) -> set[str]:
        return named_strategies(ast.parse(source))

    assert names('ARGS = ["--strategy", "tp"]') == {"tp"}
    assert names('OVERRIDE = "parallel.strategy=fsdp+tp"') == {"fsdp+tp"}
    assert names('CASES = ["tp-sp", "ddp+pp", "model.tp_degree"]') == {"tp-sp", "ddp+pp"}
    assert names("from distft.layout import SPECS") == set(strategy_modules())


def test_every_strategy_is_named_by_a_test_file():
    """A strategy that no test names is run by no test: the files that loop over the registry reach
    it, and check little of it. So a new strategy without its own tests fails here."""
    named = set()
    for test, name in all_test_files().items():
        if test != "tests/test_changed.py":
            named |= strategies_named_in(literals(modules()[name].tree))
    assert sorted(set(strategy_modules()) - named) == []
