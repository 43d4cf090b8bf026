"""Padding-free packing: the packer's rows, and a packed row computing what padded rows compute.

A packed micro-batch is one row: the documents end to end, position ids restarting at 0 at each,
no attention mask. These tests check the row itself (positions, labels, the fill of a fixed-length
row), that no document attends to another (changing one document leaves the others' hidden
states untouched, which fails with plain 0..T-1 positions), and that the loss and every LoRA
gradient equal the padded batch's, for sdpa and eager attention and for tp-sp's own mask.
"""

import pytest
import torch
from transformers.masking_utils import create_causal_mask

from distft.config import load_config
from distft.data import IGNORE, Example, collate, document_ids, micro_batch, pack
from distft.model import LossLM, apply_method, load_base_model
from distft.parallel.megatron.model import document_mask


def example(ids: list[int], prompt: int) -> Example:
    """`prompt` tokens without loss, then each later position predicts the next token."""
    return Example(ids, [IGNORE] * prompt + ids[prompt + 1 :] + [IGNORE], 0)


def random_examples(lengths: tuple[int, ...], seed: int = 1) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    return [example(torch.randint(0, 900, (n,), generator=g).tolist(), n // 2) for n in lengths]


def test_pack_restarts_positions_and_keeps_labels():
    a, b = example([5, 6, 7], 1), example([8, 9], 0)
    row = pack([a, b], pad_id=0)
    assert set(row) == {"input_ids", "position_ids", "labels"}  # no attention mask: nothing is padding
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # Each document's last position predicts nothing: no label reaches into the next document.
    assert row["labels"].tolist() == [[IGNORE, 7, IGNORE, 9, IGNORE]]
    assert document_ids(row["position_ids"]).tolist() == [[0, 0, 0, 1, 1]]


def test_fixed_length_row_ends_in_a_fill_document_without_loss():
    row = pack([example([5, 6, 7], 1), example([8, 9], 0)], pad_id=3, pad_to=8)
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 3, 3]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert row["labels"][0, 5:].eq(IGNORE).all()
    assert document_ids(row["position_ids"]).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    with pytest.raises(ValueError, match="do not fit"):
        pack([example([5, 6, 7], 1)], pad_id=3, pad_to=2)


def test_micro_batch_chooses_the_layout():
    examples = random_examples((4, 6))
    assert micro_batch(examples, 0, packed=True)["input_ids"].shape == (1, 10)
    padded = micro_batch(examples, 0, packed=False, pad_to=8)
    assert padded["input_ids"].shape == (2, 8) and padded["attention_mask"].sum() == 10


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    cfg = load_config(None, ["model.name=micro", f"model.attn_implementation={request.param}"])
    torch.manual_seed(0)
    lm = LossLM(apply_method(load_base_model(cfg.model), cfg))
    for name, p in lm.named_parameters():  # lora_B starts at 0: give the adapters a real effect
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return lm


def hidden_states(model: LossLM, row: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.backbone(input_ids=row["input_ids"], position_ids=row["position_ids"]).last_hidden_state[0]


def test_documents_do_not_see_each_other(model):
    examples = random_examples((9, 14, 6))
    changed = [example([t + 1 for t in examples[0].input_ids], 4), *examples[1:]]
    with torch.no_grad():
        before, after = hidden_states(model, pack(examples, 0)), hidden_states(model, pack(changed, 0))
        assert not torch.allclose(before[:9], after[:9])  # the changed document itself
        torch.testing.assert_close(before[9:], after[9:], rtol=0, atol=1e-6)  # the other two
        # Control: with positions 0..T-1 the row is one document, and the change leaks forward.
        plain = {k: v for k, v in pack(changed, 0).items()}
        plain["position_ids"] = torch.arange(29).unsqueeze(0)
        assert not torch.allclose(before[9:], hidden_states(model, plain)[9:], atol=1e-4)


def loss_and_grads(model: LossLM, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def test_packed_loss_and_gradients_equal_padded(model):
    examples = random_examples((17, 5, 30, 11))
    padded_loss, padded = loss_and_grads(model, collate(examples, 0))
    for row in (pack(examples, 0), pack(examples, 0, pad_to=80)):
        loss, grads = loss_and_grads(model, row)
        assert loss == pytest.approx(padded_loss, rel=1e-6)
        assert grads.keys() == padded.keys() and any("lora_A" in n for n in grads)
        for name, g in grads.items():  # float summation order only: relative norm of the difference
            error = (g - padded[name]).norm() / padded[name].norm()
            assert error <= 1e-5, f"{name}: relative difference {error:.2e}"


def test_tp_sp_document_mask_is_transformers_block_diagonal_mask(model):
    """The mask tp-sp builds itself equals the one transformers builds from the same positions."""
    position_ids = pack(random_examples((3, 4, 2)), 0, pad_to=11)["position_ids"]
    ours = document_mask(position_ids)
    cfg = model.backbone.config
    embeds = torch.zeros(1, 11, cfg.hidden_size)
    theirs = create_causal_mask(cfg, embeds, None, None, position_ids=position_ids)
    if theirs.dtype != torch.bool:  # eager: an additive float mask
        theirs = theirs == 0
    assert torch.equal(ours, theirs)
    assert ours[0, 0, 3, 2].item() is False and ours[0, 0, 4, 3].item() is True
