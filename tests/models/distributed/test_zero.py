"""distributed.zero_stage=auto: plain data parallel while the optimizer state is small; a resume keeps its stage."""

from __future__ import annotations

import pytest

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.training.distributed import zero

GIB_OF_STATE = 2**30 // zero.STATE_BYTES_PER_PARAMETER  # parameters whose optimizer state is 1 GiB


def test_auto_partitions_only_a_large_optimizer_state_over_several_ranks():
    assert zero.choose(5_000_000, world=2) == 0  # the towers trained here: ~80 MB of state
    assert zero.choose(GIB_OF_STATE, world=8) == 0
    assert zero.choose(GIB_OF_STATE + 1, world=2) == 2
    assert zero.choose(10 * GIB_OF_STATE, world=1) == 0  # one rank: nothing to partition over


def test_a_set_stage_is_kept_and_auto_follows_the_checkpoint_it_resumes():
    big = 10 * GIB_OF_STATE
    assert zero.resolve("1", big, 2, resumed=None) == 1
    assert zero.resolve("auto", big, 2, resumed=None) == 2
    assert zero.resolve("auto", 1000, 2, resumed={"step": 8, "zero_stage": 2}) == 2  # the checkpoint's stage
    assert zero.resolve("auto", 1000, 2, resumed={"step": 8}) == zero.LEGACY_STAGE  # written before "auto"


def test_resuming_with_another_stage_is_a_clear_error(tmp_path):
    zero.check(0, 0, tmp_path)
    zero.check(None, 0, tmp_path)  # a checkpoint from before the stage was recorded: nothing to compare
    with pytest.raises(
        ValueError, match=r"written with ZeRO stage 2 but this run uses stage 0.*zero_stage=2"
    ):
        zero.check(2, 0, tmp_path)


def test_the_stage_reads_from_yaml_numbers_and_cli_strings_alike():
    assert load_config(TrainRunConfig, None, {}).distributed.zero_stage == "auto"
    assert load_config(TrainRunConfig, None, {"distributed.zero_stage": 2}).distributed.zero_stage == "2"
    assert load_config(TrainRunConfig, None, ["distributed.zero_stage=0"]).distributed.zero_stage == "0"
