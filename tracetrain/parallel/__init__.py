"""Multi-GPU parallelism as transforms over the plain model (see apply.py for the order).

    mesh.py             named device mesh from [parallel], and the layout checks (ConfigError)
    dist.py             process group from torchrun's env, per-rank logs, failure watchdog
    data_parallel.py    FSDP2: replicate, ZeRO-1/2/3, HSDP; gradient-accumulation sync
    tensor_parallel.py  TP + sequence parallel + loss parallel (DTensor)
    context_parallel.py sequence split over cp ranks, all-gather-KV attention
    expert_parallel.py  MoE experts over ep ranks, all-to-all token dispatch
    pipeline.py         stages, GPipe / 1F1B / interleaved 1F1B, pipeline_train_step
    checkpoint.py       DCP save / load of sharded model + optimizer, any layout to any layout
    apply.py            parallelize(model, mesh, cfg) -> ParallelModel (step hooks)
    launch.py           local multi-process launcher (tests, benchmarks); smoke.py: cluster check
"""
