#!/usr/bin/env bash
# The GPU kit: the wheels a fresh GPU box lacks, so that `distft bench --gpu` runs there offline.
#
# Run it where pip reaches the package index, from any directory of the checkout:
#
#   scripts/gpu-wheels.sh               # empty .whl/, download the wheels, build distft's own
#   scripts/gpu-wheels.sh --print-pins  # only print the name==version list; downloads nothing
#
# The box is assumed to have Python 3.12, torch (CUDA), transformers, peft, rich, matplotlib,
# safetensors and numpy, and so everything those need. The bundle is the rest of distft's runtime
# dependencies (pyproject.toml's [project].dependencies) and what they need in turn, each pinned to
# the version installed in the virtualenv ($PYTHON, default .venv/bin/python): the versions the
# tests pass with (the project keeps no lock file). The wheels are for CPython 3.12 on
# manylinux x86_64, whatever this machine is.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
WHEELS="$ROOT/.whl"
# On the box already, with whatever they depend on: shipping them again would shadow the box's
# CUDA torch and the transformers stack it was tested with.
BOX_HAS="torch transformers peft rich matplotlib safetensors numpy"
# Needed only for a dataset from the hub, which an offline box cannot fetch anyway, and for Parquet
# files, which the GPU bench does not read: they would bring pyarrow and pandas (over 50 MB of wheels).
SKIP="datasets pyarrow"

usage() {
    sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# name==version for each dependency in the bundle, one a line, sorted.
print_pins() {
    BOX_HAS="$BOX_HAS" SKIP="$SKIP" "$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import os
import re
import sys
from importlib import metadata

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement


def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# The box's interpreter, not this one: a requirement marked for another Python or OS is left out.
BOX = {
    "extra": "",
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
}


def requirements(dist: metadata.Distribution) -> list[Requirement]:
    """A distribution's own runtime requirements (no extras) that apply on the box."""
    reqs = [Requirement(r) for r in dist.requires or []]
    return [r for r in reqs if not r.marker or r.marker.evaluate(BOX)]


def closure(reqs: list[Requirement], stop: set[str]) -> dict[str, str]:
    """Every installed distribution `reqs` need, directly or not, short of `stop`: name -> version."""
    found: dict[str, str] = {}
    todo = list(reqs)
    while todo:
        req = todo.pop()
        if key(req.name) in found or key(req.name) in stop:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"gpu-wheels: {req.name} is not installed in {sys.executable}; install distft there first.")
        if not req.specifier.contains(dist.version, prereleases=True):
            sys.exit(f"gpu-wheels: {req.name} {dist.version} is installed, but {req} is required.")
        found[key(req.name)] = dist.version
        todo += requirements(dist)
    return found


with open(sys.argv[1], "rb") as f:
    project = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
project = [r for r in project if not r.marker or r.marker.evaluate(BOX)]
box = [Requirement(name) for name in os.environ["BOX_HAS"].split()]
skip = {key(name) for name in os.environ["SKIP"].split()}
on_box = set(closure(box, stop=set()))  # what the box's own stack brings along
wanted = [r for r in project if key(r.name) not in on_box | skip]
for name, version in sorted(closure(wanted, stop=on_box | skip).items()):
    print(f"{name}=={version}")
EOF
}

# One pin's wheel for the box: the index's, or, where the index has only a source archive
# (rouge-score), one built here, which must then be pure Python to install on the box.
fetch() {
    local pin="$1" log
    if log="$("$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        -d "$WHEELS" "$pin" 2>&1)"; then
        return
    fi
    echo "gpu-wheels: no wheel for $pin on the index; building one from its source"
    if ! "$PYTHON" -m pip wheel -q --no-deps --no-binary "${pin%%==*}" -w "$WHEELS" "$pin"; then
        echo "$log" >&2
        exit 1
    fi
    # A wheel's file name spells the project name with underscores: rouge_score-0.1.2-py3-none-any.whl.
    if ! compgen -G "$WHEELS/$(echo "${pin%%==*}" | sed 's/[-.]/_/g')-${pin##*==}-*-none-any.whl" >/dev/null; then
        echo "gpu-wheels: $pin built a wheel for this machine only (not pure Python): $(ls "$WHEELS")" >&2
        exit 1
    fi
}

download() {
    local pins pin
    pins="$(print_pins)"
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl # a stale version beside the new one would make the install ambiguous
    # shellcheck disable=SC2086  # the pins, one word each
    echo "gpu-wheels: downloading into $WHEELS:" $pins
    for pin in $pins; do
        fetch "$pin"
    done
    "$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" "$ROOT"
    ls -l "$WHEELS"
    cat <<EOF

Copy the checkout with .whl/ to the GPU box; there, from the checkout's root:

  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 python3 -m distft bench --gpu

It writes docs/reports/gpu/<device>/RECORD.md: commit that.
EOF
}

case "${1:-}" in
"") download ;;
--print-pins) print_pins ;;
-h | --help) usage ;;
*)
    echo "gpu-wheels: unknown argument $1" >&2
    usage >&2
    exit 2
    ;;
esac
