"""The rules a config must keep under the strategy it names, as pure functions of the config and
the strategy's `StrategySpec`: can it run QLoRA, DoRA, this optimizer, fp32 master weights, peft's
module copies, a preference objective, compiled blocks, float8, a mixture of experts; does it take
the layout settings given (`LAYOUT_TAKERS`), and which settings does it ignore (`READ_BY`).

The CLI runs them before any process is launched (`distft.parallel.check_config`, with each
strategy's own `validate_config` and the batch's shape), the planner keeps only the candidates they
let through, and `train` runs them again in every rank, where they are cheap: nothing here changes
the config, but `layout_left_behind` (a resume under another strategy) resets what it names.

The model's shape against a layout (`tp_split`, `stage_split`, `expert_split`: heads and MLP widths
divisible by tp, a layer per pipeline stage, experts divisible by ep) is asked here too, by the
runtime's model checks (`distft.parallel.check_model`) and the planner's candidate filter alike.
"""

from __future__ import annotations

from collections.abc import Callable

from distft.config import Config, ParallelConfig
from distft.config.choices import WITH_REFERENCE
from distft.config.io import override_value
from distft.errors import ConfigError
from distft.layout.spec import StrategySpec
from distft.layout.strategies import SPECS, takers


def check_rules(cfg: Config, spec: StrategySpec) -> None:
    """ConfigError for the first rule `cfg` breaks under `spec`'s strategy."""
    _check_method(cfg, spec)
    _check_training(cfg, spec)
    _check_beside_adapters(cfg, spec)
    _check_objective(cfg, spec)
    _check_layout(cfg, spec)
    _check_compile(cfg, spec)
    _check_fp8(cfg, spec)


def check_moe(cfg: Config, spec: StrategySpec) -> None:
    """A mixture of experts (`Family.moe`): a strategy taught to hold its expert stacks, and a
    base whose experts the method can hold."""
    model = cfg.model.name
    if not spec.runs("moe"):
        raise ConfigError(
            f"{model} is a mixture of experts, which --strategy {spec.name} has not been taught to "
            f"split: it runs with {_takers('moe')}."
        )
    if cfg.train.method == "qlora":
        raise ConfigError(
            f"--method qlora cannot run {model}: its NF4 base quantizes Linear layers, and the experts "
            "(nearly all of the weights) are fused parameter stacks. Use --method lora."
        )
    if cfg.model.fp8 != "off":
        raise ConfigError(
            f"model.fp8={cfg.model.fp8} cannot run {model}: float8 converts Linear layers, and the experts "
            "are fused parameter stacks that would stay bf16. Set model.fp8=off."
        )


# Settings that only some strategies read, and which: set away from its default under another
# strategy, a setting does nothing, and `ignored_settings` says so before launch (a warning: the
# run is still valid). parallel.dp/tp/pp, shard and max_restarts are refused instead (`_check_layout`).
def _strategies(reads: Callable[[StrategySpec], bool]) -> tuple[str, ...]:
    return tuple(name for name, cls in SPECS.items() if reads(cls))


_DDP = _strategies(lambda c: c.wraps == "ddp")  # torch's DistributedDataParallel
_FSDP = _strategies(lambda c: c.wraps == "fully_shard")  # `fsdp.shard_units`
_PIPELINES = _strategies(lambda c: c.pipelined)  # a pipeline schedule (`pipeline.layout`)
_PROCESS_GROUP = _strategies(lambda c: c.distributed)
READ_BY: dict[str, tuple[str, ...]] = {
    "parallel.ddp_bucket_mb": _DDP,
    "parallel.ddp_find_unused_parameters": _DDP,
    "parallel.ddp_broadcast_buffers": _DDP,
    "parallel.ddp_no_sync": _DDP,
    "parallel.ddp_gradient_as_bucket_view": _DDP,
    "parallel.ddp_static_graph": _DDP,
    "parallel.fsdp_param_dtype": _FSDP,
    "parallel.fsdp_reduce_dtype": _FSDP,
    "parallel.fsdp_output_dtype": _FSDP,
    "parallel.fsdp_cpu_offload": _FSDP,
    "parallel.fsdp_prefetch": _FSDP,
    "parallel.fsdp_wrap": _FSDP,
    "parallel.sequence_parallel": _strategies(lambda c: c.tensor_parallel == "megatron"),
    "parallel.cp_method": _strategies(lambda c: "cp" in c.dims),
    "parallel.schedule": _PIPELINES,
    "parallel.microbatches": _PIPELINES,
    "parallel.stages_per_rank": _PIPELINES,
    "parallel.pp_split": _PIPELINES,
    "parallel.timeout_s": _PROCESS_GROUP,
    "parallel.health_check": _PROCESS_GROUP,
    "parallel.health_timeout_s": _PROCESS_GROUP,
    "parallel.health_slow_s": _PROCESS_GROUP,
}


