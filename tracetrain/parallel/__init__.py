"""Multi-GPU parallelism as transforms over the plain model. The transform table in
tracetrain/train/assemble.py applies them, in an order it explains.

    mesh.py             named device mesh from [parallel], and the layout checks (ConfigError)
    dist.py             process group from torchrun's env, per-rank logs, failure watchdog
    data_parallel.py    FSDP2: replicate, ZeRO-1/2/3, HSDP; gradient-accumulation sync
    tensor_parallel.py  TP + sequence parallel + loss parallel (DTensor)
    context_parallel.py sequence split over cp ranks, all-gather-KV attention
    expert_parallel.py  MoE experts over ep ranks, all-to-all token dispatch
    pipeline.py         stages, GPipe / 1F1B / interleaved 1F1B schedules
    collectives.py      differentiable all-gather and all-to-all on plain c10d
    grads.py            gradient norm and clipping over every shard and stage
    apply.py            ParallelModel: the step hooks of a layout
    launch.py           local multi-process launcher (tests, benchmarks)

Sharded checkpoints (DCP) are in train/sharded_checkpoint.py, the cluster smoke check in train/smoke.py.
"""
