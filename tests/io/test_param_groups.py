"""The optimizer's hyperparameters packed into one checkpoint entry (`distft.io.param_groups`)."""

import torch

from distft.io.param_groups import PACKED, packed, to_load, unpacked

OPTIM = {
    "state.a.weight.exp_avg": torch.zeros(2),
    "param_groups.a.weight.lr": 0.004,  # LoRA+'s B group: its own lr
    "param_groups.a.weight.betas": (0.9, 0.999),
    "param_groups.b.lora_A.default.weight.lr": 0.001,
    "param_groups.b.lora_A.default.weight.betas": (0.9, 0.999),
}


def test_one_entry_holds_every_parameters_hyperparameters_and_spreads_back_as_it_was():
    saved = packed(OPTIM)  # one process: nothing to gather
    assert set(saved) == {"state.a.weight.exp_avg", PACKED}
    assert saved["state.a.weight.exp_avg"] is OPTIM["state.a.weight.exp_avg"]
    loading = to_load(OPTIM)
    loading[PACKED] = saved[PACKED]  # what DCP reads back
    spread = unpacked(loading, OPTIM)
    assert spread == OPTIM and isinstance(spread["param_groups.a.weight.betas"], tuple)
    # A rank that holds one of the parameters (a pipeline stage) takes its own entries only.
    stage = {k: v for k, v in OPTIM.items() if ".a." not in k}
    assert unpacked({**to_load(stage), PACKED: saved[PACKED]}, stage) == stage


def test_a_hyperparameter_json_cannot_hold_keeps_the_entries_per_parameter():
    optim = {**OPTIM, "param_groups.a.weight.lr": torch.tensor(0.004)}
    assert packed(optim) is optim
