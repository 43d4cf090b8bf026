"""The chunked loss head (`distft.model.loss`): the plain head's loss and gradients, one chunk's
logits at a time."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config, Qwen3ForCausalLM

from distft.model.lm import chunkable, summed_loss
from distft.model.loss import LOGITS_BUDGET_BYTES, chunked_cross_entropy, loss_chunk
from distft.model.presets import QWEN3_VOCAB


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error: summation order differs between the two heads, so elementwise
    relative error is meaningless where an entry is near 0."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def inputs(n: int, h: int, vocab: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    labels = torch.randint(vocab, (n,), generator=g)
    return hidden, weight, labels


def plain(hidden, weight, labels):
    """What `summed_loss` computes unchunked."""
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")


def loss_and_grads(head, hidden, weight, labels, *args):
    loss = head(hidden, weight, labels, *args)
    loss.backward()
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    return loss.detach(), grads


# ---- against the plain head --------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 8, 7, 50, 64, 1000])  # divides n, does not, n itself, > n
def test_fp32_loss_and_gradients_equal_the_plain_head(chunk):
    hidden, weight, labels = inputs(64, 16, 300)
    loss, (gh, gw) = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, chunk)
    want, (wh, ww) = loss_and_grads(plain, hidden, weight, labels)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert relative(loss, want) < 1e-6
    assert relative(gh, wh) < 1e-6
    assert relative(gw, ww) < 1e-6


def test_the_gradient_is_scaled_by_grad_output_and_survives_a_second_backward():
    # Train steps divide the summed loss by the token count; a retained graph (pipeline schedules
    # split backward in two) runs backward twice.
    hidden, weight, labels = inputs(32, 16, 100)
    loss = chunked_cross_entropy(hidden, weight, labels, 5)
    (loss / 7).backward(retain_graph=True)
    once = weight.grad.clone()
    (loss * 3).backward()
    want = plain(hidden, weight, labels)
    ww = torch.autograd.grad(want, weight)[0]
    assert relative(once, ww / 7) < 1e-6
    assert relative(weight.grad, ww / 7 + ww * 3) < 1e-6


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, labels = inputs(40, 16, 200)
    weight.requires_grad_(False)  # LoRA: lm_head frozen
    loss, (gh, gw) = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, 6)
    want, (wh, _) = loss_and_grads(plain, hidden, weight, labels)
    assert gw is None
    assert relative(loss, want) < 1e-6 and relative(gh, wh) < 1e-6


def test_hidden_without_gradient_and_no_grad_eval():
    hidden, weight, labels = inputs(40, 16, 200)
    hidden.requires_grad_(False)
    loss, (gh, gw) = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, 6)
    want, (_, ww) = loss_and_grads(plain, hidden, weight, labels)
    assert gh is None and relative(loss, want) < 1e-6 and relative(gw, ww) < 1e-6
    with torch.no_grad():  # eval: the loss only
        assert relative(chunked_cross_entropy(hidden, weight, labels, 6), want) < 1e-6


def test_bf16_inputs_give_bf16_gradients_close_to_the_plain_head():
    hidden, weight, labels = inputs(64, 32, 500, dtype=torch.bfloat16)
    loss, (gh, gw) = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, 10)
    want, (wh, ww) = loss_and_grads(plain, hidden, weight, labels)
    assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    # The logits are the same bf16 matmul, so the loss agrees as in fp32; the weight's gradient sums
    # per-chunk bf16 products in fp32 where the plain head rounds one bf16 product: bf16's eps.
    assert relative(loss, want) < 1e-5
    assert relative(gh, wh) < 1e-2 and relative(gw, ww) < 1e-2


def test_under_autocast_it_runs_the_matmuls_as_autocast_runs_lm_head():
    # single / ddp / zero1 train fp32 weights under bf16 autocast.
    hidden, weight, labels = inputs(48, 32, 400)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, (gh, gw) = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, 9)
        want, (wh, ww) = loss_and_grads(plain, hidden, weight, labels)
    assert gh.dtype == gw.dtype == torch.float32
    assert relative(loss, want) < 1e-5
    assert relative(gh, wh) < 1e-2 and relative(gw, ww) < 1e-2


# ---- in summed_loss, on a Qwen3 ----------------------------------------------------------------


def tiny_qwen3(tie: bool) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def batch(vocab: int, b: int = 2, s: int = 24):
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(vocab, (b, s), generator=g)
    labels = torch.randint(vocab, (b, s), generator=g)
    labels[0, :5] = -100  # a prompt
    labels[1, 20:] = -100  # padding
    positions = (labels.flatten() != -100).nonzero().squeeze(1)
    return input_ids, labels, positions


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("by_positions", [True, False])
def test_summed_loss_chunked_equals_unchunked_on_qwen3(tie, by_positions):
    model = tiny_qwen3(tie)
    input_ids, labels, positions = batch(model.config.vocab_size)

    def run(chunk):
        model.zero_grad(set_to_none=True)
        hidden = model.model(input_ids=input_ids).last_hidden_state  # after the final norm
        loss = summed_loss(hidden, model.lm_head, labels, positions if by_positions else None, chunk=chunk)
        loss.backward()
        return loss.detach(), loss.grad_fn, {n: p.grad.clone() for n, p in model.named_parameters()}

    want, plain_fn, want_grads = run(None)  # 37 labelled rows: far under the budget, unchunked
    got, chunked_fn, grads = run(5)
    assert type(plain_fn).__name__ != "ChunkedCrossEntropyBackward"
    assert type(chunked_fn).__name__ == "ChunkedCrossEntropyBackward"
    assert relative(got, want) < 1e-6
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        assert relative(grads[name], want_grads[name]) < 1e-5, name  # through 2 layers: rounding grows


def test_a_head_that_cannot_be_chunked_takes_the_plain_path():
    model = tiny_qwen3(tie=False)
    assert chunkable(model.lm_head)
    assert not chunkable(nn.Linear(8, 10, bias=True))
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    head = peft.base_model.model.lm_head
    assert not chunkable(head)  # its forward adds the adapter: weight @ h is not what it computes
    input_ids, labels, positions = batch(model.config.vocab_size)
    hidden = peft.base_model.model.model(input_ids=input_ids).last_hidden_state
    loss = summed_loss(hidden, head, labels, positions, chunk=5)  # the forced chunk is ignored
    assert type(loss.grad_fn).__name__ != "ChunkedCrossEntropyBackward"
    assert relative(loss, summed_loss(hidden, head, labels, positions)) < 1e-6


def test_loss_chunk_only_when_the_logits_exceed_the_budget():
    row = QWEN3_VOCAB * 4  # bytes of one row of fp32 logits
    assert loss_chunk(100, QWEN3_VOCAB) is None  # 61 MB
    assert loss_chunk(LOGITS_BUDGET_BYTES // row, QWEN3_VOCAB) is None  # exactly fits
    chunk = loss_chunk(32_768, QWEN3_VOCAB)  # a 32k-token text row: 20 GB of logits
    assert chunk is not None and chunk * row <= LOGITS_BUDGET_BYTES < (chunk + 1) * row
    assert loss_chunk(10, QWEN3_VOCAB, budget=row - 1) == 1  # at least one row


# ---- memory ------------------------------------------------------------------------------------


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensors created under it (forward and backward ops alike), counted by
    storage from its allocation to its release; tensors that existed before are not counted."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.live = self.peak = 0
        self.seen = weakref.WeakSet(t.untyped_storage() for t in existing)
        # Views of what existed (a weight's transpose) may come with a storage object of their own.
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and (storage := t.untyped_storage()) not in self.seen
                and storage.data_ptr() not in self.existing
            ):
                self.seen.add(storage)  # a view or an in-place op's output: already counted
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.release, storage.nbytes())
        return out

    def release(self, nbytes: int):
        self.live -= nbytes


def test_chunked_head_peak_memory_is_under_an_eighth_of_the_plain_heads():
    # Qwen3's vocabulary, every position labelled: 512 rows of fp32 logits are 311 MB; the budget
    # makes chunks of 32 rows (19 MB). Hidden is small so that the run stays fast on two cores.
    n, h = 512, 64
    hidden, weight, labels = inputs(n, h, QWEN3_VOCAB)
    chunk = loss_chunk(n, QWEN3_VOCAB, budget=32 * QWEN3_VOCAB * 4)
    assert chunk == 32

    def peak(head, *args) -> int:
        with PeakBytes(hidden, weight, labels) as probe:
            head(hidden, weight, labels, *args).backward()
        hidden.grad = weight.grad = None
        return probe.peak

    plain_peak = peak(plain)
    chunked_peak = peak(chunked_cross_entropy, chunk)
    print(f"loss head peak: plain {plain_peak / 2**20:.0f} MiB, chunked {chunked_peak / 2**20:.0f} MiB")
    assert plain_peak >= 2 * n * QWEN3_VOCAB * 4  # the probe sees the logits and their gradient
    assert chunked_peak <= plain_peak / 8
