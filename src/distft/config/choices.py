"""The choices of the string settings that take one of a few values (`distft.config.fields` checks them),
and how a value that is none of them is answered."""

import difflib

from distft.errors import ConfigError

METHODS = ("lora", "qlora", "full")
OBJECTIVES = ("sft", "dpo", "orpo", "kto")  # train.objective; `distft.model.preference`
WITH_REFERENCE = ("dpo", "kto")  # the objectives that compare the policy with the model as it starts
PAIRED = ("dpo", "orpo")  # the objectives that train on pairs of answers (KTO: single answers)
# What a run counts its data in: a pair is one item of train.global_batch_size (its chosen and
# rejected sequences travel together), KTO's answers are examples, one sequence each.
ITEM_NAMES = {"sft": "row", "dpo": "pair", "orpo": "pair", "kto": "example"}


def batch_unit(objective: str) -> str:
    """What a preference run's batch sizes count, after the number (" pairs"); "" for sft's rows."""
    return "" if objective == "sft" else f" {ITEM_NAMES[objective]}s"


DPO_LOSSES = ("sigmoid", "ipo", "hinge")  # dpo.loss_type
LORA_VARIANTS = ("lora", "dora", "rslora")
# The projections of a decoder layer, every family's, in the order transformers registers them
# (`distft.model.families.PROJECTIONS` adds their module paths and tensor-parallel styles).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTION_NAMES = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
LORA_TARGET_PRESETS = {  # lora.target_modules = ["attention"], ...; all-linear is peft's own
    "attention": list(ATTENTION_PROJECTIONS),
    "mlp": list(MLP_PROJECTIONS),
    "all": list(PROJECTION_NAMES),
}
OPTIMIZERS, SCHEDULERS = ("adamw", "adamw-8bit", "sgd"), ("cosine", "linear", "constant")
MASTER_WEIGHTS = ("auto", "fp32", "model")
DTYPES = ("float32", "bfloat16")
ATTENTION_CHOICES = ("auto", "flex", "flash", "sdpa", "eager")  # `distft.model.attention`
# model.experts_implementation: transformers' three, and distft's grouped_lora (`distft.model.experts`)
EXPERTS_CHOICES = ("auto", "eager", "grouped_mm", "batched_mm", "grouped_lora")
COMPILE_CHOICES = FUSED_CHOICES = ("auto", "true", "false")  # model.compile, optim.fused
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
FP8_CHOICES = ("off", "base", "all")  # model.fp8; `distft.model.fp8`
CHECKPOINTING = ("none", "full", "selective", "offload")  # model.activation_checkpointing
CHECKPOINTING_ALIASES = {"true": "full", "false": "none"}  # what the setting was when it was a switch
ROPE_SCALINGS = ("none", "yarn", "linear", "dynamic")  # `distft.model.positions`
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")  # `parallel.pipeline.layout`
PLANNED_SCHEDULES = PIPELINE_SCHEDULES[:3]  # those whose in-flight activations the planner models
CP_METHODS = ("allgather", "ring")  # parallel.cp_method; `distft.parallel.context`
MEASURE_COMM = ("auto", "every", "first", "off")  # `distft.measure.step`
TRUNCATIONS = ("head", "tail", "middle")
DATA_FORMATS = (
    "auto",
    "summary",
    "chat",
    "prompt_completion",
    "alpaca",
    "sharegpt",
    "text",
    "preference",
    "unpaired",
)
ROLES = ("system", "user", "assistant")  # chat turns; data.roles maps ShareGPT names onto them
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # output.report_to; `distft.train.tracking`


def nearest(name: str, choices: list[str]) -> str:
    """ " Did you mean `x`?" for a close match, else the valid choices."""
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else f" Valid: {', '.join(sorted(choices))}."


def check_choice(value: str, choices: tuple[str, ...] | list[str], where: str) -> None:
    if value not in choices:
        # The choices are listed once; `nearest` would list them again when nothing is close. The
        # longest choice the value starts with (cosine_with_restarts: cosine) first, then the closest.
        prefixes = sorted((c for c in choices if value.startswith(c)), key=len)[-1:]
        match = prefixes or difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(f"`{where}` is {value!r}; choose one of {', '.join(choices)}.{hint}")
