"""Multi-node runs: separate torchrun agents, one per "node" with its own --node-rank, meet at a
rendezvous on 127.0.0.1 and train exactly like one process, for every multi-dimensional strategy.

Each case is one `NodeLayout`: the strategy, processes per node, its mesh degrees, and the mesh
dimensions whose groups must stay inside a node (tensor parallelism all-reduces activations in
every layer: that traffic belongs on NVLink, not on the network between nodes). Every run records
each rank's node and its process groups per mesh dimension in `ranks.json`, which the test reads
back. Adding a strategy is one entry. With 2 agents x 2 processes a case takes 4-15 s on 2 cores
(each agent forked from the test's server with distft imported, its ranks forked from the agent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from distft.layout import SPECS
from tests.helpers import PARITY, agents, assert_same_training

NODES = 2


@dataclass(frozen=True)
class NodeLayout:
    strategy: str
    nproc: int  # processes per node
    overrides: tuple[str, ...] = ()  # the mesh degrees
    node_local: frozenset[str] = frozenset()  # mesh dimensions whose groups never leave a node

    def __str__(self) -> str:
        return f"{self.strategy}-{NODES}x{self.nproc}"


LAYOUTS = [
    NodeLayout("ddp", 1),  # no mesh: the gradient all-reduce crosses the nodes
    # tp inner: each TP pair on one node; FSDP's gathers and reduce-scatters cross the nodes.
    NodeLayout("fsdp+tp", 2, ("parallel.dp=2", "parallel.tp=2"), frozenset({"tp"})),
    # pp outermost: each node holds one stage of both replicas; the stage boundary crosses nodes.
    NodeLayout("ddp+pp", 2, ("parallel.dp=2", "parallel.pp=2"), frozenset({"dp"})),
    # shard inner: FSDP's gathers and reduce-scatters stay in a node, the replicas' all-reduce crosses.
    NodeLayout("hsdp", 2, ("parallel.shard=2",), frozenset({"shard"})),
    # The pipelines as ddp+pp: one stage per node, FSDP (and TP) inside it.
    NodeLayout("fsdp+pp", 2, ("parallel.dp=2", "parallel.pp=2"), frozenset({"dp"})),
    NodeLayout("fsdp+tp+pp", 2, ("parallel.dp=1", "parallel.tp=2", "parallel.pp=2"), frozenset({"dp", "tp"})),
    # cp inner: each context-parallel pair's ring on one node; FSDP over both crosses the nodes.
    NodeLayout("fsdp+cp", 2, ("parallel.dp=2", "parallel.cp=2"), frozenset({"cp"})),
    # A TP pair per node (its shard group of one rank with it), the replicas' all-reduce across.
    NodeLayout("hsdp+tp", 2, ("parallel.tp=2", "parallel.shard=1"), frozenset({"tp", "shard"})),
]
# fsdp+ep trains a mixture of experts only; its expert groups are checked in tests/parallel/test_moe.py.
NOT_HERE = {"fsdp+ep"}


def test_every_multi_dimensional_strategy_has_a_layout():
    """A new strategy on several mesh dimensions fails here until it has an entry above."""
    multi = {name for name, spec in SPECS.items() if len(spec.dims) > 1}
    assert multi - NOT_HERE <= {layout.strategy for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout, reference, tmp_path):
    out, world = tmp_path / "run", NODES * layout.nproc
    results = agents(
        "train", "--strategy", layout.strategy, "--nproc", str(layout.nproc), *layout.overrides, *PARITY,
        "--out", str(out), nnodes=NODES,
    )  # fmt: skip
    assert [code for code, _ in results] == [0] * NODES, "\n".join(log[-4000:] for _, log in results)
    assert f"health check: {world} ranks on {NODES} nodes" in results[0][1]  # node 0 holds rank 0
    assert_same_training(out, reference)

    ranks = json.loads((out / "ranks.json").read_text())
    # torchrun numbers ranks node by node: node 0 holds ranks 0..nproc-1.
    assert [(r["rank"], r["node"], r["local_rank"]) for r in ranks] == [
        (r, r // layout.nproc, r % layout.nproc) for r in range(world)
    ]
    node_of = [r["node"] for r in ranks]
    dims = ranks[0]["mesh"]  # {"tp": [0, 1], "dp": [0, 2]}: rank 0's group along each dimension
    node_local = {d for d in dims if all(len({node_of[m] for m in r["mesh"][d]}) == 1 for r in ranks)}
    assert node_local == layout.node_local, {r["rank"]: r["mesh"] for r in ranks}
