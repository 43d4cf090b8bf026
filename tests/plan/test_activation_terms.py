"""The activation model's per-layer terms against what the CPU's kernels save, layer by layer.

One forward of the `micro` preset on the CPU (fp32, LoRA, `model.attn_implementation=auto`, which
runs as flex and, there, as SDPA: `distft.model.attention`), with a saved-tensor probe that puts
each saved storage on the decoder layer that saved it first. Every layer after the first must keep
what `layer_activation_bytes` says on `device="cpu"`, and the forward what `activation_bytes` says,
to the byte: a packed row (one SDPA per document, whose concatenated outputs o_proj keeps a copy
of) at every activation checkpointing level, padded rows (transformers' dense mask, as under
`sdpa`), `sdpa` on a packed row (its block-diagonal mask), and context parallelism's two methods on
either rank of 2, run in this process over a fake process group (shapes are all that count here).
`expected_activations`, what a run records beside its measure, is held to the same forward.
A kernel or lever that starts keeping something else fails here first.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from distft.config import load_config
from distft.distributed import DistEnv
from distft.measure.activations import SavedActivations
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.model.checkpointing import enable_checkpointing
from distft.parallel.context import ContextParallel
from distft.plan.activations import activation_bytes, layer_activation_bytes
from distft.plan.attention import context_masks
from distft.plan.expected import expected_activations
from distft.plan.inputs import PRECISIONS, Parallelism, Training
from distft.plan.model_spec import resolve_model

SPEC = resolve_model("micro")
DOCS, SEQ, LABELS = 4, 128, 8  # a packed micro-batch: 4 documents of 128 tokens, loss on 8 each


class PerLayer(SavedActivations):
    """`SavedActivations`, with the bytes of each decoder layer (the layer that saved a storage
    first) and of what lies outside them (`per["outside"]`)."""

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList):
        super().__init__(model)
        self.where: int | str = "outside"
        self.owner: dict[int, int | str] = {}
        self.per: collections.Counter = collections.Counter()
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "where", i))
            layer.register_forward_hook(lambda *_: setattr(self, "where", "outside"))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        known = set(self._saved)
        out = super()._pack(t)
        self.owner.update(dict.fromkeys(set(self._saved) - known, self.where))
        return out

    def __exit__(self, *exc: object) -> None:
        for ptr, (n, storage) in self._saved.items():
            if not storage.expired():
                self.per[self.owner[ptr]] += n
        super().__exit__(*exc)


def build(attn: str = "auto", level: str = "none", extra: tuple[str, ...] = ()):
    cfg = load_config(
        None,
        ["model.name=micro", "train.method=lora", "model.dtype=float32", f"model.attn_implementation={attn}",
         "lora.rank=5", f"model.activation_checkpointing={level}", *extra],
    )  # fmt: skip
    torch.manual_seed(0)
    lm = apply_method(load_base_model(cfg.model), cfg)
    enable_checkpointing(causal_lm(lm), level)
    return cfg, LossLM(lm).train()


def packed_row() -> dict[str, torch.Tensor]:
    """DOCS documents end to end in one row, as `data.packing` builds it: positions restart at each."""
    g = torch.Generator().manual_seed(0)
    labels = torch.full((DOCS, SEQ), -100)
    labels[:, SEQ - LABELS - 1 : SEQ - 1] = torch.randint(0, 1000, (DOCS, LABELS), generator=g)
    return {
        "input_ids": torch.randint(0, 1000, (1, DOCS * SEQ), generator=g),
        "labels": labels.view(1, -1),
        "position_ids": torch.arange(SEQ).repeat(DOCS).view(1, -1),
    }


def padded_rows() -> dict[str, torch.Tensor]:
    """Two rows of SEQ, the second 9 tokens short (right-padded): a padding mask reaches attention."""
    g = torch.Generator().manual_seed(0)
    mask, labels = torch.ones(2, SEQ, dtype=torch.long), torch.full((2, SEQ), -100)
    mask[1, -9:] = 0
    for row, n in enumerate((SEQ, SEQ - 9)):
        labels[row, n - LABELS - 1 : n - 1] = torch.randint(0, 1000, (LABELS,), generator=g)
    return {
        "input_ids": torch.randint(0, 1000, (2, SEQ), generator=g),
        "labels": labels,
        "attention_mask": mask,
    }


def training(rows: int, level: str = "none", **kw) -> Training:
    return Training(
        method="lora", precision=PRECISIONS["fp32"], lora_rank=5, seq_len=SEQ, micro_batch=rows,
        label_tokens=LABELS, autocast=False, activation_checkpointing=level, **{"device": "cpu", **kw},
    )  # fmt: skip


def measure(model: torch.nn.Module, layers: torch.nn.ModuleList, batch: dict) -> PerLayer:
    with PerLayer(model, layers) as probe:
        loss = model(**batch)  # alive until the probe counts: no saved storage freed
    del loss
    return probe


@pytest.mark.parametrize("level", ["none", "selective", "full", "offload"])
def test_a_packed_row_on_the_cpu_layer_by_layer(level):
    _, model = build(level=level)
    probe = measure(model, model.backbone.layers, packed_row())
    t, par = training(DOCS, level, packed=True), Parallelism("single")
    keeps = {"none": layer_activation_bytes(SPEC, t, par, True, level)[0]}
    keeps["selective"] = keeps["none"]
    keeps["full"] = 4 * DOCS * SEQ * SPEC.hidden_size  # the layer's input, the checkpoint's
    keeps["offload"] = 0  # in host memory
    for i in range(1, SPEC.num_layers):
        assert probe.per[i] == keeps[level], (level, i, probe.per[i])
    want = activation_bytes(SPEC, t, par)
    # Whole-layer checkpointing: rotary cos/sin are held by the checkpoint's closure, unseen by the hook.
    assert want.saved == probe.bytes + (want.detail["rotary"] if level in ("full", "offload") else 0)
    if level == "none":  # the CPU's copy of the documents' outputs: more than CUDA's kernels keep
        cuda = layer_activation_bytes(SPEC, training(DOCS, packed=True, device="cuda"), par)[0]
        assert keeps["none"] - cuda == 4 * DOCS * SEQ * SPEC.num_heads * SPEC.head_dim


@pytest.mark.parametrize(
    "attn,batch,packed",
    [("auto", padded_rows, False), ("sdpa", padded_rows, False), ("sdpa", packed_row, True)],
)
def test_dense_masks_on_the_cpu(attn, batch, packed):
    """Flex has no CPU backward: a padded batch takes transformers' SDPA and its dense mask there,
    as `sdpa` does anywhere; `sdpa` on a packed row keeps the row's block-diagonal mask."""
    _, model = build(attn)
    probe = measure(model, model.backbone.layers, batch())
    rows = DOCS if packed else 2
    t = training(rows, attention=attn, packed=packed, padded=not packed)
    assert probe.per[1] == layer_activation_bytes(SPEC, t, Parallelism("single"))[0]
    assert probe.bytes == activation_bytes(SPEC, t, Parallelism("single")).saved


