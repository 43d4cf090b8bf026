"""One optimizer step waits for the device once: the loss and the gradient norm, read together.

A `TorchDispatchMode` counts every op that makes the host wait for the device (a scalar read, an
index whose size is data) while a whole training step runs. On the CPU the step would take the
CPU's per-document attention (FlexAttention has no CPU backward); here a reference FlexAttention
with a backward stands in for the CUDA kernel, so the step walks the CUDA code path: document block
mask, label positions gathered by index, foreach clip, and fused AdamW (forced on the CPU).
"""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import distft.model.attention as attention
from distft.config import load_config
from distft.train.setup import setup
from distft.train.step import global_batch, train_step

aten = torch.ops.aten
HOST_SYNCS = {  # ops whose result the host needs (a value, or a size that depends on data)
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
}


class CountHostSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNCS or (func is aten.index.Tensor and _boolean_index(args)):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _boolean_index(args) -> bool:
    """`x[mask]`: its size is the mask's count, which the host must read."""
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


def reference_flex(query, key, value, block_mask=None, scale=None, enable_gqa=False):
    """FlexAttention's result with a backward: SDPA under the dense mask the block mask stands for."""
    positions = torch.arange(query.shape[2])
    zero = torch.zeros((1, 1), dtype=torch.long)  # batch 0, head 0, as tensors: no scalar read
    allowed = block_mask.mask_mod(zero, zero, positions[:, None], positions[None, :])
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa
    )


def test_a_step_syncs_the_host_once(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "flex_runs_on", lambda device: True)
    monkeypatch.setattr(attention, "flex_attention", reference_flex)
    flex_calls = []
    real = attention._flex
    monkeypatch.setattr(attention, "_flex", lambda *a: flex_calls.append(1) or real(*a))
    cfg = load_config(
        None,
        ["model.name=micro", "optim.fused=true", "train.global_batch_size=4", "train.micro_batch_size=2",
         "data.max_rows=16", "data.max_length=256", f"output.dir={tmp_path}"],
    )  # fmt: skip
    run = setup(cfg)
    assert run.optimizer.defaults["fused"] is True and run.attention == "flex"
    examples = global_batch(run, 1)
    with CountHostSyncs() as syncs:
        *_, updated = train_step(run, examples, 1, lambda model, step: None)
    assert updated and flex_calls  # the packed rows ran the block-mask kernel
    # None inside: the step's one read is `.tolist()` of the stacked loss and norm, a copy to the host
    # that no dispatched op shows. Without label positions the head's boolean index would show here
    # (once per micro-batch), and so would the for-loop AdamW's `.item()` of every step count.
    assert not syncs.seen, "\n".join(syncs.seen)
