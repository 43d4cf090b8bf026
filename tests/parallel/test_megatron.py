"""Megatron TP + SP (`tp-sp`) computes, trains and exports exactly what one process does.

Two kinds of proof. In-process on 2 gloo ranks (one launch): with a non-zero adapter, the loss, the
gradient of every trainable weight (shards gathered), the gradient norm and the export equal the
unsplit model's on a right-padded batch, with and without sequence parallelism and for full
finetuning; bytes per collective equal the analytic count; SP saves fewer activation bytes than
plain TP, which saves fewer than one process. Through the CLI (`distft train --nproc 2`): per-step
losses, gradient norms and the exported adapter equal the single-process run's.
"""

import copy
import json

import pytest
import torch
import torch.distributed as dist
from peft import get_peft_model_state_dict

from distft.cli import main
from distft.config import load_config
from distft.distributed import DistEnv
from distft.measure.activations import SavedActivations
from distft.measure.comm import CommCounter
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.model.presets import MICRO_RANKS, MICRO_TOKENS
from distft.parallel.base import unwrap
from distft.parallel.megatron import TensorSequenceParallel
from distft.parallel.megatron.collectives import all_gather_dim
from distft.parallel.tensor_parallel import partition_dim
from tests.helpers import PARITY, assert_same_training, distft, expected_bytes, metrics
from tests.parallel.test_collectives import run_group

WORLD = 2
RTOL = 1e-5  # fp32: sharded matmuls sum in another order (~1e-7 relative)


def right_padded_batch() -> dict[str, torch.Tensor]:
    """Two sequences of 37 and 30 tokens (odd: SP appends one position), loss on their tails."""
    g = torch.Generator().manual_seed(1)
    lengths, seq = [37, 30], 37
    input_ids = torch.randint(0, MICRO_RANKS, (2, seq), generator=g)
    attention_mask = torch.zeros(2, seq, dtype=torch.long)
    labels = torch.full((2, seq), -100)
    for i, n in enumerate(lengths):
        attention_mask[i, :n] = 1
        input_ids[i, n:] = MICRO_TOKENS["pad_token_id"]
        labels[i, n - 12 : n - 1] = torch.randint(0, MICRO_RANKS, (11,), generator=g)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build(method: str) -> tuple:
    cfg = load_config(
        None, ["model.name=micro", "parallel.strategy=tp-sp", "parallel.nproc=2", f"train.method={method}"]
    )
    torch.manual_seed(0)
    lm = apply_method(load_base_model(cfg.model), cfg)
    with torch.no_grad():  # lora_B starts at zero: make the adapters matter
        g = torch.Generator().manual_seed(2)
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return cfg, lm


