"""What `distft plan` predicts for the benchmarked settings, and the measurements projected onto
other hardware. Both reuse the plan's own functions; nothing here is measured.

Prediction (`plan_memory`): the plan's per-rank parameters, gradients, optimizer state and
activations for the same model, LoRA rank, micro-batch, sequence length and strategy, in the
precision distft runs in on this device (fp32 on the CPU: `model.dtype` follows the device).

Projection (`project`), per strategy on a profile `NxGPU-LINK` (e.g. `2xrtx4090-pcie`):
- compute per rank = the plan's FLOPs for this strategy's layout at N ranks (`timing.rank_flops`)
  / (the GPU's dense bf16 peak x the plan's assumed MFU, `timing.ASSUMED_MFU`: distft's measured
  37% for LoRA, 43% for full finetuning);
- communication = the bytes and calls measured per collective kind on the first step (rank 0,
  logical sizes), through the profile's ring `comm_time` over N ranks; a recv is the other
  direction of a send and costs nothing extra. Logical bytes per step do not depend on N for
  DDP, ZeRO, FSDP and TP (the ring factor does), so bytes measured at 2 ranks carry over;
- overlap, measured where the run has it: the median `overlap_fraction` of its measured steps
  (`distft.measure.overlap`) is the share of the communication that hides, at most behind the
  whole compute (`exposed_comm`); results from before the measurement fall back to the plan's
  assumption (a layout whose planned collectives all overlap compute, as DDP's, FSDP's and
  HSDP's do, shows only their excess; one with any on the critical path, as TP's or ZeRO-1's
  broadcasts, shows all of it); a pipeline adds its bubble, the runtime's idle fraction f of
  the step, i.e. f / (1 - f) of the compute (`StepTime.bubble_s`, from `Parallelism.idle_fraction`);
- tokens/s = the measured tokens per step / the projected step time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from distft.config import load_config
from distft.config.choices import PLANNED_SCHEDULES
from distft.errors import ConfigError
from distft.layout import SPECS
from distft.measure.gpus import GPUS, INTERCONNECTS, GiB, find_gpu
from distft.plan.auto import training_of
from distft.plan.estimate import Estimate, Request, estimate, parallelism_for
from distft.plan.hardware import comm_time, generic_gpu, intra_node_link
from distft.plan.inputs import PRECISIONS
from distft.plan.model_spec import resolve_model


@dataclass(frozen=True)
class Profile:
    name: str
    gpus: int
    gpu: str
    interconnect: str | None


def parse_profile(text: str) -> Profile:
    """`2xrtx4090-pcie`, `8xh100-nvlink`, `2xa100-80gb`: N x a plan GPU profile, then optionally
    a plan interconnect (pcie, nvlink, nvlink4 ...; default: the GPU's usual link)."""
    m = re.fullmatch(r"(\d+)x([a-z0-9-]+)", text.strip().lower())
    if not m or int(m.group(1)) < 1:
        raise ConfigError(
            f"--project {text!r}: give N x GPU[-LINK], e.g. 2xrtx4090-pcie or 8xh100-nvlink; "
            f"GPUs: {', '.join(GPUS)}; links: {', '.join(INTERCONNECTS)}."
        )
    n, rest = int(m.group(1)), m.group(2)
    gpu, link = rest, None
    if rest not in GPUS and "-" in rest:
        head, tail = rest.rsplit("-", 1)
        if tail in INTERCONNECTS:
            gpu, link = head, tail
    find_gpu(gpu)  # raises ConfigError for an unknown GPU
    return Profile(text.strip(), n, gpu, link)


def _request(
    settings,
    gpus: int,
    gpu_name: str | None,
    interconnect: str | None,
    precision: str,
    label_tokens: int = 256,
) -> Request:
    cfg = load_config(None, [f"model.name={settings.model}", *settings.overrides])
    gpu = find_gpu(gpu_name) if gpu_name else generic_gpu(64 * GiB)
    training = training_of(
        cfg,
        PRECISIONS[precision],
        autocast=precision != "fp32",
        seq_len=settings.seq_len,
        micro_batch=settings.micro_batch_size,
        label_tokens=label_tokens,
    )
    return Request(
        model=resolve_model(settings.model),
        training=training,
        gpu=gpu,
        gpu_memory=gpu.memory,
        gpus_per_node=gpus,
        nodes=1,
        intra=intra_node_link(gpu, interconnect, gpus),
        inter=intra_node_link(gpu, interconnect, gpus),
        pp_schedule=cfg.parallel.schedule if cfg.parallel.schedule in PLANNED_SCHEDULES else "1f1b",
    )


def _estimate(req: Request, settings, strategy: str, n: int):
    """The plan's estimate of `strategy` on n ranks with the bench's global batch: n ranks on its
    one mesh dimension (a multi-dimensional strategy is measured, not projected)."""
    dims = SPECS[strategy].axes
    if len(dims) > 1:
        raise ConfigError(f"{strategy} spans {len(dims)} mesh dimensions; projections model one")
    degrees = {d: n for d in dims}
    dp = degrees.get("dp", 1)
    accum = settings.global_batch_size // (settings.micro_batch_size * dp)
    if accum < 1:
        raise ConfigError(
            f"a global batch of {settings.global_batch_size} cannot feed {dp} replicas a micro-batch of "
            f"{settings.micro_batch_size} each"
        )
    req = replace(req, grad_accum=accum, pp_microbatches=accum if "pp" in dims else None)
    return estimate(req, parallelism_for(req, strategy, **degrees), strategy)


def plan_memory(
    settings, strategies: list[str], precision: str, label_tokens: int = 256
) -> dict[str, dict[str, int]]:
    """Bytes per rank (the fullest rank) by component, as `distft plan` predicts them, with the
    data's median loss positions per sequence (`label_tokens`, the summary)."""
    out = {}
    for strategy in strategies:
        try:
            req = _request(settings, settings.nproc, None, None, precision, label_tokens)
            e = _estimate(req, settings, strategy, settings.nproc)
        except (ConfigError, ValueError, KeyError) as err:  # a strategy the plan does not model
            out[strategy] = {"error": str(err)}
            continue
        out[strategy] = {
            "params": e.params,
            "grads": e.grads,
            "optimizer": e.optimizer,
            # Saved for backward (every in-flight micro-batch), without the loss's transient logits:
            # what the measurement (autograd's saved tensors) counts.
            "activations": e.activations - e.activation_detail.get("transient", 0),
            "buffers": e.buffers,
        }
    return out


def project(settings, results: list[dict], profile: Profile) -> dict:
    """Every measured strategy's step time and tokens/s projected onto `profile` (see the docstring)."""
    req = _request(settings, profile.gpus, profile.gpu, profile.interconnect, "mixed")
    link = req.intra
    rows = {}
    for r in results:
        name = r["strategy"]
        n = profile.gpus if name in SPECS and SPECS[name].distributed else 1
        try:
            e = _estimate(req, settings, name, n)
        except ConfigError as err:
            rows[name] = {"ranks": n, "note": str(err)}
            continue
        if not e.applicable or e.compute_s is None:
            rows[name] = {"ranks": n, "note": e.note or "the plan cannot estimate it"}
            continue
        compute = e.compute_s
        calls = r.get("comm_calls", {})
        comm = sum(
            comm_time(kind, b, n, link, calls.get(kind, 1))
            for kind, b in r["comm_bytes"].items()
            if kind != "recv"
        )
        bubble = e.time.bubble_s
        overlap = r.get("extra", {}).get("overlap_fraction")  # measured; None: the plan's assumption
        exposed = exposed_comm(comm, compute, planned_overlap(e) if overlap is None else overlap)
        step = compute + bubble + exposed
        tokens = r.get("tokens_per_step") or r["tokens_per_s"]["median"] * r["step_time_s"]["median"]
        rows[name] = {
            "ranks": n,
            "compute_s": compute,
            "comm_s": comm,
            "overlap": overlap,
            "exposed_comm_s": exposed,
            "bubble_s": bubble,
            "step_s": step,
            "tokens_per_s": tokens / step if step else 0.0,
        }
    estimated = {k: v for k, v in rows.items() if "note" not in v}
    single = estimated.get("single")
    for row in estimated.values():
        row["speedup_vs_single"] = row["tokens_per_s"] / single["tokens_per_s"] if single else None
    best = max(estimated, key=lambda k: estimated[k]["tokens_per_s"]) if estimated else None
    return {
        "profile": profile.name,
        "gpus": profile.gpus,
        "gpu": req.gpu.label,
        "link": link.label,
        "mfu": req.assumed_mfu,
        "strategies": rows,
        "winner": best,
        "claims": claims(estimated, profile, link.name),
    }


def planned_overlap(e: Estimate) -> float:
    """The share of the plan's communication time that overlaps compute (`Collective.overlapped`:
    DDP's and FSDP's gradients and weights, a pipeline's sends; not TP's activations, ZeRO-1's
    broadcasts or the loss)."""
    total = sum(c.seconds for c in e.collectives)
    return sum(c.seconds for c in e.collectives if c.overlapped) / total if total else 0.0


def exposed_comm(comm: float, compute: float, overlap: float) -> float:
    """The communication the projected step waits for: the share `overlap` of it hides, at most
    behind the whole compute. The share is the run's measured one (the communication time it
    computed under, `distft.measure.overlap`), or for results from before the measurement the
    plan's (`planned_overlap`)."""
    return comm - min(overlap * comm, compute)


def claims(rows: dict, profile: Profile, link: str) -> list[dict]:
    """The blog series' claims, checked against one projection where they apply."""
    out = []
    if link.startswith("pcie") and "tp-sp" in rows and "fsdp" in rows:
        a, b = rows["tp-sp"]["tokens_per_s"], rows["fsdp"]["tokens_per_s"]
        out.append(
            {
                "claim": "TP+SP beats FSDP on PCIe",
                "supported": a > b,
                "evidence": f"{a / b:.2f}x FSDP's tokens/s",
            }
        )
    if profile.gpus == 2 and "ddp" in rows and rows["ddp"]["speedup_vs_single"] is not None:
        s = rows["ddp"]["speedup_vs_single"]
        out.append({"claim": "DDP near 2x on 2 GPUs", "supported": s >= 1.8, "evidence": f"{s:.2f}x one GPU"})
    return out
