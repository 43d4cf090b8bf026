"""Compiled decoder blocks: `torch.compile` per decoder layer (every family's), as torchtitan and torchtune do.

Compiling each block rather than the whole model keeps compile time to one block's graph (every
layer has the same shapes, so the compiled code is reused), leaves the embeddings, the loss head
and the optimizer eager, and lets FSDP wrap each compiled block as its own sharding unit: blocks
are compiled *before* the strategy wraps them. The LoRA adapters (peft's `lora_A`/`lora_B`) sit
inside the blocks and are compiled with them. `Module.compile()` compiles in place: parameter
names, state dicts and the exported adapter stay exactly those of the eager model.

What is seen (`CompileStats`, per rank, in `metrics.jsonl`, `ranks.json` and the printed lines):
every graph the backend is handed is counted (`compiled_graphs`), and so is every one compiled for
a frame that already had one (`recompiles`: a guard failed, e.g. a new shape, grad mode or a
one-document batch); dynamo's graph breaks too (`graph_breaks`). A run never says "compiled" when
no graph compiled.

Bounded recompiles. All layers share one code object, so their variants share dynamo's recompile
limit (8); past it they silently run eagerly. Blocks compile with `dynamic=True` (the sequence
length is symbolic from the first graph, no static-then-dynamic pair), and packed rows are padded
to a multiple of `SEQUENCE_BUCKET` tokens, at least two (`distft.data.batches.pack`): guards on
the length's alignment hold for every row, and the block mask never has a tile dimension of size
1, which dynamo would specialise. What remains is an enumerable set of variants: train and
evaluation (grad mode) x several documents or one (a block mask or none): 4. The training loop's
evaluation runs under `eager_on_recompile` (`distft.train.step.evaluate`): a few batches without
grad run the blocks eagerly instead of compiling each one again. Under LoRA the embedding is
frozen, so the first layer's input would need no grad and every later layer's would: two graphs
of every block, and on CUDA a second inductor compile in step 1. The embedding's output is marked
as requiring grad instead (`_one_graph_for_every_layer`), which costs the first layer's input
gradient (about 1/L of backward's input-gradient work) and saves that whole compile. On the CPU,
where FlexAttention has no backward, training attention runs eagerly between graphs; the frames
resumed after it repeat the same variants once more. The limit is raised to `RECOMPILE_LIMIT` to
hold that with room; the tests drive every variant under `fail_on_recompile_limit_hit` and check
new lengths compile nothing.

A fallback (`model.compile`): `auto` (on CUDA where the strategy takes compiled blocks; off on the
CPU, where inductor's C++ code buys little and costs minutes) falls back to eager when the backend
cannot build a graph (no Triton, no C compiler, an inductor bug), with one line that says why,
recorded as `compile_fallback`; `true` fails loudly instead. `model.compile_backend` names the
backend (`inductor`; `aot_eager` traces and runs AOT autograd without code generation: the tests'
choice on the CPU).

A warm first step (`model.compile_cache`). Step 1 pays for the compile: dynamo traces a block, AOT
autograd splits forward from backward, inductor generates and Triton builds the kernels. The last
three are cached on disk by torch itself (the FX graph cache and the AOT autograd cache, keyed by the
graph, the torch version, the device and inductor's settings), in `TORCHINDUCTOR_CACHE_DIR`, by
default a folder under /tmp that a reboot or a fresh container loses. distft points it at its own
cache dir, one folder per torch version and device (`compile_cache_dir`), so a second run of the
same model shape finds every kernel built: only dynamo's trace is left to do.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.exc import RestartAnalysis, SkipFrame
from torch._dynamo.utils import counters
from torch._guards import CompileContext

from distft.errors import TrainingError
from distft.model.lm import causal_lm
from distft.text import plural

SEQUENCE_BUCKET = 128  # packed rows are padded to a multiple of this (one flex tile) when blocks compile
RECOMPILE_LIMIT = 16  # per code object: the variants below, twice over (see the module docstring)


class CompileError(TrainingError):
    """`model.compile=true` and the backend could not build a graph."""

    every_rank = False  # every rank compiles the same graph and fails the same way


@contextlib.contextmanager
def compile_errors_unwrapped() -> Iterator[None]:
    """Around a step: dynamo wraps what a backend raises; a `CompileError` reaches the user bare."""
    try:
        yield
    except torch._dynamo.exc.BackendCompilerFailed as err:
        inner = getattr(err, "inner_exception", None)
        if isinstance(inner, CompileError):
            raise inner from None
        raise


def compile_wanted(setting: str, device: torch.device, strategy_supports: bool) -> bool:
    """Whether to compile the decoder blocks: `true`, or `auto` on CUDA, where the strategy can."""
    if setting == "true":
        return True
    return setting == "auto" and device.type == "cuda" and strategy_supports


def compile_cache_dir(setting: str, auto: Path, device: torch.device) -> Path | None:
    """Where inductor keeps what it builds (`model.compile_cache`): `auto` -> under `auto` (distft's
    cache dir), a path -> under it, `off` -> None (torch's own default). One folder per torch
    version and device, so a cache never meets kernels built for another."""
    if setting == "off" or (setting == "auto" and "TORCHINDUCTOR_CACHE_DIR" in os.environ):
        return None  # torch's default, or the folder the user named
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    slug = re.sub(r"[^a-z0-9.]+", "-", f"torch-{torch.__version__}-{name}".lower()).strip("-")
    return (auto if setting == "auto" else Path(setting).expanduser()) / slug


def use_compile_cache(folder: Path | None) -> None:
    """Compile into `folder` (None: leave torch's choice), with torch's on-disk caches on. A
    TORCHINDUCTOR_CACHE_DIR the user set before the run wins over distft's default folder."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


@dataclass
class CompileStats:
    """What compiled in this process: counted by `FallbackBackend` (and dynamo's graph breaks)."""

    graphs: int = 0
    recompiles: int = 0
    fallback: str | None = None  # why the blocks run eagerly after a failed compile (`auto`)
    _compiles: set = field(default_factory=set)  # (frame id, its compile number) seen
    _breaks_at_start: int = field(default_factory=lambda: _graph_breaks())

    @property
    def graph_breaks(self) -> int:
        return _graph_breaks() - self._breaks_at_start

    def record(self) -> dict:
        """The figures `metrics.jsonl` and `ranks.json` carry."""
        out = {
            "compiled_graphs": self.graphs,
            "recompiles": self.recompiles,
            "graph_breaks": self.graph_breaks,
        }
        if self.fallback:
            out["compile_fallback"] = self.fallback
        return out

    def describe(self) -> str:
        """One line: what compiled, or that nothing did."""
        if self.fallback:
            return f"compile fell back to eager ({self.fallback})"
        if not self.graphs:
            return "no graph compiled (eager)"
        return (
            f"compiled decoder layers: {plural(self.graphs, 'graph')}, {plural(self.recompiles, 'recompile')}, "
            f"{plural(self.graph_breaks, 'graph break')}"
        )


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


class FallbackBackend:
    """A torch.compile backend that counts what it compiles and, unless `strict`, hands back the
    graph to run eagerly when the real backend fails (dynamo then runs that frame's ops as traced)."""

    def __init__(self, backend: str, strict: bool, stats: CompileStats):
        self.backend, self.strict, self.stats = backend, strict, stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        if self.stats.fallback:  # one failure is enough: every later graph runs eagerly too
            return gm.forward
        try:
            compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        except (RestartAnalysis, SkipFrame):  # dynamo's own control flow, not a failure
            raise
        except Exception as err:
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".strip()
            if self.strict:
                raise CompileError(
                    f"model.compile=true, and the {self.backend} backend could not compile a decoder "
                    f"layer ({reason}). Set model.compile=auto to fall back to eager, or false."
                ) from err
            # Said once, by the logging rank: the line after step 1 and the end-of-run line.
            self.stats.fallback = f"{self.backend} failed: {reason}"
            return gm.forward
        compile_id = CompileContext.current_compile_id()
        if compile_id is not None:  # a new compile of a frame already compiled: a recompile
            frame, attempt = compile_id.frame_id, compile_id.frame_compile_id
            seen = {f for f, _ in self.stats._compiles}
            self.stats.recompiles += frame in seen and (frame, attempt) not in self.stats._compiles
            self.stats._compiles.add((frame, attempt))
        self.stats.graphs += 1
        return compiled


def compile_blocks(model: nn.Module, backend: str = "inductor", strict: bool = False) -> CompileStats:
    """Compile every decoder layer of `model` (a causal LM, PEFT-wrapped or not) in place; the
    returned stats fill as graphs compile (on each block's first forward)."""
    stats = CompileStats()
    fallback = FallbackBackend(backend, strict, stats)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    backbone = causal_lm(model).model
    backbone.embed_tokens.register_forward_hook(_input_requires_grad)
    for layer in backbone.layers:
        layer.compile(backend=fallback, dynamic=True)
    return stats


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
