"""`search(base, gpus, top)`: enumerate layouts and memory settings, keep what fits, rank by tokens/s
(`search_layouts`: the best row of each distinct layout).

Enumerated: every factorisation gpus = dp x tp x pp x cp with tp <= 8 dividing n_heads and n_kv_heads
(and staying inside a node), pp <= n_layers (uneven splits as parallel/pipeline.py makes them), cp
dividing seq_len / 2. Data parallelism in every flavour the trainer builds (parallel/data_parallel.py):
FSDP with ZeRO stage 1, 2 or 3 over dp_shard * cp, plain DDP (dp_replicate = dp) and, when the
data-parallel group spans nodes, HSDP (replicas of node-sized FSDP groups). Pipelines with each schedule
(GPipe, 1F1B, interleaved 1F1B with two stages per rank). Recompute in {none, selective, full};
micro-batch in {1, 2, 4, ...}; streamed activation offload off/on; CPU offload of the optimizer on one
GPU, of the FSDP shards (ZeRO-3) on several (the trainer refuses optimizer offload with several ranks).
Only what the trainer accepts is tried: no pipeline for tied embeddings or fp16, FP8 with data
parallelism only (validate.py, parallel/mesh.py). The global batch of `base` (micro_batch x grad_accum
x its data-parallel size) is kept where the layout allows it, by choosing grad_accum; rows that cannot
reach it say so in their reason.
"""

from __future__ import annotations

import itertools
import math

