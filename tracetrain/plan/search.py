"""`search(base, gpus, top)`: enumerate layouts and memory settings, keep what fits, rank by tokens/s.

Enumerated: every factorisation gpus = dp_shard x tp x pp x cp with tp <= 8 dividing n_heads and
n_kv_heads (and staying inside a node), pp dividing n_layers, cp dividing seq_len / 2; data
parallelism as FSDP (ZeRO-3) inside a node and, when the data-parallel group spans nodes, also as
HSDP (replicas of node-sized FSDP groups); recompute in {none, selective, full}; micro-batch in
{1, 2, 4, ...}; optimizer offload and streamed activation offload off/on. The global batch of `base`
(micro_batch x grad_accum x its data-parallel size) is kept where the layout allows it, by choosing
grad_accum; rows that cannot reach it say so in their reason.
"""

from __future__ import annotations

import itertools
import math

from tracetrain.plan.core import Plan, plan
from tracetrain.plan.inputs import PlanInput
from tracetrain.plan.memory import GIB, plan_memory
from tracetrain.plan.step import plan_time

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: PlanInput, gpus: int) -> list[dict[str, int]]:
    """Parallel layouts (dp_replicate, dp_shard, tp, pp, cp) whose product is `gpus`."""
    a = base.model
    out = []
    for tp, pp, cp in itertools.product(_divisors(gpus), repeat=3):
        if gpus % (tp * pp * cp):
            continue
        if tp > min(8, base.gpus_per_node) or a.n_heads % tp or a.n_kv_heads % tp:
            continue
        if pp > a.n_layers or a.n_layers % pp or (cp > 1 and base.seq_len % (2 * cp)):
            continue
        dp = gpus // (tp * pp * cp)
        out.append({"dp_replicate": 1, "dp_shard": dp, "tp": tp, "pp": pp, "cp": cp})
        node_dp = max(1, base.gpus_per_node // (tp * cp))
        if dp > node_dp and dp % node_dp == 0:
            out.append({"dp_replicate": dp // node_dp, "dp_shard": node_dp, "tp": tp, "pp": pp, "cp": cp})
    return out


def candidates(base: PlanInput, gpus: int) -> list[PlanInput]:
    target = base.global_batch
    out = []
    for lay in layouts(base, gpus):
        dp = lay["dp_replicate"] * lay["dp_shard"]
        for recompute, mb, opt_off, act_off in itertools.product(
            ("none", "selective", "full"), MICRO_BATCHES, (False, True), ("none", "streamed")
        ):
            if mb * dp > max(target, dp) and mb > 1:
                continue  # one micro-batch per rank already exceeds the global batch
            accum = max(1, target // (mb * dp))
            if lay["pp"] > 1:
                accum = max(accum, lay["pp"])
            inp = base.replace(
                num_gpus=gpus,
                micro_batch=mb,
                grad_accum=accum,
                pp_microbatches=0,
                recompute=recompute,
                recompute_every=1,
                optimizer_offload=opt_off,
                activation_offload=act_off,
                zero_stage=3,
                **lay,
            )
            out.append(inp)
    return out


def search(base: PlanInput, gpus: int, top: int = 10) -> list[Plan]:
    """Fitting plans ranked by tokens/s (best first), at most `top`, each with a one-line `reason`."""
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
    best = [plan(p.input) for p in rows[:top]]  # advice only for the rows shown
    for p in best:
        p.reason = reason(p, base)
    return best


def _rank_key(p: Plan) -> tuple:
    """Rows that keep the asked global batch first; then fastest first; rows within ~0.5% of each other
    prefer fewer parallel dimensions, fewer memory tricks and smaller micro-batches (the same speed
    for less machinery)."""
    i = p.input
    bucket = round(math.log(p.tokens_per_s) / math.log(1.005))
    dims = sum(x > 1 for x in (i.dp_replicate, i.tp, i.pp, i.cp))
    tricks = (i.recompute != "none") + i.optimizer_offload + (i.activation_offload != "none")
    return (p.reason_batch_changed, -bucket, dims, tricks, i.micro_batch)


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
        parts.append(f"PP={i.pp} bubble {comm.get('pipeline bubble', 0):.0%}")
    if i.cp > 1:
        parts.append(f"CP={i.cp} splits the sequence ({comm.get('CP comm (exposed)', 0):.0%} exposed ring)")
    if i.dp_shard > 1:
        parts.append(f"FSDP over {i.dp_shard} ({comm.get('FSDP comm (exposed)', 0):.0%} exposed)")
    if i.dp_replicate > 1:
        parts.append(f"{i.dp_replicate} replicas ({comm.get('DP comm (exposed)', 0):.0%} exposed all-reduce)")
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
