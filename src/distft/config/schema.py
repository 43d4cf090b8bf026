"""The run configuration: plain dataclasses, one per section, a docstring under every field.

A run is fully described by one `Config` in nine sections (`model`, `data`, `lora`, `optim`,
`train`, `dpo`, `moe`, `parallel`, `output`). `distft.config.fields.check_fields` holds the checks that need nothing but
the config itself: choices, and the range of every int and float field (`fields.RANGES`, one
table; floats finite); checks that depend on a strategy or a model architecture run later, in
`distft.parallel.checks`, before any process is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from distft.config.choices import PROJECTION_NAMES
from distft.config.data import DataConfig
from distft.config.moe import MoeConfig
from distft.config.preference import PreferenceConfig

# ---- Sections -------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    name: str = "tiny"
    """A preset name (`distft.model.PRESETS`), a local directory (config.json + safetensors) or a hub id."""
    dtype: str = "float32"
    """Weight dtype of the base: float32 or bfloat16. LoRA adapters stay in float32 either way (peft
    upcasts them, `autocast_adapter_dtype`): a bf16 base trains fp32 adapters and optimizer state."""
    autocast: bool = True
    """bf16 autocast for forward/backward where the device supports it (CUDA only; a no-op on CPU)."""
    activation_checkpointing: str = "none"
    """What a decoder layer keeps for backward (`distft.model.checkpointing`): none, full (its input;
    recomputed in backward), selective (recompute the MLP) or offload (full, inputs in host memory)."""
    mlp_tiles: int = 0
    """The MLP run on this many checkpointed slices of the sequence (0: whole; `model.checkpointing`)."""
    rope_scaling: str = "none"
    """Stretch rotary positions past the model's (`distft.model.positions`): none, yarn, linear, dynamic."""
    rope_factor: float = 0.0
    """With model.rope_scaling: the factor on the pretrained positions (Qwen3: 4 -> 131,072 tokens)."""
    attn_implementation: str = "auto"
    """Attention kernel (`distft.model.attention`): auto (flash where flash-attn runs, else flex),
    flex (FlexAttention, a document block mask), flash (varlen, CUDA), sdpa (a dense mask), eager."""
    experts_implementation: str = "auto"
    """How a mixture of experts' layer runs its experts (`distft.model.experts`): eager (a loop over
    the experts hit), grouped_mm (one grouped matmul over the rows sorted by expert), batched_mm (one
    batched matmul over a copy of each row's expert weights), grouped_lora (distft's: grouped_mm's
    sort and matmuls, LoRA applied to the rows through its factors, the rows moved by gathers);
    auto: grouped_lora (`distft bench --experts`, docs/moe.md). A dense model ignores it."""
    seed: int = 0
    """Seed of the random initialisation of preset models."""
    added_tokens: list[str] = field(default_factory=list)
    """Special tokens added to the tokenizer; the embedding and output head grow to hold them, and
    their rows train beside the adapters (peft's trainable tokens; docs/recipes.md)."""
    trust_remote_code: bool = False
    """Run the Python code a hub model or model directory ships (transformers' `trust_remote_code`).
    Off, distft never runs a model's own code; on, the header says so (docs/security.md)."""
    revision: str = ""
    """A hub model's commit hash, branch or tag (empty: the default branch); lineage.json records the commit."""
    allow_pickle_weights: bool = False
    """Load `*.bin` (pickle) weights where a model has no safetensors (off: refused before launch)."""
    quant_block_size: int = 64
    """QLoRA: weights per NF4 block; each block is scaled by its absmax."""
    quant_scaler_block_size: int = 256
    """QLoRA double quantization: blocks whose 8-bit absmaxes share one scale (capped to a weight's
    block count; under FSDP each rank must hold whole groups, checked before launch)."""
    double_quant: bool = True
    """QLoRA: store the block absmaxes in 8 bits (double quantization); false: in the model dtype."""
    compile: str = "auto"
    """torch.compile each decoder layer (`distft.model.compile`): auto (on CUDA where the strategy
    takes compiled blocks; eager, saying why, if compiling fails), true (a failure stops the run), false."""
    compile_backend: str = "inductor"
    """The torch.compile backend: inductor, aot_eager (AOT autograd, no code generated: CPU tests) or eager."""
    fp8: str = "off"
    """Float8 matmuls in the decoder layers (`distft.model.fp8`, torchao's rowwise recipe): off; base
    (--method lora: the frozen projections under the adapters; adapters, norms, embedding and head
    keep their dtype); all (--method full: every decoder Linear). Needs model.dtype=bfloat16, --strategy
    single, ddp, fsdp or zero2, and a CUDA GPU of compute capability 8.9+ (H100, L40S, RTX 4090)."""
    compile_cache: str = "auto"
    """Where torch.compile keeps the kernels it builds, so the next run's first step skips building
    them: auto (distft's cache dir, `$DISTFT_CACHE/compile`, else ~/.cache/distft/compile; a
    TORCHINDUCTOR_CACHE_DIR set before the run wins), a directory, or off (torch's default, under /tmp)."""