from tracetrain.models.families import layout_refusal
from tracetrain.plan.core import Plan, plan
from tracetrain.plan.inputs import PlanInput, PlanInputError
from tracetrain.plan.memory import GIB, plan_memory
from tracetrain.plan.step import plan_time

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: PlanInput, gpus: int) -> list[dict[str, int]]:
    """Parallel layouts (dp_replicate, dp_shard, tp, pp, cp) whose product is `gpus` and that the
    trainer accepts for `base`'s model and precision."""
    a = base.model
    out = []
    for tp, pp, cp in itertools.product(_divisors(gpus), repeat=3):
        if gpus % (tp * pp * cp):
            continue
        if tp > min(8, base.gpus_per_node) or a.n_heads % tp or a.n_kv_heads % tp:
            continue
        if pp > a.n_layers or (cp > 1 and base.seq_len % (2 * cp)):
            continue
        if pp > 1 and (a.tie_embeddings or base.precision == "fp16"):
            continue  # parallel/mesh.py refuses these pipelines
        if base.precision == "fp8" and max(tp, pp, cp) > 1:
            continue  # validate.py: FP8 composes with data parallelism only
        if layout_refusal(a, tp=tp, pp=pp, cp=cp, sequence_parallel=base.sequence_parallel):
            continue  # validate.py: what the model's family does not run (Gemma: no pp/cp/sp; longrope Phi: no pp)
        dp = gpus // (tp * pp * cp)
        out.append({"dp_replicate": 1, "dp_shard": dp, "tp": tp, "pp": pp, "cp": cp})
        if dp > 1 and cp == 1:  # plain DDP: every rank a full replica
            out.append({"dp_replicate": dp, "dp_shard": 1, "tp": tp, "pp": pp, "cp": cp})
        node_dp = max(1, base.gpus_per_node // (tp * cp))
        if node_dp > 1 and dp > node_dp and dp % node_dp == 0:
            out.append({"dp_replicate": dp // node_dp, "dp_shard": node_dp, "tp": tp, "pp": pp, "cp": cp})
    return out


def _flavours(lay: dict[str, int], gpus: int, n_layers: int) -> list[dict[str, object]]:
    """Per layout: the ZeRO stage and CPU offload of the data-parallel flavour, and the pipeline
    schedule (interleaved: two stages per rank, where the layers allow it)."""
    sharded = lay["dp_shard"] * lay["cp"] > 1
    zero: list[dict[str, object]] = [{"zero_stage": 3, "fsdp_cpu_offload": False, "optimizer_offload": False}]
    if sharded:
        zero += [{"zero_stage": z, "fsdp_cpu_offload": False, "optimizer_offload": False} for z in (1, 2)]
        zero.append({"zero_stage": 3, "fsdp_cpu_offload": True, "optimizer_offload": False})
    if gpus == 1:
        zero.append({"zero_stage": 3, "fsdp_cpu_offload": False, "optimizer_offload": True})
    schedules: list[dict[str, object]] = [{"pp_schedule": "1f1b", "pp_virtual_stages": 1}]
    if lay["pp"] > 1:
        schedules.append({"pp_schedule": "gpipe", "pp_virtual_stages": 1})
        if n_layers >= 2 * lay["pp"]:
            schedules.append({"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2})
    return [{**z, **s} for z in zero for s in schedules]


def candidates(base: PlanInput, gpus: int) -> list[PlanInput]:
    target = base.global_batch
    out = []
    for lay in layouts(base, gpus):
        dp = lay["dp_replicate"] * lay["dp_shard"]
        for flavour, recompute, mb, act_off in itertools.product(
            _flavours(lay, gpus, base.model.n_layers),
            ("none", "selective", "full"),
            MICRO_BATCHES,
            ("none", "streamed"),
        ):
            if mb * dp > max(target, dp) and mb > 1:
                continue  # one micro-batch per rank already exceeds the global batch
            accum = max(1, target // (mb * dp))
            if lay["pp"] > 1:
                accum = max(accum, lay["pp"])
            if flavour["zero_stage"] == 1 and (accum == 1 or lay["pp"] > 1):
                continue  # ZeRO-1 is ZeRO-2 when gradients are reduced once anyway (data_parallel.py)
            inp = base.replace(
                num_gpus=gpus,
                micro_batch=mb,
                grad_accum=accum,
                pp_microbatches=0,
                recompute=recompute,
                recompute_every=1,
                activation_offload=act_off,
                **flavour,
                **lay,
            )
            out.append(inp)
    return out


def search(base: PlanInput, gpus: int, top: int = 10) -> list[Plan]:
    """Fitting plans ranked by tokens/s (best first), at most `top`, each with a one-line `reason`.
    PlanInputError when `gpus` < 1 or `base` itself cannot be planned (an unknown GPU, FP8 on a GPU
    without it): every candidate would be dropped, and "nothing fits" would be the wrong answer."""
    return _explained(_ranked(base, gpus)[:top], base)


def search_layouts(base: PlanInput, gpus: int, top: int | None = None) -> list[Plan]:
    """The best fitting row of each distinct layout (`Plan.layout()`: DDP, each FSDP/ZeRO flavour, tp,
    pp with its schedule, cp), ranked as `search` ranks them, at most `top`; each row keeps the memory
    settings (micro-batch, recomputation, offload) the search chose for its layout."""
    best: dict[str, Plan] = {}
    for row in _ranked(base, gpus):
        best.setdefault(row.layout(), row)
    return _explained(list(best.values())[:top], base)


def _ranked(base: PlanInput, gpus: int) -> list[Plan]:
    """Every fitting candidate, planned without advice, in `_rank_key` order."""
    if gpus < 1:
        raise PlanInputError(f"gpus = {gpus}: must be at least 1")
    one = {"num_gpus": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    base.replace(**one, optimizer_offload=False, unified_memory="none").validate_numbers()
    rows: list[Plan] = []
    for inp in candidates(base, gpus):
        try:
            inp.validate()
        except ValueError:
            continue  # e.g. a pipeline with fewer micro-batches than stages
        memory = plan_memory(inp)
        if memory.fits:
            row = Plan(inp, memory, plan_time(inp))
            row.reason_batch_changed = inp.global_batch != base.global_batch
            rows.append(row)
    rows.sort(key=_rank_key)
    return rows


def _explained(rows: list[Plan], base: PlanInput) -> list[Plan]:
    best = [plan(p.input) for p in rows]  # advice only for the rows shown
    for p in best:
        p.reason = reason(p, base)
    return best


def _rank_key(p: Plan) -> tuple:
    """Rows that keep the asked global batch first; then fastest first; rows within ~0.5% of each other
    prefer fewer parallel dimensions, fewer memory tricks, smaller micro-batches and then less memory
    (the same speed for less machinery: ZeRO-2 before ZeRO-1 when they tie)."""
    i = p.input
    bucket = round(math.log(p.tokens_per_s) / math.log(1.005))
    dims = sum(x > 1 for x in (i.dp_replicate, i.tp, i.pp, i.cp))
    tricks = (i.recompute != "none") + i.optimizer_offload + i.fsdp_cpu_offload + (i.activation_offload != "none")
    return (p.reason_batch_changed, -bucket, dims, tricks, i.micro_batch, p.memory.peak_bytes)


def _needed(inp: PlanInput, **without: object) -> str:
    """' to fit' when the row would not fit without this memory option."""
    return "" if plan_memory(inp.replace(**without)).fits else f" to fit micro-batch {inp.micro_batch}"


def reason(p: Plan, base: PlanInput) -> str:
    """Why this row: spare memory, what the layout and memory options cost or buy."""
    i, m, t = p.input, p.memory, p.time
    parts = [f"fits with {m.spare_bytes / GIB:.0f} GiB spare"]
    comm = {k: v / t.step_s for k, v in t.breakdown.items() if "comm" in k or "bubble" in k or "offload" in k}
    if i.tp > 1:
        parts.append(
            f"TP={i.tp} divides weights and most activations by {i.tp} but adds "
            f"{comm.get('TP comm (exposed)', 0):.0%} exposed all-reduce"
        )
    if i.pp > 1:
        parts.append(f"PP={i.pp} ({i.pp_schedule}) bubble {comm.get('pipeline bubble', 0):.0%}")
    if i.cp > 1:
        # parallel/context_parallel.py all-gathers K/V (no ring): step._cp_all_gather charges it all exposed.
        parts.append(
            f"CP={i.cp} splits the sequence; each block all-gathers the whole sequence's keys and values "
            f"({comm.get('CP comm (exposed)', 0):.0%} exposed: not overlapped with attention)"
        )
    if i.dp_shard * i.cp > 1:
        kind, key = ("FSDP", "FSDP comm (exposed)") if i.zero3 else (f"ZeRO-{i.zero_stage}", "ZeRO comm (exposed)")
        over = f"{i.dp_shard}" if i.cp == 1 else f"dp_shard x cp = {i.dp_shard * i.cp}"
        parts.append(f"{kind} over {over} ({comm.get(key, 0):.0%} exposed)")
    if i.dp_replicate > 1:
        kind = "DDP" if i.dp_shard * i.cp == 1 else "HSDP"
        parts.append(f"{kind}: {i.dp_replicate} replicas ({comm.get('DP comm (exposed)', 0):.0%} exposed all-reduce)")
    if i.fsdp_cpu_offload:
        parts.append("FSDP shards in host memory" + _needed(i, fsdp_cpu_offload=False))
    if i.recompute != "none":
        parts.append(f"recompute={i.recompute}" + _needed(i, recompute="none"))
    if i.optimizer_offload:
        cpu = t.breakdown.get("offload: CPU AdamW", 0) / t.step_s
        parts.append(f"AdamW on the CPU ({cpu:.0%} of the step)" + _needed(i, optimizer_offload=False))
    if i.activation_offload != "none":
        parts.append(
            f"activations streamed to the host ({comm.get('activation offload (exposed)', 0):.0%} exposed)"
            + _needed(i, activation_offload="none")
        )
    if i.global_batch != base.global_batch:
        parts.append(f"global batch {i.global_batch} (asked {base.global_batch})")
    return "; ".join(parts)
