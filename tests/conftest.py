"""Fixtures shared across test files, and one setting for the whole suite."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from distft.host_memory import keep_freed_memory
from tests.helpers import PARITY, distft

# The CLI runs in subprocesses with OMP_NUM_THREADS=1 (tests/helpers.py); references trained in
# this process must sum in the same order, or a parity test compares 1-thread against 2-thread
# matmul rounding, which Adam amplifies past 1e-5 in near-zero adapter weights.
torch.set_num_threads(1)
# And with malloc keeping what each step frees, as every distft process on the CPU runs.
keep_freed_memory()

# Property tests (tests/*/test_*_properties.py): a few seconds each. `CI=1` replays the same
# examples every run (derandomized); HYPOTHESIS_PROFILE=thorough hunts with 30x as many. No
# example database is written (tmp_path is function-scoped, but every example rewrites its file).
settings.register_profile(
    "distft",
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", parent=settings.get_profile("distft"), derandomize=True)
settings.register_profile("thorough", parent=settings.get_profile("distft"), max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "distft"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every parity test compares against (trained once per session)."""
    out = tmp_path_factory.mktemp("single")
    distft("train", *PARITY, "--out", str(out))
    return out


# The files that take longest on the 2-core machine (`pytest --durations=0`, summed per file),
# longest first. `make test` runs two workers with `--dist loadfile --no-loadscope-reorder`: each
# worker takes whole files in this order, so no long file starts last and keeps one worker busy
# while the other has nothing left to do. Every other file follows in collection order.
LONGEST_FIRST = [
    "parallel/test_families.py",
    "parallel/test_moe.py",
    "model/test_compile.py",
    "test_reliability.py",
    "parallel/test_multi_node.py",
    "parallel/test_preference.py",
    "plan/test_counted_mesh.py",
    "plan/test_counted.py",
    "parallel/test_compiled.py",
    "parallel/test_data_parallel.py",
    "parallel/test_fsdp_pp.py",
    "model/test_checkpointing.py",
    "parallel/test_context.py",
    "test_infer.py",
    "parallel/test_hsdp.py",
    "parallel/test_packing_parity.py",
    "parallel/test_pipeline_cost.py",
    "parallel/test_pipeline.py",
    "test_signals.py",
    "model/test_router.py",
    "train/test_short_batches.py",
    "bench/test_gpu_suite.py",
    "test_cli_startup.py",
    "bench/test_study.py",
    "plan/test_run_line.py",
    "parallel/test_tensor_parallel.py",
    "plan/test_decide.py",
    "train/test_optim.py",
    "data/test_tokenizer.py",
    "model/test_qlora.py",
    "plan/test_auto.py",
    "parallel/test_megatron.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.relative_to(tests).as_posix(), len(place)))
