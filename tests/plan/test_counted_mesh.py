"""The bytes formula against the collectives counted, for the strategies on several mesh
dimensions and the pipelines, on 4 gloo ranks (one launch).

tests/plan/test_counted.py does this for the one-dimensional strategies on 2 ranks. Here every
registered strategy that needs a mesh or a pipeline (pp, hsdp, fsdp+tp, ddp+pp, fsdp+pp,
fsdp+tp+pp, fsdp+cp, hsdp+tp) runs one optimizer step in-process, as the loop runs it, under every method and
precision it accepts: LoRA, QLoRA, full finetuning in fp32, a bf16 model over fp32 master weights
(under autocast, as `train.setup` runs it) and bf16 alone. Each rank's counted bytes, kind by kind,
must equal the planner's prediction for its pipeline rank (`plan.auto.predict`, what ranks.json
records) and the formula on the step itself (`plan.expected`, what metrics.jsonl records). A cell
a strategy refuses before launch must be one its class says it cannot run.
"""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist

from distft.config import load_config
from distft.distributed import DistEnv
from distft.errors import ConfigError
from distft.layout import SPECS
from distft.measure.comm import CommCounter
from distft.model import LossLM, apply_method
from distft.parallel import STRATEGIES, check_config
from distft.plan.auto import predict
from tests.helpers import expected_bytes
from tests.parallel.test_collectives import run_group
from tests.plan.test_activations import batch
from tests.plan.test_counted import base_model

WORLD = 4
SEQ = 32  # every row fills data.max_length: the plan's shapes are the run's
MESHES = {
    "pp": [],
    "hsdp": ["parallel.shard=2"],
    "fsdp+tp": ["parallel.tp=2"],
    "ddp+pp": ["parallel.pp=2"],
    "fsdp+pp": ["parallel.pp=2"],
    "fsdp+tp+pp": ["parallel.tp=2", "parallel.pp=2"],
    "fsdp+cp": ["parallel.cp=2", "parallel.cp_method=ring"],  # the ring here, the all-gather elsewhere
    "hsdp+tp": [
        "parallel.tp=2",
        "parallel.shard=1",
    ],  # 2 replicas of a TP group (tests/parallel/test_hsdp.py: 8 ranks)
}
# Every strategy on a mesh of several dimensions, or a pipeline, is counted here (fsdp+ep's
# expert groups in tests/parallel/test_moe.py): a new one cannot be left out silently.
assert set(MESHES) | {"fsdp+ep"} == {n for n, s in SPECS.items() if len(s.dims) > 1 or s.pipelined}
BF16 = ["model.dtype=bfloat16"]
METHODS = {
    "lora": ("lora", []),
    "qlora": ("qlora", []),
    "full": ("full", []),
    "masters": ("full", [*BF16, "train.master_weights=fp32"]),
    "bf16": ("full", [*BF16, "train.master_weights=model"]),
}


def _step(env: DistEnv, name: str, label: str) -> dict:
    method, overrides = METHODS[label]
    args = [
        "model.name=micro",
        f"train.method={method}",
        "lora.rank=5",  # odd: FSDP2 pads lora_A's rows
        f"parallel.strategy={name}",
        f"parallel.nproc={WORLD}",
        "parallel.pp_split=even",  # the runtime's cut without its data's labelled positions
        "model.attn_implementation=sdpa",
        f"data.max_length={SEQ}",
        "train.micro_batch_size=1",
        *MESHES[name],
        *overrides,
    ]
    cfg = load_config(None, args)
    cls = STRATEGIES[name]
    # Two micro-batches a rank (accumulation), four where a pipeline fills all 4 ranks with stages.
    cfg.train.global_batch_size = (4 if name == "pp" else 2) * cls.data_parallel_size(cfg)
    try:
        shape = check_config(cfg)
    except ConfigError as err:
        return {"refused": str(err)}
    torch.manual_seed(0)
    strategy = cls(cfg, env)
    base = base_model(cfg.model)  # load_base_model's, built once a recipe
    masters = label == "masters"
    base = base.float() if masters else base  # as `train.setup` keeps the masters
    model = strategy.parallelize(LossLM(apply_method(base, cfg)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = strategy.build_optimizer(trainable, torch.optim.AdamW, lr=1e-3)
    micro_batches = [batch(shape.micro_batch_size, SEQ, 4, seed=i) for i in range(shape.accumulation_steps)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if masters else contextlib.nullcontext()
    with CommCounter() as counter:
        with autocast:
            loss = strategy.forward_backward(model, micro_batches, 4 * len(micro_batches))
        strategy.reduce_loss(loss)
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
    pp_rank = strategy.pp_rank
    return {
        "counted": dict(counter.stats.bytes),
        "predicted": predict(cfg)["comm_bytes_by_pp_rank"][pp_rank],
        "expected": expected_bytes(cfg, strategy, model, micro_batches),
    }


def _count(rank: int, world: int) -> None:
    env = DistEnv(rank, world, rank, torch.device("cpu"), "gloo")
    rows = [
        {"strategy": name, "method": label, "rank": rank, **_step(env, name, label)}
        for name in MESHES
        for label in METHODS
    ]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print("MESH_ROWS", json.dumps([r for ranks in gathered for r in ranks]))


def test_every_mesh_strategy_method_and_precision_moves_the_predicted_bytes(capfd):
    run_group(_count, world=WORLD)
    rows = json.loads(capfd.readouterr().out.split("MESH_ROWS")[1].splitlines()[0])
    assert len(rows) == len(MESHES) * len(METHODS) * WORLD
    runnable = 0
    for r in rows:
        where = (r["strategy"], r["method"], r["rank"])
        spec = SPECS[r["strategy"]]
        can = {"qlora": spec.runs("qlora"), "masters": spec.runs("fp32_masters")}.get(r["method"], True)
        runnable += can
        if not can:  # refused before launch, as its class says
            assert "refused" in r, where
            continue
        assert "refused" not in r, (where, r.get("refused"))
        assert r["counted"], where  # every layout here moves something on every rank
        assert r["counted"] == r["predicted"] == r["expected"], (where, r)
    assert runnable >= 3 * len(MESHES) * WORLD  # LoRA, fp32 and bf16 full finetuning at least, everywhere
