"""Every embedding lookup of a step: large tables sharded across ranks, small tables replicated on each.

    ids --large tables (ad, user)--> torchrec DMP: all-to-all of ids and of the looked-up rows, fused row-wise
                                     Adagrad inside backward (table_wise / row_wise, ``distributed.sharding``)
        --small tables (action, surface, category, advertiser, gap)--> a full copy on every rank: local lookups,
                                     one all-reduce of their (small, dense) gradients after backward, then the
                                     same row-wise Adagrad

Why: a history token reads one row of each of six tables. Sharding them all sends six rows per token through the
all-to-all (forward, and their gradients backward), although five of the tables have a few hundred rows at
most: replicating those costs one all-reduce of a few hundred KB per step and leaves only the ad table's rows
in the exchange. torchrec's planner makes the same choice on GPUs (data-parallel small tables); its own
DATA_PARALLEL sharding of an ``EmbeddingCollection`` fails on CPU/gloo, hence this explicit split.
``distributed.replicate_max_rows`` is the threshold (0 = shard every table).

Both parts start from the same full tables on every world size, and both end each step with the same update
one process would make: the lookups' gradients (already scaled by 1/world, see ``model.to_engine``) are summed
over ranks, by the sharded backward for large tables and by the all-reduce for small ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.training.distributed.model import ShardableSparse

ADAGRAD_EPS = 1e-8  # fbgemm's fused row-wise Adagrad default: both parts update rows alike


def split_tables(sizes: dict[str, int], replicate_max_rows: int) -> tuple[set[str], set[str]]:
    """(sharded, replicated) table names: a table (its ids + the OOV row) of at most ``replicate_max_rows``
    rows is replicated."""
    small = {t for t, size in sizes.items() if size + 1 <= replicate_max_rows}
    return set(sizes) - small, small


class SparseLookup:
    """The sharded (DMP) and replicated parts of the embeddings, looked up and updated as one."""

    def __init__(self, full: ShardableSparse, dim: int, *, sharding: str, replicate_max_rows: int, world: int,
                 device: torch.device, lr: float, comm: str = "fp32"):  # fmt: skip
        from torchrec.optim import RowWiseAdagrad

        large, small = split_tables(full.sizes, replicate_max_rows)
        self.world = world
        self.dmp = None
        if large:
            self.dmp = shard_sparse(ShardableSparse(full, dim, large), sharding, world, device, lr, comm)
        self.replicated = self.optimizer = None
        if small:
            self.replicated = ShardableSparse(full, dim, small).to(device)
            self.optimizer = RowWiseAdagrad(self.replicated.parameters(), lr=lr, eps=ADAGRAD_EPS)
        self.sharded_tables, self.replicated_tables = sorted(large), sorted(small)

    def __call__(self, ids: dict, batch_size: int) -> dict[str, torch.Tensor]:
        out = {}
        if self.dmp is not None:
            out |= self.dmp(ids, batch_size)
        if self.replicated is not None:
            out |= self.replicated(ids, batch_size)
        return out

    def step(self) -> None:
        """After backward: sum the replicated tables' gradients over ranks (one all-reduce), update them."""
        if self.replicated is None:
            return
        params = list(self.replicated.parameters())
        for p in params:  # a table this rank's batch left untouched still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------------------- state
    def replicated_state(self) -> dict:
        """The replicated tables and their optimizer state (the same on every rank; rank 0 saves it)."""
        if self.replicated is None:
            return {}
        return {"model": self.replicated.state_dict(), "optim": self.optimizer.state_dict()}

    def load_replicated_state(self, state: dict) -> None:
        if self.replicated is None:
            return
        self.replicated.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def full_tables(self, rank: int) -> dict[str, torch.Tensor]:
        """Every full table on rank 0 (empty dict elsewhere), keyed like ``ShardableSparse``; collective."""
        tables = gather_full_tables(self.dmp, rank) if self.dmp is not None else {}
        if rank == 0 and self.replicated is not None:
            tables |= {k: v.detach().cpu().float() for k, v in self.replicated.state_dict().items()}
        return tables


def shard_sparse(
    sparse: ShardableSparse, sharding: str, world: int, device: torch.device, lr: float, comm: str = "fp32"
):
    """Fused row-wise Adagrad in backward, then a DMP plan with every table ``sharding`` (table/row-wise);
    the lookups' all-to-all (and their gradients') in ``comm`` precision."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    full = {k: v.detach().clone() for k, v in sparse.state_dict().items()}
    apply_optimizer_in_backward(RowWiseAdagrad, list(sparse.ec.parameters()), {"lr": lr})
    constraints = {f"t_{table}": ParameterConstraints(sharding_types=[sharding]) for table in sparse.sizes}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device=device.type), constraints=constraints, debug=False
    )
    codecs = None
    if comm == "bf16" and world > 1:
        from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

        codecs = get_qcomm_codecs_registry(QCommsConfig(CommType.BF16, CommType.BF16))
    sharder = EmbeddingCollectionSharder(qcomm_codecs_registry=codecs)
    plan = planner.collective_plan(sparse, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=sparse, device=device, plan=plan, sharders=[sharder])
    load_full_tables(dmp, full)
    return dmp


def load_full_tables(dmp, full: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tables into this rank's shards: every world size starts from the same weights."""
    for key, value in dmp.state_dict().items():
        source = full[_table_key(key)]
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                idx = tuple(
                    slice(o, o + s)
                    for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
                )
                shard.tensor.detach().copy_(source[idx])
        else:
            value.detach().copy_(source)


def gather_full_tables(dmp, rank: int) -> dict[str, torch.Tensor]:
    """Full tables on rank 0 (empty dict elsewhere), from every rank's shards; collective."""
    mine = []
    for key, value in dmp.state_dict().items():
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                md = shard.metadata
                mine.append((key, tuple(value.size()), md.shard_offsets, shard.tensor.detach().cpu().float()))
        elif rank == 0:
            mine.append((key, tuple(value.shape), [0] * value.dim(), value.detach().cpu().float()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return {}
    out: dict[str, torch.Tensor] = {}
    for part in everyone:
        for key, size, offsets, tensor in part:
            full = out.setdefault(_table_key(key), torch.zeros(size))
            idx = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape, strict=True))
            full[idx] = tensor
    return out


def _table_key(key: str) -> str:
    """DMP state-dict key -> the unsharded module's key (DMP may prefix ``module.``)."""
    return key.removeprefix("module.")