@pytest.fixture
def fake_group():
    """A fake 2-rank process group in this process: collectives keep shapes, move nothing."""

    def start(rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize("rank", [0, 1])
def test_context_parallel_on_the_cpu_layer_by_layer(fake_group, method, rank):
    fake_group(rank)
    cfg, lm = build(extra=("parallel.strategy=cp", "parallel.nproc=2", f"parallel.cp_method={method}"))
    strategy = ContextParallel(cfg, DistEnv(rank, 2, rank, torch.device("cpu"), "fake"))
    model = strategy.parallelize(lm)
    batch = packed_row()
    probe = measure(model, lm.backbone.layers, batch)
    t, par = training(DOCS, packed=True), Parallelism.at("cp", cp=2, cp_method=method)
    for i in range(1, SPEC.num_layers):
        assert probe.per[i] == layer_activation_bytes(SPEC, t, par)[0], (method, rank, i)
    # Each rank holds two of the four documents' labels (L = SEQ): the fullest rank's share.
    want = activation_bytes(SPEC, t, par)
    assert probe.bytes == want.saved
    masks = 4 * 5 * SEQ * SEQ if method == "allgather" else 0  # (2N+1) L^2 fp32, built once per forward
    assert context_masks(t, par) == want.detail.get("attention masks", 0) == masks
    # What a run records beside its measure: the model on this micro-batch, this rank's labels.
    assert expected_activations(cfg, strategy, model, SPEC, batch) == probe.bytes