# The layout settings only some strategies take (`_check_layout` refuses them under the others).
LAYOUT_TAKERS: dict[str, Callable[[StrategySpec], bool]] = {
    **dict.fromkeys(("dp", "tp", "pp"), lambda c: c.sized),
    "cp": lambda c: c.sized and "cp" in c.dims,
    "shard": lambda c: c.shard_groups,
    **dict.fromkeys(("ep", "shard_experts"), lambda c: c.expert_groups),
}
GROUP_SETTINGS = {"shard": "shard groups", "ep": "expert groups", "shard_experts": "experts' layout"}


def _layout_takers(name: str) -> list[str]:
    return [strategy for strategy, cls in SPECS.items() if LAYOUT_TAKERS[name](cls)]


def layout_left_behind(cfg: Config, given: set[str]) -> list[str]:
    """A run resumed under another strategy: its saved `parallel.*` layout settings that `cfg`'s
    strategy does not take, back to their defaults in place (not those `given` here); a line each."""
    spec, defaults, lines = SPECS.get(cfg.parallel.strategy), ParallelConfig(), []
    for name, takes in LAYOUT_TAKERS.items() if spec else ():
        value, default = getattr(cfg.parallel, name), getattr(defaults, name)
        if value != default and not takes(spec) and f"parallel.{name}" not in given:
            setattr(cfg.parallel, name, default)
            was, now = override_value(value), override_value(default)
            lines.append(f"resumed under --strategy {spec.name}: parallel.{name}={was} reset to {now}")
    return lines


def ignored_settings(cfg: Config) -> list[str]:
    """One line per setting `cfg` moves from its default that its strategy does not read (`READ_BY`):
    the CLI prints them as warnings before launch."""
    strategy, defaults, lines = cfg.parallel.strategy, Config(), []
    for where, readers in READ_BY.items():
        section, key = where.split(".")
        value = getattr(getattr(cfg, section), key)
        if strategy in readers or value == getattr(getattr(defaults, section), key):
            continue
        others = [name for name in SPECS if name not in readers]
        who = (
            f"every strategy but {', '.join(others)} reads it"
            if len(others) < len(readers)
            else f"only {', '.join(readers)} {'read' if len(readers) > 1 else 'reads'} it"
        )
        lines.append(f"{where}={override_value(value)} does nothing under --strategy {strategy}: {who}.")
    return lines


def _check_method(cfg: Config, spec: StrategySpec) -> None:
    if cfg.train.method == "qlora" and not spec.runs("qlora"):
        raise ConfigError(
            f"--method qlora cannot run with --strategy {spec.name}: {spec.refusal('qlora')}. "
            f"QLoRA runs with {_takers('qlora')}; "
            f"or keep --strategy {spec.name} with --method lora."
        )


def _takers(feature: str) -> str:
    return ", ".join(takers(feature))


def _check_training(cfg: Config, spec: StrategySpec) -> None:
    """The LoRA variant, the optimizer and the master weights against what the strategy can hold."""
    name = spec.name
    if cfg.lora.variant == "dora" and cfg.train.method == "qlora":
        raise ConfigError(
            "lora.variant=dora cannot run with --method qlora: DoRA normalises each row of the base "
            "weight, and peft cannot dequantize distft's NF4 weights for it. Use --method lora with "
            "lora.variant=dora, or --method qlora with lora.variant=lora or rslora."
        )
    if cfg.lora.variant == "dora" and not spec.runs("dora"):
        raise ConfigError(
            f"lora.variant=dora cannot run with --strategy {name}: {spec.refusal('dora')}. DoRA runs "
            f"with {_takers('dora')}; or keep --strategy {name} with lora.variant=lora or rslora."
        )
    if cfg.optim.name not in spec.optimizers:
        takers = ", ".join(s for s, c in SPECS.items() if cfg.optim.name in c.optimizers)
        raise ConfigError(
            f"optim.name={cfg.optim.name} cannot run with --strategy {name}, which builds "
            f"{' or '.join(spec.optimizers)} (bitsandbytes' 8-bit state is plain tensors: no sharded "
            f"or partitioned parameters). It runs with {takers}; or use optim.name=adamw here."
        )
    if cfg.train.master_weights == "fp32" and cfg.train.method == "full" and not spec.runs("fp32_masters"):
        raise ConfigError(
            f"train.master_weights=fp32 cannot run with --strategy {name}: it computes with the weights "
            f"it holds, so fp32 masters would mean fp32 compute. fp32 masters run with "
            f"{_takers('fp32_masters')}; or set train.master_weights=model (bf16 weights and state)."
        )


