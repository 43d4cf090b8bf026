"""What a decoder layer keeps for backward: `model.activation_checkpointing`.

Backward needs tensors forward computed: the input of every matmul (for its weight gradient, and
for LoRA's), the normalised inputs, the MLP's gate and up projections and their product, the
attention output and its log-sum-exp. For Qwen3-4B that is ~34 values of hidden size per token
and layer in bf16 (the planner counts them exactly: `distft.plan.activations`), and it grows with
the sequence: at 32k tokens and 36 layers, ~75 GiB. Four levels trade that memory for compute:

- `none`: keep everything. The fastest step; the activations grow as layers x tokens.
- `full`: keep only each layer's input (one hidden vector per token); backward runs the layer's
  forward again before its backward (`torch.utils.checkpoint`, non-reentrant): one more forward
  of compute, ~1/3 more per step, for ~1/30 of the memory. (Not transformers' own switch, which
  also makes the frozen embedding's output require a gradient under LoRA: a backward through
  the first layer's input for nothing, and under tp-sp one more collective.)
- `selective`: keep the attention's saved tensors, recompute the MLP. The MLP's gate, up,
  activation and product (4 x intermediate per token: ~15 hidden vectors for Qwen3, about half a
  layer's activations) are the cheapest to rebuild (three matmuls, linear in the sequence), while
  the attention, quadratic in the sequence, is never recomputed: the level for long sequences
  that almost fit.
- `offload`: `full`, and each layer's input leaves the GPU as forward saves it, into pinned host
  memory, and comes back when backward reaches the layer (`HostOffload`). The device then holds
  one layer's activations at a time, whatever the depth; the host holds layers x tokens x hidden.
  On CUDA the copy out runs on a side stream, overlapping the next layer's compute; the copy back
  is ordered on the compute stream before the recomputation that needs it. On the CPU the input
  is already in host memory: nothing moves, and the level is `full`.

A tiled MLP (`model.mlp_tiles = k`, ALST's TiledMLP) goes further for the MLP, whatever the level:
the MLP runs on k slices of the sequence, each checkpointed, so its four intermediate-sized
tensors exist for one slice at a time, in forward and in backward's recomputation alike. Under
`full` or `offload` that is what bounds the peak at long context: one layer's recomputation,
whose largest part is the MLP's, shrinks to the attention's plus 1/k of the MLP's.

`enable_checkpointing` sets the level on the causal LM before a strategy wraps or compiles it;
`run_layers` (`distft.model.lm`) and the Megatron layers install `HostOffload` around their loop
over the layers when the layers say so (`offloads`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

OFFLOAD = "distft_offload_input"  # set on each decoder layer whose input goes to the host


def enable_checkpointing(inner: PreTrainedModel, level: str, mlp_tiles: int = 0) -> None:
    """Make every decoder layer of `inner` (the causal LM inside any peft wrapper) keep what
    `level` says, its MLP computed in `mlp_tiles` checkpointed slices of the sequence (0, 1: whole)."""
    for layer in inner.model.layers:
        if mlp_tiles > 1:
            tile_sequence(layer.mlp, mlp_tiles)  # checkpointed per tile: selective's, and less
        elif level == "selective":
            recompute_in_backward(layer.mlp)
        if level in ("full", "offload"):
            recompute_in_backward(layer)
        setattr(layer, OFFLOAD, level == "offload")


def tile_sequence(module: nn.Module, tiles: int) -> None:
    """Run a position-wise module (the MLP) on `tiles` slices of its (batch, seq, hidden) input,
    each checkpointed: forward keeps only the slices, backward rebuilds one slice's activations at
    a time. The same values: every position is computed alone anyway."""
    forward = module.forward

    @functools.wraps(forward)
    def tiled(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return forward(x)
        parts = x.chunk(tiles, dim=1)
        return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in parts], dim=1)

    module.forward = tiled


def recompute_in_backward(module: nn.Module) -> None:
    """Checkpoint one module in place: its forward keeps only its inputs. Its parameters keep their
    names (no wrapper module), so checkpoints, adapters and sharding plans see the same model. The
    recomputation calls the forward, not the module: under FSDP its parameters are gathered then by
    the pre-backward hook of the unit holding it (torchtitan's checkpoint wrapper works the same)."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def offloads(layers: list[nn.Module]) -> bool:
    return any(getattr(layer, OFFLOAD, False) for layer in layers)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """`with HostOffload():` every tensor autograd saves inside goes to host memory until backward.

    Around checkpointed layers, what autograd saves is each layer's input (the checkpoint keeps
    nothing else), so that is what moves. `bytes` counts what this forward put on the host.
    """

    def __init__(self) -> None:
        super().__init__(self._pack, self._unpack)
        self.bytes = 0

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        self.bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":  # already in host memory
            return tensor.device, tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream = _copy_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream())  # the tensor is complete before it is copied
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return tensor.device, host

    def _unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        if device.type != "cuda":
            return host
        torch.cuda.current_stream().wait_stream(_copy_stream(device))  # the copy out has landed
        return host.to(device, non_blocking=True)


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for the copies out, made once."""
    return torch.cuda.Stream(device)