def reference_step(lm, batch, n_tokens: int) -> tuple[float, dict[str, torch.Tensor], float]:
    model = LossLM(copy.deepcopy(lm))
    loss = model(**batch)
    (loss / n_tokens).backward()
    grads = {n: p.grad for n, p in model.lm.named_parameters() if p.requires_grad}
    norm = torch.sqrt(sum(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads.values()))
    return loss.item(), grads, norm.item()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def saved_activation_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd keeps for backward in one forward of `model` on `batch`, on this rank."""
    with SavedActivations(model) as probe:
        loss = model(**batch)  # kept alive, so no saved storage is freed and its address reused
    del loss
    return probe.bytes


def _check_against_one_process(rank: int, world: int) -> None:
    batch = right_padded_batch()
    n_tokens = int((batch["labels"] != -100).sum())
    env = DistEnv(rank, world, rank, torch.device("cpu"), "gloo")
    saved = {}
    for method, modes in (("lora", (True, False)), ("full", (True,))):
        cfg, lm = build(method)
        want_loss, want_grads, want_norm = reference_step(lm, batch, n_tokens)
        saved[f"{method}/single"] = saved_activation_bytes(LossLM(copy.deepcopy(lm)), batch)
        for sequence_parallel in modes:
            cfg.parallel.sequence_parallel = sequence_parallel
            strategy = TensorSequenceParallel(cfg, env)
            model = strategy.parallelize(LossLM(copy.deepcopy(lm)))
            where = f"{method}/{'tp-sp' if sequence_parallel else 'tp'}"
            saved[where] = saved_activation_bytes(model, batch)

            with CommCounter() as counter:
                loss = strategy.reduce_loss(strategy.forward_backward(model, [batch], n_tokens)).item()
                norm = strategy.clip_grad_norm_(model, 0.0)
            assert abs(loss - want_loss) <= RTOL * want_loss, (where, loss, want_loss)
            assert abs(norm - want_norm) <= RTOL * want_norm, (where, norm, want_norm)
            assert dict(counter.stats.bytes) == expected_bytes(cfg, strategy, model, [batch]), where

            lm_params = dict(unwrap(model).lm.named_parameters())
            assert {n for n, p in lm_params.items() if p.requires_grad} == set(want_grads), where
            for name, want in want_grads.items():
                p = lm_params[name]
                dim = partition_dim(p)
                got = p.grad if dim is None else all_gather_dim(p.grad, dim)
                assert relative_error(got, want) <= RTOL, (where, name, relative_error(got, want))

            state = strategy.trainable_state_dict(model)  # shards gathered back, single-model names
            if rank == 0:
                original = dict(lm.named_parameters())
                assert set(state) == set(want_grads)
                for name, tensor in state.items():
                    assert torch.equal(tensor, original[name].detach()), (where, name)
                if method == "lora":  # what `save_adapter` writes: PEFT finds every adapter weight
                    exported = get_peft_model_state_dict(unwrap(model).lm, state_dict=state)
                    assert set(exported) == set(get_peft_model_state_dict(lm)), where

    # The padding-free assumption is checked, not assumed.
    left_padded = {k: v.flip(1) for k, v in batch.items()}
    with pytest.raises(ValueError, match="right-padded"):
        model(**left_padded)

    # Activation memory, the larger of the two ranks (the loss head runs where the labels are): SP
    # keeps 1/N of what lies between blocks; plain TP keeps all of it.
    per_rank = [None] * world
    dist.all_gather_object(per_rank, saved)
    most = {key: max(s[key] for s in per_rank) for key in saved}
    assert most["lora/tp-sp"] < most["lora/tp"] < most["lora/single"], per_rank
    if rank == 0:
        print("SAVED_ACTIVATION_BYTES", json.dumps(per_rank))


def test_matches_one_process_in_every_gradient(capfd):
    run_group(_check_against_one_process)
    per_rank = json.loads(capfd.readouterr().out.split("SAVED_ACTIVATION_BYTES")[1].splitlines()[0])
    assert len(per_rank) == WORLD


# ---- through the CLI: the real loop on 2 processes -------------------------------------------


def test_trains_like_one_process(reference, tmp_path):
    out = tmp_path / "tp-sp"
    proc = distft("train", "--strategy", "tp-sp", "--nproc", str(WORLD), *PARITY, "--out", str(out))
    assert "data-parallel ranks 1" in proc.stdout  # both ranks read the whole batch
    assert_same_training(out, reference)

    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    # Independently of sequence lengths: per micro-batch (2 accumulation steps x 1 sequence) and
    # layer (4), 2 all-gathers + 2 reduce-scatters forward, the same backward but for the first
    # block's reduce-scatter (frozen embeddings need no gradient); the all-reduces are the flat
    # partial gradients (once per step), the loss and the gradient norm.
    layers, micro_batches = 4, 4
    assert first["comm_calls"] == {
        "all_gather": micro_batches * layers * 4,
        "reduce_scatter": micro_batches * (layers * 4 - 1),
        "all_reduce": 3,
    }
    # Partial gradients: 5 column lora_A (r x hidden) + 2 row lora_B (hidden x r) per layer.
    hidden, r = 32, 16
    assert first["comm_bytes"]["all_reduce"] == layers * 7 * r * hidden * 4 + 4 + 8


def test_full_finetune_trains_like_one_process(tmp_path):
    full = [*PARITY, "--method", "full", "train.max_steps=2"]
    distft("train", *full, "--out", str(tmp_path / "single"))
    distft("train", "--strategy", "tp-sp", "--nproc", str(WORLD), *full, "--out", str(tmp_path / "tp-sp"))
    got, want = metrics(tmp_path / "tp-sp"), metrics(tmp_path / "single")
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=RTOL)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=RTOL)
    assert got[0]["comm_bytes"] == got[0]["comm_bytes_expected"]


def test_head_count_must_divide(capsys):
    # micro has 4 query heads and 2 KV heads: 3 ranks cannot split them; nothing is launched.
    assert main(["train", "--strategy", "tp-sp", "--nproc", "3", "--model", "micro"]) == 2
    err = capsys.readouterr().err
    assert "4 query heads and 2 KV heads" in err and "--nproc 2" in err


def test_model_layout_is_unchanged_for_export():
    """The adapter's parameter names are PEFT's, whatever the strategy (what `save_adapter` needs)."""
    _, lm = build("lora")
    names = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in names
    assert causal_lm(lm).model.layers[0].self_attn.q_proj.lora_A["default"].weight.shape == (16, 32)
