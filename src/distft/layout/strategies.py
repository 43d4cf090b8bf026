"""`SPECS`: every strategy distft runs, name -> `StrategySpec`, in the order reports list them.

A new strategy is a spec here and a class in `distft.parallel` (its registry line there); the CLI's
choices, the checks before launch, the planner, bench and the README's strategy table read this one.
"""

from __future__ import annotations

from distft.layout.spec import StrategySpec, runs

# Why the tensor-parallel strategies refuse what they refuse (`capabilities`).
NF4_UNDER_TP = (
    "tensor parallelism splits o_proj and down_proj along their input dimension (dim 1, "
    "row-parallel), and an NF4 weight splits only along dim 0, where its blocks and scale groups stay "
    "whole (torchao raises NotImplementedError for aten.split(NF4Tensor, dim=1))"
)
DORA_UNDER_TP = (
    "DoRA scales each output feature by the norm of its whole row of W + BA, and tensor parallelism "
    "splits o_proj and down_proj along that row (row-parallel), so each rank would see a partial norm; "
    "DTensor plans also shard only peft's lora_A/lora_B, not DoRA's magnitude vector"
)
DORA_UNDER_MEGATRON = (
    "its hand-written column/row layers carry the base, lora_A and lora_B only, not DoRA's magnitude "
    "vector, and each rank would see a partial norm of a row-parallel weight"
)
TIED_ACROSS_STAGES = (
    "puts the embedding and lm_head on different stages, where peft's trained rows of a tied pair "
    "would be one parameter that each stage updates with half its gradient"
)
ANY_OPTIMIZER = ("adamw", "adamw-8bit", "sgd")  # bitsandbytes' 8-bit state: plain tensors only
FSDP_MOVES = "the all-gathers of parameters / reduce-scatters of gradients (fsdp)"