def _check_beside_adapters(cfg: Config, spec: StrategySpec) -> None:
    """lora.modules_to_save, and model.added_tokens under LoRA (their rows train beside the
    adapters, `distft.model.tokens`), where the strategy can hold what peft trains there."""
    if cfg.train.method == "full":
        return
    setting = "lora.modules_to_save" if cfg.lora.modules_to_save else "model.added_tokens"
    if (cfg.lora.modules_to_save or cfg.model.added_tokens) and not spec.runs("modules_to_save"):
        raise ConfigError(
            f"{setting} cannot run with --method {cfg.train.method} under --strategy {spec.name}, which "
            f"{spec.refusal('modules_to_save')}; it runs with {_takers('modules_to_save')}."
        )
    if cfg.lora.modules_to_save and cfg.model.dtype == "bfloat16" and spec.shards != "none":
        takers = _strategies(lambda c: c.runs("modules_to_save") and c.shards == "none")
        raise ConfigError(
            f"lora.modules_to_save with model.dtype=bfloat16 cannot run under --strategy {spec.name}: "
            "peft's module copies train in bfloat16 beside float32 adapters, and its sharded optimizer "
            f"or parameter groups hold one dtype; it runs with {', '.join(takers)}, or in float32."
        )


def _check_objective(cfg: Config, spec: StrategySpec) -> None:
    """A preference objective (train.objective) runs under every strategy; it needs a reference
    (DPO, KTO: the base under the adapters, or scored first)."""
    objective = cfg.train.objective
    if objective == "sft":
        return
    if objective in WITH_REFERENCE and cfg.train.method == "full" and not cfg.dpo.precompute_reference:
        raise ConfigError(
            f"train.objective={objective} with --method full trains the base, the reference under LoRA: set "
            "dpo.precompute_reference=true (scored once before the first step), or use --method lora."
        )
    if objective in WITH_REFERENCE and spec.pipelined and not cfg.dpo.precompute_reference:
        raise ConfigError(
            f"train.objective={objective} under --strategy {spec.name}: no pipeline stage can run the "
            "base under disabled adapters inside the schedule; set dpo.precompute_reference=true."
        )
    if objective in WITH_REFERENCE and cfg.lora.init_adapter and not cfg.dpo.precompute_reference:
        raise ConfigError(
            f"train.objective={objective} from lora.init_adapter takes the base with that adapter as its "
            "reference, which disabling the adapters does not give: set dpo.precompute_reference=true."
        )


def master_weights(cfg: Config) -> str:
    """fp32 when a full finetune of a bf16 model keeps fp32 master weights (train.master_weights;
    auto: where the strategy can), else model: the weights train in the dtype they are stored in."""
    wanted = cfg.train.master_weights
    spec = SPECS.get(cfg.parallel.strategy)  # None: --strategy auto, not yet chosen
    fp32 = wanted == "fp32" or (wanted == "auto" and spec is not None and spec.runs("fp32_masters"))
    return "fp32" if fp32 and cfg.train.method == "full" and cfg.model.dtype == "bfloat16" else "model"


def _check_compile(cfg: Config, spec: StrategySpec) -> None:
    if cfg.model.compile == "true" and not spec.runs("compile"):
        raise ConfigError(
            f"model.compile=true cannot run with --strategy {spec.name}: it rewrites the decoder "
            "layers itself (DTensor plans, hand-written tensor-parallel layers or pipeline stages), "
            "which torch.compile'd blocks do not survive. Compiled blocks run with "
            f"{_takers('compile')}; or set "
            "model.compile=auto (it stays eager here)."
        )


