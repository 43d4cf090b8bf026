"""Compiled decoder blocks: the same loss and gradients as eager, and refused where a strategy cannot take them."""

import copy

import pytest
import torch

from distft.config import load_config
from distft.data import IGNORE, Example, label_positions, pack
from distft.errors import ConfigError
from distft.measure.comm import CommCounter
from distft.model import LossLM, apply_method, load_base_model
from distft.model.compile import (
    SEQUENCE_BUCKET,
    CompileError,
    compile_blocks,
    compile_cache_dir,
    compile_errors_unwrapped,
    compile_wanted,
    use_compile_cache,
)
from distft.parallel import check_config

# Inductor's CPU kernels fuse and reorder fp32 reductions (RMSNorm, softmax, SiLU*up), so results
# differ from eager by rounding. The loss to 1e-5 relative; each gradient tensor to 1e-4 in relative
# norm of the difference (an element near zero can differ by 1e-3 of itself, as in any parallel run).
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def lora_micro() -> LossLM:
    cfg = load_config(None, ["model.name=micro", "lora.rank=4"])
    torch.manual_seed(0)
    return LossLM(apply_method(load_base_model(cfg.model), cfg))


def loss_and_grads(model: LossLM, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_compiled_blocks_match_eager_loss_and_gradients():
    eager = lora_micro()
    with torch.no_grad():  # a non-zero lora_B, so lora_A gets a gradient too
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    compiled = copy.deepcopy(eager)
    stats = compile_blocks(compiled.lm)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 4000, (2, 48), generator=gen)
    labels = torch.where(torch.arange(48) >= 24, torch.roll(ids, -1, 1), -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    want_loss, want = loss_and_grads(eager, batch)
    got_loss, got = loss_and_grads(compiled, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0.0)
    assert got.keys() == want.keys() and any("lora_A" in n for n in got)
    for name in want:
        error = (got[name] - want[name]).norm() / want[name].norm()
        assert error < GRAD_RTOL, f"{name}: relative error {error:.2e}"
    # In place: the names (and so the exported adapter) are those of the eager model.
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert stats.graphs >= 1 and stats.fallback is None


def test_auto_compiles_on_cuda_only_where_the_strategy_can():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_wanted("auto", cuda, strategy_supports=True)
    assert not compile_wanted("auto", cuda, strategy_supports=False)
    assert not compile_wanted("auto", cpu, strategy_supports=True)
    assert compile_wanted("true", cpu, strategy_supports=True)
    assert not compile_wanted("false", cuda, strategy_supports=True)


@pytest.mark.parametrize("strategy", ["tp", "tp-sp", "fsdp+tp", "fsdp+tp+pp"])
def test_compile_true_is_refused_before_launch_where_blocks_are_rewritten(strategy):
    cfg = load_config(None, [f"parallel.strategy={strategy}", "parallel.nproc=2", "model.compile=true"])
    with pytest.raises(ConfigError, match=r"model\.compile=true cannot run with --strategy"):
        check_config(cfg)


def test_compile_setting_is_checked():
    with pytest.raises(ConfigError, match=r"model\.compile"):
        load_config(None, ["model.compile=yes"])


# ---- compile seen to be on, bounded, and with a fallback --------------------------------------


@pytest.fixture
def fresh_dynamo():
    """Every decoder layer shares one code object: start each test from an empty dynamo cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def packed_batch(lengths: tuple[int, ...], seed: int = 0) -> dict:
    """A packed row of documents of `lengths`, bucketed as training buckets it, with label positions."""
    g = torch.Generator().manual_seed(seed)
    examples = [Example(torch.randint(0, 900, (n,), generator=g).tolist(), [IGNORE] * (n // 2) + list(range(n - n // 2)), 0) for n in lengths]  # fmt: skip
    batch = pack(examples, pad_id=0, multiple=SEQUENCE_BUCKET)
    batch["label_positions"] = label_positions(batch["labels"])
    return batch


# Every variant a run meets, each a graph of its own (`distft.model.compile`): train and evaluation
# (grad mode), a packed row (block mask) or one document filling its buckets (no mask), the first
# layer (its input needs no grad) and the rest. The length is symbolic and rows span at least two
# tiles, so new lengths add none. On the CPU the per-document attention of training runs eagerly
# between graphs (FlexAttention has no CPU backward): training graphs come in pieces.
GRAPH_BOUND = 24


@torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True)  # restored after
def test_recompiles_stay_bounded_over_lengths_documents_and_evaluation(fresh_dynamo):
    model = lora_micro()
    stats = compile_blocks(model.lm, backend="aot_eager", strict=True)

    def train_and_evaluate(rows: list[tuple[int, ...]]) -> None:
        for step, lengths in enumerate(rows):
            model(**packed_batch(lengths, seed=step)).backward()  # raises past the limit
            with torch.no_grad():
                model(**packed_batch(lengths, seed=step))

    # The byte counter is a TorchDispatchMode, active around every measured step: dynamo must still
    # compile under it (a mode that does not ignore compile internals switches compile off for good).
    with CommCounter():
        model(**packed_batch((40, 60))).backward()
    assert stats.graphs >= 1, stats.describe()
    # Every layer the same graph: the first one's input requires grad too (frozen embedding, LoRA).
    assert stats.recompiles == 0, stats.describe()
    train_and_evaluate([(40, 60), (256,)])  # several documents; one document, no fill
    seen = stats.graphs
    assert seen <= GRAPH_BOUND, stats.describe()
    train_and_evaluate([(200, 31, 90), (17,), (128, 300), (333, 2)])
    assert stats.graphs == seen, f"new lengths compiled again: {stats.describe()}"


def test_qlora_blocks_trace_through_aot_autograd(fresh_dynamo):
    """QLoRA's NF4 projections inside compiled blocks, through dynamo and AOT autograd: the same
    loss and LoRA gradients as eager."""
    cfg = load_config(None, ["model.name=micro", "train.method=qlora", "model.quant_scaler_block_size=4"])

    def qlora_micro() -> LossLM:  # built twice alike: NF4 tensors do not deep-copy
        torch.manual_seed(0)
        return LossLM(apply_method(load_base_model(cfg.model), cfg))

    eager, compiled = qlora_micro(), qlora_micro()
    stats = compile_blocks(compiled.lm, backend="aot_eager", strict=True)
    batch = packed_batch((100, 200))
    want_loss, want = loss_and_grads(eager, batch)
    got_loss, got = loss_and_grads(compiled, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0.0)
    for name in want:
        assert (got[name] - want[name]).norm() <= 1e-5 * want[name].norm(), name
    assert stats.graphs >= 1 and stats.fallback is None


def failing_inductor(*args, **kwargs):
    raise RuntimeError("Cannot find a working triton installation")


def test_auto_falls_back_to_eager_when_the_backend_fails(fresh_dynamo, monkeypatch):
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", failing_inductor)
    eager, compiled = lora_micro(), lora_micro()
    stats = compile_blocks(compiled.lm, backend="inductor", strict=False)
    batch = packed_batch((40, 60))
    torch.testing.assert_close(compiled(**batch), eager(**batch), rtol=0, atol=0)
    assert stats.graphs == 0 and "working triton" in stats.fallback
    assert stats.record()["compile_fallback"] == stats.fallback
    assert stats.describe().startswith("compile fell back to eager")


def test_compile_true_fails_loudly_when_the_backend_fails(fresh_dynamo, monkeypatch):
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", failing_inductor)
    compiled = lora_micro()
    compile_blocks(compiled.lm, backend="inductor", strict=True)
    failure = pytest.raises(CompileError, match=r"model\.compile=true.*working triton.*model\.compile=auto")
    with failure, compile_errors_unwrapped():
        compiled(**packed_batch((40, 60)))


def test_compiled_kernels_are_kept_per_torch_version_and_device(tmp_path, monkeypatch):
    """`model.compile_cache`: auto -> distft's cache dir, a path -> there, off -> torch's default; a
    folder per torch version and device; TORCHINDUCTOR_CACHE_DIR set beforehand wins over auto.
    Inductor then reads and writes its FX graph and AOT autograd caches in that folder."""
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cpu = torch.device("cpu")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    auto = compile_cache_dir("auto", tmp_path / "distft", cpu)
    slug = f"torch-{torch.__version__}-cpu".replace("+", "-")  # torch-2.13.0-cpu-cpu: version, device
    assert auto.parent == tmp_path / "distft" and auto.name == slug
    assert (
        compile_cache_dir(str(tmp_path / "mine"), tmp_path / "distft", cpu) == tmp_path / "mine" / auto.name
    )
    assert compile_cache_dir("off", tmp_path / "distft", cpu) is None
    # config.patch, not monkeypatch: torch's config modules only undo their own patches cleanly.
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        use_compile_cache(auto)
        assert cache_dir() == str(auto) and auto.is_dir()
        assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert compile_cache_dir("auto", tmp_path / "distft", cpu) is None  # the user's folder stays
    assert compile_cache_dir("off", tmp_path / "distft", cpu) is None
