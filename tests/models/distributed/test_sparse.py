"""Sharded + replicated embedding tables: the split by size, and the replicated update equals the fused one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from gemflow.workspace import Workspace
from models.training.distributed.model import DenseTower, ShardableSparse, sparse_ids
from models.training.distributed.run_checkpoint import check_table_split
from models.training.distributed.sparse import SparseLookup, split_tables
from models.training.prepare import prepare
from tests.models.distributed.conftest import small_config


@pytest.fixture
def process_group(tmp_path):
    """A real one-process gloo group (DMP needs one), torn down after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_tables_of_at_most_the_threshold_rows_are_replicated():
    sizes = {"ad_id": 80, "user_id": 60, "action": 8, "gap_bucket": 32}  # ids; tables hold one more (OOV) row
    assert split_tables(sizes, 33) == ({"ad_id", "user_id"}, {"action", "gap_bucket"})
    assert split_tables(sizes, 32) == ({"ad_id", "user_id", "gap_bucket"}, {"action"})
    assert split_tables(sizes, 0) == (set(sizes), set())


def test_replicated_tables_take_the_fused_sharded_update(training_set, tmp_path, process_group):
    """The same step through the fused row-wise Adagrad of the DMP (every table sharded) and through the
    replicated tables' all-reduce + RowWiseAdagrad (every table replicated): the same tables afterwards."""
    cfg = small_config(training_set)
    setup = prepare(cfg, Workspace(tmp_path / "ws"))
    model = setup.bundle.model
    model.train()
    full = ShardableSparse(model.sparse, cfg.user_model.d_model)
    tower = DenseTower(model)
    batch = setup.builder(setup.train_rows[:24])
    torch.manual_seed(3)
    ids, _ = sparse_ids(tower.model, batch)  # every feature, the next-event negatives included
    kwargs = {"sharding": "table_wise", "world": 1, "device": torch.device("cpu"), "lr": 0.05}
    tables = {}
    for name, max_rows in (("sharded", 0), ("replicated", 10**9)):
        lookup = SparseLookup(
            copy.deepcopy(full), cfg.user_model.d_model, replicate_max_rows=max_rows, **kwargs
        )
        assert (lookup.dmp is None) == (name == "replicated")
        for _ in range(2):  # the second step reads the first one's Adagrad state
            emb = lookup(ids, batch.history.batch_size)
            loss = sum((v * torch.linspace(-1, 1, v.shape[1])).sum() for v in emb.values())
            loss.backward()
            lookup.step()
        tables[name] = lookup.full_tables(rank=0)
    assert tables["sharded"].keys() == tables["replicated"].keys() == full.state_dict().keys()
    for key, start in full.state_dict().items():
        assert not torch.equal(tables["replicated"][key], start), f"{key} was not updated"
        torch.testing.assert_close(tables["replicated"][key], tables["sharded"][key], msg=key)


def test_resuming_with_another_table_split_is_a_clear_error(tmp_path):
    check_table_split(["action", "surface"], ["surface", "action"], tmp_path)  # same split, any order
    with pytest.raises(ValueError, match="replicate_max_rows it was written with"):
        check_table_split([], ["action", "surface"], tmp_path)  # a checkpoint with every table sharded
