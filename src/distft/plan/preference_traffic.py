"""What a preference objective adds to a step's collectives (`distft.plan.traffic` adds it).

DPO and KTO run forwards without backward beside the training one: the reference's, with the
adapters off (unless `dpo.precompute_reference` scored it before the first step), inside the
policy's forward, on every micro-batch; and KTO's KL term, before the step, on its mismatched
answers (the policy's, with the reference's inside it unless precomputed: `Training.kl_forwards`
models per micro-batch). A forward without backward moves what any forward moves and nothing of
backward's:
- FSDP2 under ZeRO-3: each layer gathered once more per model run; a separate root forward
  (KTO's) gathers the root too; and the reference inside the policy's forward shifts FSDP2's
  backward prefetch, which follows the order the forwards ran, to gather the last layer again.
  Under ZeRO-2 (no reshard after forward) only that regather: the forwards share one gather.
- TP (`parallelize_module`): the two row projections' outputs per layer and model run, and the
  policy's adapters on the row projections after lora_A.
- tp-sp: each block entered (all-gather) and left (reduce-scatter) once per model run; and its
  preference head all-reduces every sequence's log-probability and token count (`sequence_sums`).
- a pipeline (KTO's KL term; the reference is precomputed there): each micro-batch through the
  stages forward only, one send per stage boundary, no gradient back.
Each is counted on real gloo ranks equal to what a run moves (`tests/parallel/test_preference.py`).
"""

from __future__ import annotations

from distft.model.families.family import ROW_PARALLEL
from distft.parallel.context.model import padded_length
from distft.plan.collective import Collective, held_bytes
from distft.plan.hardware import Link
from distft.plan.inputs import Parallelism, Training
from distft.plan.memory import layer_seq_len
from distft.plan.model_spec import ModelSpec


def kl_shapes(training: Training, par: Parallelism) -> tuple[tuple[int, int], ...]:
    """(rows, positions) of KTO's KL micro-batches; none for the other objectives."""
    if not training.kl_forwards:
        return ()
    return training.kl_batch_shapes or training.shapes(par.microbatches)


def fsdp_forward_only_gathers(
    spec: ModelSpec, training: Training, par: Parallelism, rank: int, layers: int
) -> tuple[float, int]:
    """(bytes, calls) FSDP2's all-gathers add per step for the forwards without backward. ZeRO-2
    keeps what a forward gathered until backward, so the forward that comes next gathers nothing;
    only the backward prefetch's regather of the last layer remains (one layer per micro-batch)."""
    m = len(training.shapes(par.microbatches))
    layer_bytes = held_bytes(spec, training, par, "gathered", rank, layers_only=True)
    if not par.reshard_after_forward:
        return (layer_bytes / layers * m, m) if training.reference_forward else (0.0, 0)
    params, calls = 0.0, 0
    if training.reference_forward:  # inside the root's forward: layers + 1 layer gathers
        params += layer_bytes * (layers + 1) / layers * m
        calls += (layers + 1) * m
    if training.kl_forwards:  # one root forward per KL micro-batch, its layers once per model run
        root_bytes = held_bytes(spec, training, par, "gathered", rank) - layer_bytes
        kl = len(kl_shapes(training, par))
        params += (root_bytes + layer_bytes * training.kl_forwards) * kl
        calls += (1 + layers * training.kl_forwards) * kl
    return params, calls


def tp_forward_only_reduces(
    spec: ModelSpec, training: Training, par: Parallelism, layers: int, targets: set[str], c: int
) -> tuple[float, int]:
    """(bytes, calls) TP's activation all-reduces add per step for the forwards without backward;
    `c` the bytes of an activation element."""
    shapes = training.shapes(par.microbatches)
    reference = 2 * layers * c * spec.hidden_size * training.reference_forward
    logical = reference * sum(rows * seq for rows, seq in shapes)
    count = 2 * layers * training.reference_forward * len(shapes)
    if training.kl_forwards:
        runs = 2 * layers * training.kl_forwards  # row outputs per model run
        adapters = layers * sum(name in targets for name in ROW_PARALLEL)  # the policy's
        positions = sum(rows * seq for rows, seq in kl_shapes(training, par))
        logical += c * positions * (spec.hidden_size * runs + training.lora_rank * adapters)
        count += len(kl_shapes(training, par)) * (runs + adapters)
    return logical, count


def sp_forward_only_crossings(
    training: Training, par: Parallelism, layers: int, enter: float, leave: float
) -> tuple[float, int, float, int]:
    """(all-gather bytes, calls, reduce-scatter bytes, calls) tp-sp adds per step for the forwards
    without backward: each block entered and left once per model run; `enter` and `leave` the
    bytes of one position crossing."""
    shapes = training.shapes(par.microbatches)
    kl = kl_shapes(training, par)
    positions = training.reference_forward * sum(rows * layer_seq_len(training, par, s) for rows, s in shapes)
    positions += training.kl_forwards * sum(rows * layer_seq_len(training, par, s) for rows, s in kl)
    calls = (training.reference_forward * len(shapes) + training.kl_forwards * len(kl)) * 2 * layers
    return positions * enter * 2 * layers, calls, positions * leave * 2 * layers, calls


def pp_forward_only_sends(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, sends: int, receives: int, sent: int
) -> list[Collective]:
    """A pipeline's KTO KL term: its micro-batches through the stages forward only, one send of
    each boundary this rank sends across (`sends`), one receive of each it receives across;
    `sent` bytes per activation element."""
    if not training.kl_forwards:
        return []
    kl = kl_shapes(training, par)
    per_boundary = sent * sum(rows * seq for rows, seq in kl) * spec.hidden_size / (par.tp if par.sp else 1)
    return [
        Collective("KL activations", kind, n * per_boundary, n * len(kl), 2, link, False)
        for kind, n in (("send", sends), ("recv", receives))
    ]


def sequence_sums(training: Training, par: Parallelism, link: Link, ranks: int) -> Collective:
    """The preference head of a sequence split (tp-sp, cp) over `ranks`: per forward, one fp32
    all-reduce of each sequence's log-probability and labelled tokens (2 x `micro_batch` floats),
    again in backward where it trains."""
    m = len(training.shapes(par.microbatches))
    calls = 2 * m + training.reference_forward * m + training.kl_forwards * len(kl_shapes(training, par))
    bytes_ = calls * 8 * training.micro_batch
    return Collective("sequence log-probabilities", "all_reduce", bytes_, calls, ranks, link, False)


def cp_forward_only(
    training: Training, par: Parallelism, link: Link, kv_per_position: int, layers: int
) -> list[Collective]:
    """Context parallelism's forwards without backward: every layer's K and V of each (padded) row
    once more per model run, all-gathered (allgather) or passed on N-1 times (ring)."""
    n, shapes, kl = par.cp, training.shapes(par.microbatches), kl_shapes(training, par)
    positions = training.reference_forward * sum(rows * padded_length(seq, n) for rows, seq in shapes)
    positions += training.kl_forwards * sum(rows * padded_length(seq, n) for rows, seq in kl)
    runs = training.reference_forward * len(shapes) + training.kl_forwards * len(kl)
    if not runs:
        return []
    kv = kv_per_position * positions * layers
    if par.cp_method == "ring":  # this rank's share passed on, a K and a V tensor each hop
        hops = (n - 1) * kv // n
        return [
            Collective("keys, values (ring)", kind, hops, 2 * (n - 1) * layers * runs, n, link, True)
            for kind in ("send", "recv")
        ]
    return [Collective("keys, values", "all_gather", kv, layers * runs, n, link, False)]