FP8_METHODS = {"base": "lora", "all": "full"}  # model.fp8 value -> the method it runs with
FP8_WRONG_METHOD = {  # (model.fp8, --method) -> why not, and what to use instead
    ("base", "full"): ("a full finetune has no frozen base", "model.fp8=all"),
    ("base", "qlora"): ("QLoRA's frozen base is 4-bit NF4, not bf16", "--method lora"),
    ("all", "lora"): ("LoRA's base is frozen", "model.fp8=base"),
    ("all", "qlora"): ("QLoRA's frozen base is 4-bit NF4, not bf16", "--method full"),
}


def _check_fp8(cfg: Config, spec: StrategySpec) -> None:
    """model.fp8 (`distft.model.fp8`): its method, a bf16 model, a strategy that computes each
    Linear whole. The GPU is checked where it is known (`distft.model.fp8.check_fp8_hardware`)."""
    fp8, method = cfg.model.fp8, cfg.train.method
    if fp8 == "off":
        return
    if method != FP8_METHODS[fp8]:
        why, instead = FP8_WRONG_METHOD[fp8, method]
        raise ConfigError(
            f"model.fp8={fp8} runs with --method {FP8_METHODS[fp8]}, not {method} ({why}): use {instead}, "
            "or model.fp8=off."
        )
    if cfg.model.dtype != "bfloat16":
        raise ConfigError(
            f"model.fp8={fp8} casts bfloat16 weights and activations to float8: set model.dtype=bfloat16 "
            f"(it is {cfg.model.dtype}), or model.fp8=off."
        )
    if not spec.runs("fp8"):
        raise ConfigError(
            f"model.fp8={fp8} cannot run with --strategy {spec.name}: float8 Linear layers are taught to "
            f"run whole or FSDP-gathered ({_takers('fp8')}), not split by tensor or context "
            "parallelism, staged in a pipeline or under another wrapper. Use one of those, or model.fp8=off."
        )


def _check_layout(cfg: Config, spec: StrategySpec) -> None:
    par, takes = cfg.parallel, {name: taker(spec) for name, taker in LAYOUT_TAKERS.items()}
    if not takes["dp"] and (par.dp or par.tp != 1 or par.pp != 1):
        mesh = _layout_takers("dp")
        raise ConfigError(
            f"parallel.dp, parallel.tp and parallel.pp set the mesh of a multi-dimensional strategy "
            f"({', '.join(mesh)}); --strategy {spec.name} takes its layout from --nproc alone. Drop them, "
            f"or use --strategy {' or '.join(mesh)}."
        )
    if par.cp and not takes["cp"]:
        raise ConfigError(
            f"parallel.cp sets the context-parallel degree of --strategy {' or '.join(_layout_takers('cp'))}; "
            f"--strategy {spec.name} does not take it (--strategy cp takes every process). Drop it, or use "
            "that spec."
        )
    for name, what in GROUP_SETTINGS.items():
        if getattr(par, name) and not takes[name]:
            raise ConfigError(
                f"parallel.{name} sets the {what} of --strategy {' or '.join(_layout_takers(name))}; "
                f"--strategy {spec.name} does not take it. Drop it, or use that strategy."
            )
    if par.max_restarts and not spec.distributed:
        raise ConfigError(
            f"--max-restarts is handled by torchrun's elastic agent, which --strategy {par.strategy} "
            "does not use (it runs in this process). Pick a multi-process strategy (e.g. --strategy ddp "
            "--nproc 1), or rerun with --resume DIR after a failure."
        )


# ---- the model's shape against the layout ---------------------------------------------------------


def tp_split(tp: int, heads: int, kv_heads: int, mlps: dict[str, int]) -> str:
    """Why `tp` ranks cannot split a model's attention heads and MLP widths (`mlps`: the dense
    MLP's intermediate_size and, with experts, their moe_intermediate_size), "" where they can."""
    if heads % tp or kv_heads % tp:
        return f"{heads} query heads and {kv_heads} KV heads; the TP degree must divide both"
    return next(
        (f"{name} {width} is not divisible by {tp}" for name, width in mlps.items() if width % tp), ""
    )


def stage_split(stages: int, layers: int) -> str:
    """What `stages` pipeline stages need that a model of `layers` decoder layers lacks, "" where
    each stage can hold one."""
    return f"{stages} stages of at least one decoder layer" if stages > layers else ""


def expert_split(ep: int, experts: int) -> str:
    """Why `ep` ranks cannot share `experts` experts equally, "" where they can."""
    return f"the {experts} experts are not divisible by {ep}" if experts % ep else ""
