"""QLoRA's scale groups (`NF4Spec.group_size`): the defaults shard under FSDP on every preset.

A weight whose blocks divide into groups of the configured 256 keeps them (every real Qwen3
projection: the planner's byte formula is unchanged); a smaller one gets groups whose count is a
multiple of 8, so FSDP over 2, 4 or 8 ranks hands each rank whole groups without
`model.quant_scaler_block_size`.
"""

import pytest

from distft.config import load_config
from distft.errors import ConfigError
from distft.model import model_config
from distft.model.families import FAMILIES
from distft.model.nf4 import SHARDABLE_GROUPS, NF4Spec, check_quantizable, nf4_bytes, projection_shapes
from distft.model.presets import PRESETS
from distft.parallel import check_config, check_model
from tests.helpers import distft, metrics


# An MoE's experts are no Linear layers and QLoRA refuses it (tests/parallel/test_moe.py).
@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not FAMILIES[PRESETS[p].family].moe))
def test_group_counts_split_eight_ways(preset):
    spec = NF4Spec()
    for rows, cols in projection_shapes(PRESETS[preset].to_config()).values():
        blocks = rows * cols // spec.block_size
        size = spec.group_size(rows * cols)
        assert spec.scaler_block_size % size == 0 and blocks % size == 0
        assert size == 256 or (blocks // size) % SHARDABLE_GROUPS == 0
        if preset.startswith("qwen3"):  # real sizes: the configured group, as the planner assumes
            assert size == 256


def test_real_sizes_keep_the_byte_formula():
    # Qwen3-4B's q_proj in bf16: 0.5 + 1/64 + 2/(64 x 256) bytes per weight, + 17 x 2 bytes.
    numel = 4096 * 2560
    assert (
        sum(nf4_bytes(numel, NF4Spec(), itemsize=2).values())
        == numel // 2 + numel // 64 + numel // 16384 * 2 + 34
    )


@pytest.mark.parametrize("preset", ["micro", "tiny"])
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_presets_shard_with_the_defaults(preset, shards):
    check_quantizable(NF4Spec(), model_config(preset), shards=shards)


def test_beyond_eight_ranks_the_error_names_the_override():
    with pytest.raises(ConfigError, match=r"set model\.quant_scaler_block_size=2 \(or lower\)"):
        check_quantizable(NF4Spec(), model_config("tiny"), shards=16)
    check_quantizable(NF4Spec(scaler_block_size=2), model_config("tiny"), shards=16)


def test_tiny_qlora_fsdp_passes_the_checks_with_defaults():
    cfg = load_config(None, ["train.method=qlora", "parallel.strategy=fsdp", "parallel.nproc=2"])
    assert cfg.model.name == "tiny" and cfg.model.quant_scaler_block_size == 256
    check_config(cfg)
    check_model(cfg, model_config(cfg.model.name))


def test_tiny_qlora_fsdp_trains_with_defaults(tmp_path):
    out = tmp_path / "run"
    distft(
        "train", "--method", "qlora", "--strategy", "fsdp", "--nproc", "2", "--max-steps", "2",
        "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_every=0",
        "train.eval_batches=1", "data.max_length=256", "data.max_rows=8", "--out", str(out),
    )  # fmt: skip
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "adapter" / "quantization.json").is_file()
