"""Context parallelism (`cp`) computes and trains exactly what one process does, on 2 and 4 ranks.

One gloo launch per rank count, checking in it, for LoRA and full finetuning: the loss and the
gradient of every trainable weight (after `after_backward`) equal one process's `LossLM` on the same
batch, for (a) right-padded rows of different lengths, (b) a packed row whose documents cross the
chunk boundaries, (c) rows whose length is not a multiple of 2N; with each activation checkpointing
level; the bytes of every collective equal the formula's (`plan/traffic.py`); a checkpoint holds the single
model's names; and the activations a rank keeps for backward are ~1/N of one process's.
"""

import copy
import json

import pytest
import torch
import torch.distributed as dist

from distft.config import load_config
from distft.distributed import DistEnv
from distft.measure.activations import SavedActivations
from distft.measure.comm import CommCounter
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.model.checkpointing import enable_checkpointing
from distft.model.presets import MICRO_TOKENS
from distft.parallel.base import Strategy, unwrap
from distft.parallel.context import ContextParallel
from distft.parallel.context.attention import gathered_order, natural_order
from tests.helpers import assert_same_training, distft, expected_bytes
from tests.parallel.test_collectives import run_group
from tests.parallel.test_families import SETTINGS, resume_step_2

RTOL = 1e-5  # fp32: attention over chunks, gradients summed over ranks (~1e-7 relative)
PAD = MICRO_TOKENS["pad_token_id"]  # <|endoftext|>


# ---- the batches -------------------------------------------------------------------------------


