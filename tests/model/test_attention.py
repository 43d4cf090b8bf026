"""Attention kernels: packed rows equal each document alone under every kernel that runs on the CPU,
and the default packed path never hands a kernel a dense (T, T) mask."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import distft.model.attention as attention
from distft.config import ModelConfig
from distft.measure.overlap import CommTimeline
from distft.model import load_base_model
from distft.model.attention import document_block_mask, packed_attention_masks, resolve_attention
from distft.tensors import document_ids

LENGTHS = (70, 150, 33, 200)  # four documents, crossing 128-token tiles mid-document


def packed_row(lengths=LENGTHS, seed=0):
    ids = torch.randint(0, 1000, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions


def micro(kernel: str):
    return load_base_model(ModelConfig(name="micro"), attention=kernel)


def each_document_alone(model, ids, lengths=LENGTHS) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        out.append(model.model(input_ids=ids[:, start : start + n]).last_hidden_state)
        start += n
    return torch.cat(out, dim=1)


def packed(model, ids, positions) -> torch.Tensor:
    masks = (
        packed_attention_masks(model.config, positions)
        if model.config._attn_implementation == "distft_flex"
        else None
    )
    return model.model(input_ids=ids, position_ids=positions, attention_mask=masks).last_hidden_state


def test_document_block_mask_skips_other_documents_tiles():
    _, positions = packed_row()
    mask = document_block_mask(document_ids(positions))
    dense = mask.to_dense()[0, 0]  # (q tiles, kv tiles): 1 where a tile is computed
    n = dense.shape[0]
    assert n == 4  # 453 tokens in 128-token tiles
    # Tile (3, 0) holds the last document's queries (from 253) against keys 0..127 (documents 0 and
    # 1): nothing to compute there, so flex skips it; causal attention alone would not.
    assert dense[3, 0] == 0 and dense.tril().sum() < n * (n + 1) // 2
    assert (dense.triu(1) == 0).all()  # nothing above the diagonal


@pytest.mark.parametrize("kernel", ["flex", "sdpa", "eager"])
def test_packed_equals_each_document_alone_logits_and_gradients(kernel):  # flex: the CPU's path
    ids, positions = packed_row()
    model, reference = micro(kernel), micro("sdpa")
    got, want = packed(model, ids, positions), each_document_alone(reference, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))  # a loss of every output
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        # fp32 rounding of different kernels (a masked T x T softmax against per-document ones)
        error = (p.grad - q.grad).norm() / q.grad.norm()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


def test_flex_kernel_with_the_document_block_mask_equals_each_document_alone(monkeypatch):
    """FlexAttention itself, the CUDA path (on the CPU: a forward; it has no CPU backward)."""
    monkeypatch.setattr(attention, "flex_runs_on", lambda device: True)
    ids, positions = packed_row()
    model, reference = micro("flex"), micro("sdpa")
    calls = []
    real = attention._flex
    monkeypatch.setattr(attention, "_flex", lambda *a: calls.append(a[3]) or real(*a))
    with torch.no_grad():
        got, want = packed(model, ids, positions), each_document_alone(reference, ids)
    assert len(calls) == 4 and all(isinstance(m, BlockMask) for m in calls)  # one per layer
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_the_default_packed_path_never_hands_a_kernel_a_dense_mask(monkeypatch):
    """Spy on every attention kernel while a default-configured model trains and evaluates on
    packed rows and on a row of one document: no call gets a (T, T) mask."""
    masks = []
    sdpa, flex = F.scaled_dot_product_attention, attention.flex_attention

    def spy_sdpa(q, k, v, attn_mask=None, **kw):
        masks.append(("sdpa", attn_mask, kw.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def spy_flex(q, k, v, block_mask=None, **kw):
        masks.append(("flex", block_mask, None))
        return flex(q, k, v, block_mask=block_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(attention, "flex_attention", spy_flex)
    kernel = resolve_attention(ModelConfig().attn_implementation, "cpu", torch.float32)
    model = micro(kernel)
    ids, positions = packed_row()
    packed(model, ids, positions).sum().backward()  # the CPU: one causal SDPA per document
    with torch.no_grad():
        packed(model, ids, positions)
        model.model(input_ids=ids[:, :70])  # one document: causal SDPA, no mask
        monkeypatch.setattr(attention, "flex_runs_on", lambda device: True)
        packed(model, ids, positions)  # the CUDA path: FlexAttention with the block mask
    kinds = [kind for kind, _, _ in masks]
    assert kinds.count("flex") == 4 and kinds.count("sdpa") == 4 * (len(LENGTHS) * 2 + 1)
    for kind, mask, causal in masks:
        assert mask is None or isinstance(mask, BlockMask), f"{kind} got a {type(mask).__name__} mask"
        assert kind == "flex" or causal


def test_auto_takes_flash_where_it_runs_else_flex(monkeypatch):
    assert resolve_attention("auto", "cpu", torch.bfloat16) == "flex"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert resolve_attention("auto", "cuda", torch.bfloat16) == "flash"
    assert resolve_attention("auto", "cuda", torch.float32) == "flex"  # flash-attn takes bf16/fp16 only
    assert resolve_attention("sdpa", "cuda", torch.bfloat16) == "sdpa"


def test_flex_attention_runs_under_the_byte_counter(monkeypatch):
    """FlexAttention is a higher-order operator: run eagerly while a step is measured (blocks left
    eager by a compile fallback) it must pass through the counter."""
    monkeypatch.setattr(attention, "flex_runs_on", lambda device: True)
    ids, positions = packed_row()
    model = micro("flex")
    with torch.no_grad():
        want = packed(model, ids, positions)
        with CommTimeline() as counter:
            got = packed(model, ids, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not counter.stats.bytes and counter.compute  # computed, no collective