@dataclass
class LoraConfig:
    rank: int = 16
    """LoRA rank r."""
    alpha: float = 32.0
    """LoRA scaling numerator: updates are scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the LoRA input (0 keeps runs exactly reproducible across strategies)."""
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTION_NAMES))
    """Projections that get adapters: all attention and MLP projections by default. Module names, or
    one preset: attention (q, k, v, o), mlp (gate, up, down), all (both), all-linear (peft's own:
    every linear layer but the output head)."""
    variant: str = "lora"
    """lora; dora (weight-decomposed: a trained magnitude per output feature, Liu et al. 2402.09353;
    data-parallel strategies and pipelines only); rslora (rank-stabilised scale alpha / sqrt(r))."""
    lr_ratio: float = 1.0
    """LoRA+ (Hayou et al. 2402.12354): every lora_B trains at optim.lr x this ratio, in a param group
    of its own (1: off; the paper suggests 16)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters and saved with them (peft's `modules_to_save`),
    e.g. embed_tokens, lm_head (docs/recipes.md, "New special tokens"; not under a pipeline)."""
    init_adapter: str = ""
    """A trained adapter to start from (a run directory, or an adapter directory): its weights are
    this run's at step 0, trained further with a fresh optimizer; its rank, alpha, targets and
    variant must be this run's. DPO and KTO then take the model as it starts, base + that adapter,
    as their reference (dpo.precompute_reference, derived). Empty: a fresh adapter."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw; adamw-8bit (bitsandbytes' 8-bit AdamW, optional: single and ddp); sgd (with momentum)."""
    lr: float = 1e-2
    """Peak learning rate (AdamW). Not set, `distft train` derives it from the base and the method
    (`distft.parallel.derive.default_lr`): 1e-2 for a random preset (and its descendants), 2e-4 for
    LoRA/QLoRA on a pretrained checkpoint, 2e-5 for full finetuning of one."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """AdamW's decay of the gradient's running mean."""
    beta2: float = 0.999
    """AdamW's decay of the squared gradient's running mean."""
    eps: float = 1e-8
    """AdamW's term added to the denominator."""
    momentum: float = 0.9
    """SGD's momentum (optim.name=sgd; 0: plain SGD, no optimizer state)."""
    scheduler: str = "cosine"
    """After the warm-up: cosine or linear decay to lr * min_lr_ratio at the last step, or constant."""
    warmup_steps: int = 10
    """Linear warm-up from 0 to `lr`, in steps (used when optim.warmup_ratio is 0)."""
    warmup_ratio: float = 0.0
    """Warm-up as a share of train.max_steps, rounded up (0: optim.warmup_steps counts). Neither
    set, `distft train` (and `train(cfg)`) derives 0.1 (`distft.parallel.derive`)."""
    min_lr_ratio: float = 0.1
    """The decay (cosine, linear) ends at lr * min_lr_ratio on the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    fused: str = "auto"
    """Fused AdamW (one kernel for every tensor, no host sync): auto (on CUDA), true (the CPU too:
    torch has a fused CPU AdamW) or false (the per-tensor loop)."""
    tuned_global_batch_size: int = 0
    """The global batch `lr` was tuned for (0: unset). When it differs from train.global_batch_size,
    the header prints the usual scaling of lr (square root for Adam, linear for SGD); never applied."""


@dataclass
class TrainConfig:
    method: str = "lora"
    """lora (adapters on a frozen base), qlora (adapters on a frozen 4-bit NF4 base, `distft.model.nf4`)
    or full (every weight trains)."""
    objective: str = "sft"
    """sft (the answers' token loss), dpo (prefer the chosen answer of each pair over the rejected
    one, against the starting model), orpo (sft plus an odds-ratio term, no reference), or kto
    (answers each labelled desirable or not, against the starting model): the preference
    objectives (docs/preference.md; settings in [dpo])."""
    max_steps: int = 100
    """Optimizer steps (leave it unset when train.epochs sets them)."""
    epochs: float = 0.0
    """Passes over the training rows instead of max_steps: max_steps = ceil(epochs x rows /
    global_batch_size), shown in the header (0: off)."""
    master_weights: str = "auto"
    """Full finetuning of a bfloat16 model: fp32 (weights and optimizer state kept in float32, bf16
    compute), model (everything in bf16: half the memory, small updates lost to rounding), or auto:
    fp32 where the strategy holds master weights (single, ddp, zero1, fsdp, zero2, hsdp), else model."""
    global_batch_size: int = 8
    """Sequences per optimizer step, summed over all data-parallel ranks and accumulation steps.
    Not set, `distft train` keeps it where it splits evenly over the data-parallel ranks, else
    derives micro-batch x data-parallel ranks x accumulation (`distft.parallel.derive`)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank."""
    eval_every: int = 25
    """Validation loss every N steps (0: only at the end)."""
    eval_batches: int = 4
    """Validation global batches per evaluation (0: no validation at all, not even at the end)."""
    log_every: int = 1
    """Write a metrics line every N steps."""
    seed: int = 0
    """Seed for data order and dropout."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu or cuda."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: `stop` (before the optimizer step, so the
    weights and the last checkpoint stay good) or `skip` (no update; the run goes on)."""
    checkpoint_on_signal: bool = True
    """On SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice), every rank stops after the same step;
    with this on, a checkpoint of that step is written first (docs/reliability.md, "Signals")."""
    measure_comm: str = "auto"
    """Collectives' bytes and overlap: `every` step, the `first` only, `off`, or auto: every step on
    CPU, the first on CUDA (a host hook on every op would slow the steps it measures)."""
    straggler_window: int = 8
    """Multi-process runs: each rank's arrival at every step rides the stop signal's all-reduce
    before it (`distft.train.boundary`), and a rank whose median over this many steps is over
    `straggler_ratio` x the others' is named: a warning, and `straggler` in ranks.json. 0: off."""
    straggler_ratio: float = 1.5
    """A rank taking more than this many times the other ranks' median to reach each step is a straggler."""
    early_stopping_patience: int = 0
    """Stop once this many validations in a row bring no improvement of the best validation loss
    by more than early_stopping_delta (0: off; needs train.eval_every)."""
    early_stopping_delta: float = 0.0
    """The least fall of the validation loss that counts as an improvement for early stopping."""


