"""Distributed GEM user-model training on DeepSpeed (``gemflow train --model user --nproc N``).

    launch.py      the launcher: writes the run config, starts N ranks (torchrun or the deepspeed CLI)
    trainer.py     one rank: data -> token-budget batches -> sparse (torchrec DMP) -> dense (DeepSpeed engine)
    model.py       the split of the user model: sharded embeddings outside the engine, the dense tower inside
    sparse.py      the embedding lookups: large tables sharded (torchrec DMP), small ones replicated on every rank
    ds_config.py   the DeepSpeed config generated from our dataclass config (ZeRO, bf16, clipping, AdamW)
    moe.py         expert-parallel MoE feed-forward blocks (deepspeed.moe.layer.MoE), swapped in per layer
    fp8.py         torchao float8 training on attention / FFN linears, with a shape guard
    fp8_gemm.py    the float8 GEMM: on CPU the faster of torch._scaled_mm and a bf16 emulation, chosen once
    batching.py    batches built to a token budget and split across ranks with equal tokens
    checkpoint.py  atomic checkpoints: sparse (torch.distributed.checkpoint) + dense (engine) + data + RNG
    mfu.py         FLOPs per step (analytic, checked against FlopCounterMode), matmul peak, MFU

Why the split: giving DeepSpeed a module that contains the torchrec DistributedModelParallel breaks
(table-wise shards fail the engine's initial broadcast; row-wise checkpoints lose shards), so the sparse
module stays outside and only the dense tower goes to ``deepspeed.initialize``.
"""