_SPECS = (
    StrategySpec(
        "single", "one GPU", "everything", "none", dims=(), builds_on_device=True, optimizers=ANY_OPTIMIZER,
        capabilities=runs("qlora", "dora", "modules_to_save", "fp8", "moe", "compile", "fp32_masters"),
    ),
    StrategySpec(
        "ddp", "DDP", "a full replica", "one all-reduce of the trainable gradients", page="ddp.md",
        wraps="ddp", builds_on_device=True, optimizers=ANY_OPTIMIZER,
        capabilities=runs("qlora", "dora", "modules_to_save", "fp8", "moe", "compile", "fp32_masters"),
        collectives="the all-reduce of gradients (ddp)",
    ),
    StrategySpec(
        "zero1", "ZeRO-1", "a full replica, 1/N of AdamW's state (whole tensors)",
        "DDP's all-reduce of the gradients; one broadcast per rank of its updated weights", page="zero1.md",
        shards="optimizer", wraps="ddp", builds_on_device=True,
        capabilities=runs("qlora", "dora", "modules_to_save", "moe", "compile", "fp32_masters"),
        collectives="the all-reduce of gradients / broadcasts of updated weights (zero1)",
    ),
    StrategySpec(
        "zero2", "ZeRO-2 (FSDP2)", "1/N of grads and optimizer state",
        "all-gather params (forward), reduce-scatter grads", page="fsdp.md", dims=("dp_shard",),
        shards="full", reshard_after_forward=False, wraps="fully_shard",
        capabilities=runs("qlora", "dora", "modules_to_save", "fp8", "moe", "compile", "fp32_masters"),
        collectives=FSDP_MOVES,
    ),
    StrategySpec(
        "fsdp", "FSDP / ZeRO-3", "1/N of params, grads, optimizer state",
        "all-gather params (forward and backward), reduce-scatter grads", page="fsdp.md", dims=("dp_shard",),
        shards="full", wraps="fully_shard",
        capabilities=runs("qlora", "dora", "modules_to_save", "fp8", "moe", "compile", "fp32_masters"),
        collectives=FSDP_MOVES,
    ),
    StrategySpec(
        "hsdp", "HSDP",
        "1/S of params, grads, optimizer state (S = `parallel.shard`, a node); replicas across nodes",
        "FSDP's all-gather / reduce-scatter inside each node; one all-reduce of the gradient shards across "
        "nodes per step", page="hsdp.md", dims=("dp_replicate", "dp_shard"), shards="full", wraps="fully_shard",
        capabilities=runs("qlora", "dora", "modules_to_save", "moe", "compile", "fp32_masters"),
        collectives="the all-gathers / reduce-scatters inside a shard group and the all-reduce across "
        "replicas (hsdp)",
    ),
    StrategySpec(
        "tp", "TP", "1/N of every projection (heads, MLP features); the rest replicated",
        "all-reduce activations inside every layer (`parallelize_module`)", page="tp.md", dims=("tp",),
        tensor_parallel="dtensor",
        capabilities=runs("modules_to_save", "moe", qlora=NF4_UNDER_TP, dora=DORA_UNDER_TP),
        collectives="the all-reduces of activations (tp)",
    ),
    StrategySpec(
        "tp-sp", "TP + SP", "as `tp`, plus 1/N of the sequence between blocks",
        "all-gather / reduce-scatter activations along the sequence (hand-written Megatron)", page="tp-sp.md",
        dims=("tp",), tensor_parallel="megatron", takes_label_positions=False,
        capabilities=runs("modules_to_save", "moe", qlora=NF4_UNDER_TP, dora=DORA_UNDER_MEGATRON),
        collectives="the all-gathers / reduce-scatters of activations (tp-sp)",
        splits_activations="splits them with sequence parallelism and shards the weights",
    ),
    StrategySpec(
        "cp", "Context parallel (CP)", "the whole model; 1/N of every sequence's activations",
        "K and V all-gathered per layer (dK, dV reduce-scattered back); gradients all-reduced once per step",
        page="long-context.md", dims=("cp",), takes_label_positions=False, builds_on_device=True,
        optimizers=ANY_OPTIMIZER, capabilities=runs("qlora", "dora", "modules_to_save", "moe"),
        collectives="the all-gathers of K and V / reduce-scatters of dK and dV (cp)",
        splits_activations="splits every sequence's positions over the GPUs and moves only K and V",
    ),
    StrategySpec(
        "pp", "PP",
        "a stage (or V stages) of consecutive decoder layers, cut where the modelled cost is equal "
        "(`parallel.pp_split`); the embedding on the first, the head and loss on the last",
        "send/recv of one hidden-state tensor per micro-batch per stage boundary forward, its gradient "
        "backward; all-reduce of loss and grad norm", page="pp.md", dims=("pp",), fixed_sequence_length=True,
        takes_label_positions=False,
        capabilities=runs("dora", "moe", "compile", modules_to_save=TIED_ACROSS_STAGES),
    ),
    StrategySpec(
        "fsdp+tp", "FSDP x TP", "1/(dp tp) of each projection, 1/dp of the rest; a (dp, tp) mesh",
        "FSDP's all-gather / reduce-scatter over dp, TP's activation all-reduces over tp", page="2d.md",
        dims=("dp_shard", "tp"), shards="full", tensor_parallel="dtensor", wraps="fully_shard",
        capabilities=runs("modules_to_save", "moe", qlora=NF4_UNDER_TP, dora=DORA_UNDER_TP),
        splits_activations="splits attention's heads and the MLP's columns over its TP ranks and shards the weights",
    ),
    StrategySpec(
        "ddp+pp", "DDP x PP",
        "its pipeline rank's stage(s), as `pp`, whole; a (pp, dp) mesh, each replica reads 1/dp of the batch",
        "`pp`'s send/recv and grad-norm all-reduce inside each pipeline; one all-reduce of the stage's "
        "trainable gradients over dp", page="2d.md#ddppp-data-parallelism-across-pipeline-replicas",
        dims=("pp", "dp_replicate"), fixed_sequence_length=True, takes_label_positions=False,
        capabilities=runs("dora", "moe", "compile", modules_to_save=TIED_ACROSS_STAGES),
        without_pp="ddp", without_dp="pp",
    ),
    StrategySpec(
        "fsdp+pp", "FSDP x PP",
        "1/dp of its pipeline rank's stage(s) (FSDP2), gathered whole during a step; a (pp, dp) mesh",
        "`pp`'s send/recv inside each pipeline; over dp, one all-gather of each stage unit and one "
        "reduce-scatter of its gradients per step (torch's stage defers FSDP to the step's ends)",
        page="2d.md#fsdppp-fsdp-across-pipeline-replicas", dims=("pp", "dp_shard"), shards="full",
        reshard_after_forward=False, wraps="fully_shard", fixed_sequence_length=True,
        takes_label_positions=False,
        capabilities=runs("qlora", "dora", "moe", "compile", modules_to_save=TIED_ACROSS_STAGES),
        collectives="the pipeline's send/recv (pp) or FSDP's all-gathers / reduce-scatters (dp)",
        without_pp="fsdp", without_dp="pp",
    ),
    StrategySpec(
        "fsdp+tp+pp", "FSDP x TP x PP",
        "of its stage(s), 1/(dp tp) of each projection, 1/dp of the rest; a (pp, dp, tp) mesh",
        "TP's activation all-reduces inside each stage (tp), FSDP's per-step all-gather / reduce-scatter "
        "(dp), the pipeline's send/recv (pp)", page="3d.md", dims=("pp", "dp_shard", "tp"), shards="full",
        reshard_after_forward=False, tensor_parallel="dtensor", wraps="fully_shard",
        fixed_sequence_length=True, takes_label_positions=False,
        capabilities=runs(
            "moe", qlora=NF4_UNDER_TP, dora=DORA_UNDER_TP, modules_to_save=TIED_ACROSS_STAGES,
            compile="TP's DTensor plans rewrite the blocks",
        ),
        collectives="TP's all-reduces (tp), FSDP's all-gathers / reduce-scatters (dp) or the pipeline's "
        "send/recv (pp)",
        without_pp="fsdp+tp",  # dp = 1 runs: TP x PP, a real 3D mesh with one FSDP rank
    ),
    StrategySpec(
        "fsdp+cp", "FSDP x CP", "1/(dp cp) of params, grads, optimizer state; 1/cp of every sequence's activations",
        "FSDP's all-gather / reduce-scatter over every rank; K and V all-gathered over cp per layer",
        page="long-context.md#fsdpcp-weights-sharded-too", dims=("dp_shard", "cp"), shards="full",
        wraps="fully_shard", takes_label_positions=False,
        capabilities=runs(
            "qlora", "dora", "modules_to_save", "moe", "fp32_masters",
            compile="the context-parallel attention is installed per forward",
        ),
        collectives="the all-gathers / reduce-scatters of parameters and gradients, of K and V (fsdp+cp)",
        splits_activations="shards the weights as FSDP does and splits every sequence's positions, moving only K and V",
    ),
    StrategySpec(
        "fsdp+ep", "FSDP x EP",
        "1/EP of the experts, whole (EP = `parallel.ep`, every rank by default), or 1/N of them with "
        "`parallel.shard_experts`; 1/N of every other param, grad, optimizer state",
        "all-to-all of each MoE layer's routed tokens (there and back) inside its EP group; FSDP's all-gather "
        "/ reduce-scatter of the rest (and of the experts across the groups when sharded)",
        page="moe.md#expert-parallelism-fsdpep", dims=("dp_shard", "ep"), shards="full", wraps="fully_shard",
        capabilities=runs(
            "dora", "modules_to_save", "moe", "fp32_masters",
            qlora="its experts are fused parameter stacks that NF4 does not quantize",
            compile="the all-to-all sizes are read on the host: a graph break per layer",
        ),
        collectives="the all-to-alls of routed tokens and FSDP's all-gathers / reduce-scatters (fsdp+ep)",
    ),
    StrategySpec(
        "hsdp+tp", "HSDP x TP",
        "1/(S tp) of each projection, 1/S of the rest (S = `parallel.shard` data-parallel ranks, a node's); "
        "replicas across nodes; a (replicate, shard, tp) mesh",
        "TP's activation all-reduces inside every layer (tp); FSDP's all-gather / reduce-scatter inside each "
        "node (shard); one all-reduce of the gradient shards across nodes per step (replicate)",
        page="hsdp.md#hsdp-x-tp-tensor-parallelism-inside-the-node", dims=("dp_replicate", "dp_shard", "tp"),
        shards="full", tensor_parallel="dtensor", wraps="fully_shard",
        capabilities=runs("modules_to_save", "moe", qlora=NF4_UNDER_TP, dora=DORA_UNDER_TP),
        collectives="TP's all-reduces (tp), FSDP's all-gathers / reduce-scatters (shard) and the all-reduce "
        "across replicas (replicate)",
    ),
)  # fmt: skip
SPECS: dict[str, StrategySpec] = {spec.name: spec for spec in _SPECS}


def takers(feature: str) -> list[str]:
    """The strategies that run `feature` (`StrategySpec.capabilities`), in the registry's order."""
    return [name for name, spec in SPECS.items() if spec.runs(feature)]


def strategy_table() -> str:
    """The README's table of strategies, one row per spec (`holds`, `moves`, `page`): a test keeps
    the README equal to it."""
    rows = ["| strategy | what each rank holds | collectives per step | docs |", "|---|---|---|---|"]
    for name, spec in SPECS.items():
        page = f"[docs/{spec.page.split('#')[0]}](docs/{spec.page})" if spec.page else ""
        rows.append(f"| `{name}` | {spec.holds} | {spec.moves} | {page} |".replace(" |  |", " | |"))
    return "\n".join(rows)