@dataclass
class ParallelConfig:
    strategy: str = "single"
    """single, or a multi-process strategy from the registry `distft.parallel.STRATEGIES`."""
    nproc: int = 1
    """Processes per node; above 1, `distft train` launches itself through torchrun."""
    nnodes: int = 1
    """Nodes taking part (each runs `distft train` with its own --node-rank)."""
    node_rank: int = 0
    """This node's index, 0..nnodes-1 (node 0 holds the rendezvous and writes the run's files)."""
    rdzv_endpoint: str = "127.0.0.1:29500"
    """HOST:PORT of the rendezvous for multi-node runs."""
    timeout_s: int = 600
    """A collective that waits longer than this fails instead of hanging."""
    health_check: bool = True
    """Multi-process runs: before the model is built, a roll call and a timed all-reduce name a rank
    that is missing (an error) or late (a warning): `distft.health`, docs/multi-node.md."""
    health_timeout_s: int = 60
    """Health check: seconds every rank has to answer the roll call before the missing ones are named."""
    health_slow_s: float = 5.0
    """Health check: a rank joining the all-reduce this many seconds after the first rank is slow."""
    allow_mixed: bool = False
    """Health check: ranks whose device (model, memory, compute capability) or software (torch,
    transformers, peft, Python, distft) differ are a warning instead of an error (--allow-mixed)."""
    max_restarts: int = 0
    """torchrun's elastic agent restarts every rank this many times after one fails (a killed
    rank, a lost peer); each restart resumes from the latest checkpoint."""
    ddp_bucket_mb: float = 25.0
    """DDP: gradients are all-reduced in buckets of this size, overlapping backward (tiny buckets:
    many small all-reduces, each paying the link's latency)."""
    ddp_find_unused_parameters: bool = False
    """DDP: walk the autograd graph after every forward for parameters without a gradient (costs a
    graph walk and an all-reduce of a used-parameter bitmap per step; nothing is unused here)."""
    ddp_broadcast_buffers: bool = False
    """DDP: broadcast rank 0's buffers before forward (Qwen3's rotary tables never change)."""
    ddp_no_sync: bool = True
    """DDP: skip the all-reduce on all but the last micro-batch of a step (false: all-reduce after
    every micro-batch: the same gradients, accumulation-steps times the traffic)."""
    ddp_gradient_as_bucket_view: bool = True
    """DDP: gradients live inside the communication buckets (one copy fewer)."""
    ddp_static_graph: bool = False
    """DDP: declare the autograd graph identical every step (lets DDP skip per-step bookkeeping)."""
    fsdp_param_dtype: str = ""
    """FSDP: dtype parameters are all-gathered and computed in; empty: the model dtype."""
    fsdp_reduce_dtype: str = ""
    """FSDP: dtype gradients are reduce-scattered in; empty: the param dtype. float32 is safest."""
    fsdp_output_dtype: str = ""
    """FSDP: dtype the root module's outputs are cast to; empty: leave them as computed."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory (CUDA runs)."""
    fsdp_prefetch: int = 1
    """FSDP: decoder layers whose all-gather is issued ahead of use, forward and backward (0: none)."""
    fsdp_wrap: str = "layer"
    """FSDP: sharding units: layer (one per decoder layer, plus the root) or model (the root alone)."""
    sequence_parallel: bool = True
    """tp-sp: split the residual stream, norms and loss along the sequence; false: plain Megatron TP."""
    schedule: str = "1f1b"
    """pp: gpipe, 1f1b, interleaved-1f1b, zero-bubble (interleaved ZB-H1) or zbv (zero bubble, V-shaped)."""
    microbatches: int = 0
    """pp: micro-batches the global batch (ddp+pp, fsdp+pp, fsdp+tp+pp: a replica's share) is cut into per step (m); sets
    train.micro_batch_size to global_batch_size / m. 0: keep train.micro_batch_size (m = global_batch_size / micro_batch_size)."""
    stages_per_rank: int = 0
    """pp: virtual stages per rank (V). 0: 2 for interleaved-1f1b and zbv, 1 for the others."""
    pp_split: str | list[int] = "balanced"
    """pp: decoder layers per stage. balanced: the contiguous cut whose slowest stage costs least in
    modelled FLOPs (the last stage also runs lm_head and the loss, stage 0 the embedding:
    `distft.parallel.pipeline.cost`); even: by layer count (the first L mod S stages take one more);
    or a list, one count per stage in stage order, e.g. [5, 3] (`parallel.pp_split=[5,3]`)."""
    dp: int = 0
    """Multi-dimensional strategies: data-parallel degree; 0: world size / (tp x pp x cp)."""
    tp: int = 1
    """fsdp+tp, fsdp+tp+pp: tensor-parallel degree, the inner (fastest-varying) mesh dimension."""
    pp: int = 1
    """ddp+pp, fsdp+pp, fsdp+tp+pp: pipeline degree (ranks per pipeline replica), the outermost mesh
    dimension; 1 elsewhere. The schedule's micro-batches cut global_batch_size / dp sequences."""
    cp: int = 0
    """fsdp+cp: context-parallel degree, ranks sharing each sequence (inner mesh dimension); 0: world / dp."""
    cp_method: str = "allgather"
    """cp, fsdp+cp: allgather (every row's K, V gathered per layer) or ring (passed rank to rank)."""
    shard: int = 0
    """hsdp: consecutive ranks sharding each parameter (one node), replicated across the others; 0: --nproc."""
    ep: int = 0
    """fsdp+ep: consecutive ranks splitting the experts between them (one node), each such group
    holding every expert once, replicated across the groups; 0: every process."""
    shard_experts: bool = False
    """fsdp+ep with expert groups (parallel.ep below the processes): FSDP-shard each group's expert
    stacks across the groups (gathered every micro-batch: less memory, more traffic between them)
    instead of keeping whole copies, whose gradients are all-reduced once per step."""


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    """Run directory: adapter/, metrics.jsonl, config.toml."""
    save_base: bool = True
    """Write a small preset's random base weights to DIR/base, so the adapter loads with plain peft.
    DIR/base always holds the base's recipe (preset, seed, dtype, device), from which `distft infer`
    rebuilds it; real-size presets (qwen3-*) are written as the recipe alone."""
    checkpoint_every: int = 0
    """Write a resumable training-state checkpoint every N steps (0: never)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    resume: bool = True
    """Continue from the latest checkpoint in `dir` if there is one."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that receive every metrics.jsonl record and the resolved config, from
    rank 0: any of tensorboard (event files in `dir`/tensorboard), wandb, mlflow, trackio."""
    run_name: str = ""
    """The run's name in the trackers; empty: the name of `dir`."""
    overwrite: bool = False
    """Replace a finished run in `dir` (start over; its checkpoints go) instead of refusing to."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dpo: PreferenceConfig = field(default_factory=PreferenceConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # Not in the TOML (class variables, set on the instance by whoever knows):
    explicit: ClassVar[frozenset[str]] = frozenset()
    """`section.key` of every field a config file, an override or a flag set (`load_config`); the
    rest are defaults, which `distft.parallel.derive` may fill in to compose with the strategy."""
    derived: ClassVar[dict[str, str]] = {}
    """`section.key` -> why, for each default `distft.parallel.derive` chose (the header says so)."""
    prediction: ClassVar[dict[str, Any] | None] = None
    """The planner's prediction for this layout (`distft.plan.auto`): peak memory and bytes per
    rank, written beside the measured figures in ranks.json."""
    calibration: ClassVar[dict[str, Any] | None] = None
    """Where `parallel.pp_split` came from when `distft train --calibrate RUN` set it: the measured
    run and its fitted costs (`distft.parallel.pipeline.calibrate`), in ranks.json's `pipeline`
    record as `calibrated_from`."""

    @property
    def world_size(self) -> int:
        return self.parallel.nproc * self.parallel.nnodes