def padded_rows() -> dict[str, torch.Tensor]:
    """(a) Three right-padded rows of 48, 30 and 41 tokens (48 = 6 x 8: no CP fill), loss on tails."""
    g = torch.Generator().manual_seed(1)
    lengths, seq = [48, 30, 41], 48
    input_ids = torch.randint(0, 4000, (3, seq), generator=g)
    attention_mask = torch.zeros(3, seq, dtype=torch.long)
    labels = torch.full((3, seq), -100)
    for i, n in enumerate(lengths):
        attention_mask[i, :n] = 1
        input_ids[i, n:] = PAD
        labels[i, n - 15 : n - 1] = torch.randint(0, 4000, (14,), generator=g)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_row() -> dict[str, torch.Tensor]:
    """(b) One packed row of 4 documents, 11 + 23 + 7 + 23 = 64 tokens: boundaries at 11, 34 and 41
    fall inside chunks for 2 ranks (L = 16) and 4 ranks (L = 8); loss on each document's tail."""
    g = torch.Generator().manual_seed(3)
    lengths = [11, 23, 7, 23]
    input_ids = torch.randint(0, 4000, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.full((1, sum(lengths)), -100)
    start = 0
    for n in lengths:
        end = start + n
        labels[0, end - 1 - n // 2 : end - 1] = torch.randint(0, 4000, (n // 2,), generator=g)  # last: none
        start = end
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def odd_rows() -> dict[str, torch.Tensor]:
    """(c) Two one-document rows of 37 tokens (not a multiple of 4 or 8: CP appends a fill), no
    mask, loss on most positions."""
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 4000, (2, 37), generator=g)
    labels = torch.randint(0, 4000, (2, 37), generator=g)
    labels[:, :5] = -100
    labels[:, -1] = -100
    return {"input_ids": input_ids, "labels": labels}


BATCHES = {"padded": padded_rows, "packed": packed_row, "odd": odd_rows}


def long_rows(seq: int = 512, rows: int = 4) -> dict[str, torch.Tensor]:
    """Rows long enough that the layers' activations outweigh the loss head (each labelled position
    keeps 4,096 fp32 log-probabilities): a label every 128 positions, so that at 2 and 4 ranks
    every rank's loss head holds the same share of them."""
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 4000, (rows, seq), generator=g)
    labels = torch.full((rows, seq), -100)
    labels[:, 127::128] = torch.randint(0, 4000, (rows, seq // 128), generator=g)
    return {"input_ids": input_ids, "labels": labels}


# ---- the prediction ----------------------------------------------------------------------------


def cp_activation_excess(model_config, batch: dict[str, torch.Tensor], world: int, rank: int) -> int:
    """What a rank keeps beyond 1/N of one process's activations (when its labels are 1/N too):
    per layer, K and V of the whole row (the gather's output, which attention saves), 2 B S Hkv d
    x 4 B; and, on the CPU only, the additive fp32 mask of each local chunk c > 0, L x (c+1)L x 4 B,
    built once per forward and shared by the layers (CUDA takes `causal_lower_right`: no tensor)."""
    rows, seq = batch["input_ids"].shape
    length = seq // (2 * world)
    kv_per_layer = 2 * rows * seq * model_config.num_key_value_heads * model_config.head_dim * 4
    kv = model_config.num_hidden_layers * kv_per_layer
    masks = sum(length * (c + 1) * length * 4 for c in (rank, 2 * world - 1 - rank) if c > 0)
    return kv + masks


# ---- helpers -----------------------------------------------------------------------------------


def build(method: str, world: int) -> tuple:
    cfg = load_config(
        None,
        ["model.name=micro", "parallel.strategy=cp", f"parallel.nproc={world}", f"train.method={method}"],
    )
    torch.manual_seed(0)
    lm = apply_method(load_base_model(cfg.model), cfg)
    with torch.no_grad():  # lora_B starts at zero: make the adapters matter
        g = torch.Generator().manual_seed(2)
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return cfg, lm


def fresh(lm, level: str = "none"):
    """A copy of `lm` keeping what `level` says. Checkpointing is set on the copy: a layer's
    checkpointed forward is a closure over its own module, which a deepcopy would not follow."""
    lm = copy.deepcopy(lm)
    enable_checkpointing(causal_lm(lm), level)
    return lm


def reference_step(lm, batch, n_tokens: int, level: str = "none") -> tuple[float, dict[str, torch.Tensor]]:
    model = LossLM(fresh(lm, level))
    loss = model(**batch)
    (loss / n_tokens).backward()
    return loss.item(), {n: p.grad for n, p in model.lm.named_parameters() if p.requires_grad}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def saved_activation_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd keeps for backward in one forward of `model` on `batch`, on this rank."""
    with SavedActivations(model) as probe:
        loss = model(**batch)  # kept alive, so no saved storage is freed and its address reused
    loss.backward()  # every rank runs the backward's reduce-scatters
    return probe.bytes


def _check_against_one_process(rank: int, world: int) -> None:
    env = DistEnv(rank, world, rank, torch.device("cpu"), "gloo")
    report: dict = {"bytes": {}, "saved": {}}
    for method in ("lora", "full"):
        cfg, lm = build(method, world)
        runs = [(name, "none", "allgather") for name in BATCHES]
        if method == "lora":  # every level on the row that crosses the most boundaries
            runs += [("packed", level, "allgather") for level in ("full", "selective", "offload")]
        # The ring: padded rows, the packed row's documents across chunks, a recomputed layer.
        runs += [("padded", "none", "ring"), ("packed", "none", "ring"), ("packed", "full", "ring")]
        for name, level, cp_method in runs:
            batch = BATCHES[name]()
            n_tokens = int((batch["labels"] != -100).sum())
            want_loss, want_grads = reference_step(lm, batch, n_tokens, level)
            cfg.model.activation_checkpointing = level  # what the bytes formula reads
            cfg.parallel.cp_method = cp_method
            strategy = ContextParallel(cfg, env)
            model = strategy.parallelize(LossLM(fresh(lm, level)))
            where = f"{method}/{name}/{level}/{cp_method}/N={world}"
            with CommCounter() as counter:
                loss = strategy.reduce_loss(strategy.forward_backward(model, [batch], n_tokens)).item()
                strategy.clip_grad_norm_(model, 0.0)
            assert abs(loss - want_loss) <= RTOL * want_loss, (where, loss, want_loss)
            expected = expected_bytes(cfg, strategy, model, [batch])
            assert dict(counter.stats.bytes) == expected, (where, dict(counter.stats.bytes), expected)
            layers = lm.config.num_hidden_layers
            gathers = 2 if level in ("full", "offload") else 1
            assert dict(counter.stats.calls) == (
                {"all_gather": gathers * layers, "reduce_scatter": layers, "all_reduce": 2}
                if cp_method
                == "allgather"  # a K and a V tensor per pass of the ring, N-1 of K/V each way, N of dK/dV
                else {
                    kind: 2 * (world - 1) * (gathers + 1) * layers + 2 * world * layers
                    for kind in ("send", "recv")
                }
                | {"all_reduce": 2}
            ), where
            report["bytes"][where] = dict(counter.stats.bytes)
            # The model's kernel is its own again, forward and backward done (recomputation included).
            assert unwrap(model).lm.config._attn_implementation == lm.config._attn_implementation, where

            params = dict(unwrap(model).lm.named_parameters())
            assert {n for n, p in params.items() if p.requires_grad} == set(want_grads), where
            for pname, want in want_grads.items():
                err = relative_error(params[pname].grad, want)
                assert err <= RTOL, (where, pname, err)

        cfg.model.activation_checkpointing, cfg.parallel.cp_method = "none", "allgather"
        # Activation memory on long rows: layers dominate (4 rows of 512, 16 labels).
        batch = long_rows()
        single = saved_activation_bytes(LossLM(copy.deepcopy(lm)), batch)
        model = ContextParallel(cfg, env).parallelize(LossLM(copy.deepcopy(lm)))
        report["saved"][method] = {"single": single, "cp": saved_activation_bytes(model, batch)}
        report["saved"][method]["excess"] = cp_activation_excess(lm.config, batch, world, rank)

    # The checkpoint is the single model's: the same keys as one process's `LossLM`.
    cfg, lm = build("lora", world)
    strategy = ContextParallel(cfg, env)
    model = strategy.parallelize(LossLM(copy.deepcopy(lm)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    batch = odd_rows()
    strategy.forward_backward(model, [batch], int((batch["labels"] != -100).sum()))
    optimizer.step()
    state = strategy.checkpoint_state(model, optimizer)
    single = Strategy.checkpoint_state(strategy, unwrap(model), optimizer)
    assert (
        state["model"]
        and set(state["model"]) == set(single["model"])
        and set(state["optim"]) == set(single["optim"])
    )
    strategy.load_checkpoint_state(model, optimizer, state)
    exported = strategy.trainable_state_dict(model)
    if rank == 0:
        assert set(exported) == {n for n, p in lm.named_parameters() if p.requires_grad}

    # Left padding would let real tokens attend to padding under the plain causal mask: refused.
    padded = padded_rows()
    with pytest.raises(ValueError, match="right-padded"):
        model(**{k: v.flip(1) for k, v in padded.items()})

    per_rank = [None] * world
    dist.all_gather_object(per_rank, report)
    if rank == 0:
        print("CP_REPORT", json.dumps(per_rank))


def run(world: int, capfd) -> list[dict]:
    run_group(_check_against_one_process, world)
    return json.loads(capfd.readouterr().out.split("CP_REPORT")[1].splitlines()[0])


@pytest.mark.parametrize("world", [2, 4])
def test_matches_one_process_in_every_gradient(world, capfd):
    per_rank = run(world, capfd)
    # Activation memory: the most any rank keeps, against one process on the whole rows.
    bound = {2: 0.56, 4: 0.30}[world]
    for method in ("lora", "full"):
        single = per_rank[0]["saved"][method]["single"]
        cp = [r["saved"][method]["cp"] for r in per_rank]
        ratio = max(cp) / single
        print(f"N={world} {method}: one process {single} B, per rank {cp} B, ratio {ratio:.3f}")
        assert ratio <= bound, (world, method, ratio, cp)
        # Where the rest goes: each rank keeps 1/N of one process's, plus K/V and its masks.
        for r in per_rank:
            predicted = single / world + r["saved"][method]["excess"]
            assert abs(r["saved"][method]["cp"] - predicted) <= 1e-4 * single, (method, r["saved"], predicted)


def test_chunk_orders_are_inverse():
    for world in (1, 2, 3, 4):
        natural, gathered = natural_order(world), gathered_order(world)
        assert [gathered[natural[c]] for c in range(2 * world)] == list(range(2 * world))
        # rank r's two places, 2r and 2r + 1, hold chunks r and 2N-1-r
        assert all(gathered[2 * r : 2 * r + 2] == [r, 2 * world - 1 - r] for r in range(world))


def test_resumes_across_degrees_and_trains_like_the_run_it_continues(tmp_path):
    """The model and its optimizer state are replicated: a checkpoint written by 2 ranks resumes on
    4 (and one process's on 2: tests/parallel/test_families.py), and under fsdp+cp on 2 x 2 ranks
    (its weights and optimizer state sharded over all 4), and trains step 2 the same, moving the
    bytes the planner predicted on every rank."""
    two = tmp_path / "cp2"
    distft("train", "--model", "micro", "--strategy", "cp", "--nproc", "2", *SETTINGS,
           "--checkpoint-every", "1", "--out", str(two))  # fmt: skip
    resume_step_2(two, tmp_path / "cp4", "cp", "--nproc", "4")
    assert_same_training(tmp_path / "cp4", two)
    # fsdp+cp: the same state sharded over 2 data-parallel x 2 context-parallel ranks.
    resume_step_2(two, tmp_path / "fsdp-cp", "fsdp+cp", "--nproc", "4", "parallel.dp=2", "parallel.cp=2")
    assert_same_training(tmp_path / "fsdp-cp", two)
