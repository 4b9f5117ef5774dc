"""Test support for the parallel layouts: a tiny model, deterministic global batches, and runs of the
trainer's own `train_step` (train/step.py) on runs built as the trainer builds them.

Every run here is assembled by the trainer's path: `resolve` (spec.py) and `assemble` (train/assemble.py:
the model on meta, the layout rows, materialisation of this rank's shards, the MoE weight, the optimizer),
and steps with `run_step_context`'s StepContext. The multi-process tests run a layout and a single
process on the same global batches and compare losses, gradients (gathered to full tensors) and
parameters; the single-process reference is the same config resolved for one rank (`reference_of`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tracetrain.config import Config, load_config
from tracetrain.train.assemble import Assembly, assemble, run_step_context
from tracetrain.train.smoke import TINY as SMOKE_TINY
from tracetrain.train.step import StepOutput, train_step

# The smoke test's tiny fp32 model with AdamW eps = 1 (tracetrain/train/smoke.py explains why), on the CPU.
TINY = [*SMOKE_TINY, "--train.device=cpu"]


def tiny_config(overrides: list[str]) -> Config:
    return load_config(None, TINY + overrides)


def assemble_tiny(cfg: Config, world_size: int = 1, mesh: object = None) -> Assembly:
    """cfg's run on the CPU as the trainer assembles it: resolved for `world_size` ranks and built by the
    transform table (on `mesh`, default a new mesh over the ranks when there are several). Every rank
    gets the same seeded values wherever its shards sit (`materialise`)."""
    from tracetrain.spec import resolve

    if world_size > 1 and mesh is None:
        from tracetrain.parallel.mesh import build_mesh

        mesh = build_mesh(cfg.parallel, "cpu")
    return assemble(resolve(cfg, torch.device("cpu"), world_size), mesh)


def reference_of(cfg: Config) -> Assembly:
    """A layout's single-process reference: the layout's config resolved for one rank, so the layout rows
    do not run and the spec decides what depends on the layout as it does for the layout (the MoE
    load-balancing weight counts the layout's forward passes; fused cross-entropy is off under TP)."""
    return assemble_tiny(cfg, world_size=1)


def global_batches(cfg: Config, rows: int, num: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """`num` global micro-batches of `rows` rows (the cluster smoke check's batches, train/smoke.py)."""
    from tracetrain.train.smoke import smoke_batches

    return smoke_batches(cfg, rows, seed, num)


def run_step(a: Assembly, micro_batches: list[dict[str, torch.Tensor]], optimizer: object = None) -> StepOutput:
    """The trainer's `train_step` on the assembled run `a` (its layout's hooks ride in the StepContext, as in
    the trainer); `optimizer`: a wrapper of a.optimizer that records something around its step."""
    opt = optimizer if optimizer is not None else a.optimizer
    return train_step(a.module, opt, micro_batches, run_step_context(a))  # type: ignore[arg-type]


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of the full tensor (collective for DTensors: every rank of its mesh must call)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class _OptimizerWrapper:
    """What train_step reads of an optimizer, passed through; subclasses record something around `step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        self.optimizer, self.module = optimizer, module

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class GradCapture(_OptimizerWrapper):
    """Optimizer wrapper that records full gradients (after clipping) just before each update."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        super().__init__(optimizer, module)
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self) -> None:
        self.grads.append({n: full(p.grad) for n, p in self.module.named_parameters() if p.grad is not None})
        super().step()


def train_and_record(a: Assembly, batches_per_step: list[list[dict[str, torch.Tensor]]]) -> dict[str, object]:
    """Run one step of the assembled run `a` per entry of `batches_per_step`; losses, norms, full grads and
    final full params."""
    assert a.optimizer is not None
    optimizer = GradCapture(a.optimizer, a.module)
    losses, norms = [], []
    for micro_batches in batches_per_step:
        out = run_step(a, micro_batches, optimizer)
        losses.append(float(out.loss))
        norms.append(float(out.grad_norm))
    params = {n: full(p) for n, p in a.module.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": optimizer.grads, "params": params}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the tensors `got` holds (a pipeline rank holds a subset)."""
    missing = set(got) - set(want)
    assert not missing, f"unexpected tensors {sorted(missing)[:3]}"
    return max((float((got[k] - want[k]).abs().max()) for k in got), default=0.0)


# ----------------------------------------------------------------------------------------------------
# Multi-process layout checks (run in every rank by `launch_local`)


def _layout_facts(par: Any) -> dict[str, object]:
    """Evidence that the layout is really applied: placements and local shapes of some weights of
    this rank's first block (rank 0), and how many blocks the rank holds."""
    first = min(int(k) for part in par.parts for k in _layer_keys(part))
    params = dict(par.module.named_parameters())
    facts: dict[str, object] = {"num_layers_here": sum(len(part.layers) for part in par.parts)}
    for short in ("self_attn.q_proj.weight", "mlp.experts.gate_proj", "input_layernorm.weight"):
        p = params.get(f"layers.{first}.{short}")
        if p is not None:
            local = p.to_local() if isinstance(p, DTensor) else p
            facts[short] = {
                "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else [],
                "local_shape": list(local.shape),
            }
    return facts


def _layer_keys(part: nn.Module) -> list[str]:
    layers = part.layers
    return list(layers.keys()) if isinstance(layers, nn.ModuleDict) else [str(i) for i in range(len(layers))]


def _accumulation_probe(a: Assembly, batch: dict[str, torch.Tensor]) -> dict[str, dict[str, int]] | None:
    """Collectives issued by a non-final ("first") and the final ("last") micro-batch of a step:
    {"first": {"allgather_base": 6, ...}, "last": {...}} from the profiler's c10d op names (the step's
    own micro-batch loss, `micro_batch_loss`). The names are read from the raw kineto events: building
    the profiler's FunctionEvent tree (`prof.events()`) for every op of a sharded forward and backward
    cost ~0.7 s a probe on each rank, the names alone ~10 ms."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from tracetrain.train.step import micro_batch_loss

    par = a.par
    if par.pipeline is not None:
        return None
    ctx = run_step_context(a)
    mb = par.shard_batch(batch)
    counts = {}
    for is_last in (False, True):
        with profile(activities=[ProfilerActivity.CPU]) as prof, par.micro_batch(is_last=is_last):
            micro_batch_loss(par.module, mb, ctx)[0].backward()
        names = [e.name() for e in prof.profiler.kineto_results.events()]
        tag = "last" if is_last else "first"
        counts[tag] = dict(Counter(n.split("::")[1].strip("_") for n in names if n.startswith("c10d::")))
    for p in par.module.parameters():
        p.grad = None
    return counts


def check_layouts(layouts: list[dict], out_path: str, timeout_s: int = 120) -> None:
    """For each layout: 3 optimizer steps with the layout and in one process on the same global
    batches; rank 0 writes {name: {loss, norm, grad, param (max abs diffs over all ranks), facts}}.

    A layout is {"name", "overrides" (config CLI overrides), "accum" (micro-batches per step: the
    config's train.grad_accum_steps), "probe" (with accum > 1: also count the collectives of a first and
    a last micro-batch, `_accumulation_probe`), "split_reference" (the single-process reference
    accumulates the global batch row-chunk by row-chunk, one per data-parallel rank: needed where
    per-micro-batch statistics (MoE load balancing) enter the gradient)}. Both runs are assembled by the
    trainer's path, so the MoE load-balancing weight is the trainer's (the mean over the step's forward
    passes).
    """
    import json

    import torch.distributed as dist

    from tracetrain.models.build import model_args_from_config
    from tracetrain.parallel import dist as tdist
    from tracetrain.parallel.mesh import build_mesh, validate_parallel

    torch.set_num_threads(1)
    info = tdist.init_distributed(timeout_s, "cpu")
    results: dict[str, object] = {}
    for layout in layouts:
        accum = layout.get("accum", 1)
        cfg = tiny_config([*layout["overrides"], f"--train.grad_accum_steps={accum}"])
        validate_parallel(cfg, model_args_from_config(cfg), info.world_size)
        steps = [global_batches(cfg, 4, accum, seed=s) for s in range(3)]
        pm = build_mesh(cfg.parallel, "cpu")
        dp = pm.size("dp")
        ref_steps = steps
        if layout.get("split_reference"):
            ref_steps = [
                [{k: v.chunk(dp)[r] for k, v in mb.items()} for mb in step for r in range(dp)] for step in steps
            ]
        ref = train_and_record(reference_of(cfg), ref_steps)
        built = assemble_tiny(cfg, info.world_size, pm)
        probe = _accumulation_probe(built, steps[0][0]) if accum > 1 and layout.get("probe") else None
        got = train_and_record(built, steps)
        diffs = torch.tensor(
            [
                max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])),
                max(abs(a - b) for a, b in zip(got["norms"], ref["norms"])),
                max(max_diff(g, r) for g, r in zip(got["grads"], ref["grads"])),
                max_diff(got["params"], ref["params"]),
            ]
        )
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        num_grads = torch.tensor([len(got["grads"][0])])
        dist.all_reduce(num_grads)
        results[layout["name"]] = {
            "loss": float(diffs[0]),
            "norm": float(diffs[1]),
            "grad": float(diffs[2]),
            "param": float(diffs[3]),
            "losses": got["losses"],
            "ref_losses": ref["losses"],
            "num_grads_all_ranks": int(num_grads),
            "num_params": len(ref["params"]),
            "accumulation_probe": probe,
            "facts": _layout_facts(built.par),
        }
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    tdist.shutdown()


def failure_drill(mode: str, run_dir: str, timeout_s: int) -> None:
    """A job whose rank 1 misbehaves at step 2 ("raise", "hang" or "exit"); rank 0 keeps issuing
    collectives. Run as a plain process per rank (no launcher that would kill the others for us)."""
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from tracetrain.parallel import dist as tdist

    info = tdist.init_distributed(timeout_s, "cpu")
    log = tdist.setup_rank_logging(Path(run_dir), info.rank)
    watchdog = tdist.Watchdog(info.rank, stall_s=timeout_s).start()
    with tdist.failure_guard(watchdog, info.rank):
        for step in range(100):
            watchdog.beat(f"step {step}")
            if info.rank == 1 and step == 2:
                log.info(f"injecting a {mode} at step {step}")
                # CLOCK_MONOTONIC is one clock for every process on the machine: the test measures from here.
                (Path(run_dir) / "injected_at").write_text(repr(time.monotonic()))
                if mode == "raise":
                    raise ValueError("injected failure")
                if mode == "hang":
                    time.sleep(10_000)
                if mode == "exit":
                    os._exit(3)
            value = torch.ones(1)
            dist.all_reduce(value)
            time.sleep(0.05)
    tdist.shutdown(watchdog)


# ----------------------------------------------------------------------------------------------------
# Sharded checkpoints


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts on every rank (collective; tiny models only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    )
    model_sd = {k: full(v) for k, v in model_sd.items()}
    optim_sd = {
        "state": {
            k: {n: full(t) if isinstance(t, torch.Tensor) else t for n, t in s.items()}
            for k, s in optim_sd["state"].items()
        }
    }
    return model_sd, optim_sd


def state_diff(a: tuple[dict, dict], b: tuple[dict, dict]) -> float:
    """Largest absolute difference between two `full_state` results (model and optimizer)."""
    diffs = [float((a[0][k] - b[0][k]).abs().max()) for k in b[0]]
    for k, s in b[1]["state"].items():
        diffs += [float((a[1]["state"][k][n] - t).abs().max()) for n, t in s.items()]
    return max(diffs)


def dcp_drill(run_dir: str) -> None:
    """Save on dp_shard=4 after 2 of 4 steps; resume on the same layout, on dp_shard=2 x tp=2 and on
    pp=2 x dp_shard=2. Rank 0 writes run_dir/dcp_results.json and the states the parent compares."""
    import json
    from pathlib import Path

    from tracetrain.parallel import dist as tdist
    from tracetrain.train.sharded_checkpoint import load_sharded, save_sharded

    torch.set_num_threads(1)
    out = Path(run_dir)
    info = tdist.init_distributed(120, "cpu")
    steps = [global_batches(tiny_config([]), 4, 1, seed=s) for s in range(4)]

    def setup(overrides: list[str], seed: int) -> tuple[Assembly, nn.Module, torch.optim.Optimizer]:
        built = assemble_tiny(tiny_config(overrides + [f"--train.seed={seed}"]), info.world_size)
        assert built.optimizer is not None
        return built, built.module, built.optimizer

    run, module, opt = setup(["--parallel.dp_shard=4"], seed=0)
    for batches in steps[:2]:
        run_step(run, batches)
    reports: list[tuple[int, int | None]] = []  # rank 0's progress, as the console's bar would hear it
    progress = (lambda what, done, total, unit="": reports.append((done, total))) if info.rank == 0 else None
    path = save_sharded(
        out, 2, module, opt, {"step": 2, "rank": info.rank}, "# config\n", keep_last=2, progress=progress
    )
    saved = full_state(module, opt)
    for batches in steps[2:]:
        run_step(run, batches)
    straight = full_state(module, opt)
    results: dict[str, float] = {}
    for name, overrides in (
        ("same_layout", ["--parallel.dp_shard=4"]),
        ("fsdp2_tp2", ["--parallel.dp_shard=2", "--parallel.tp=2"]),
        ("pp2_fsdp2", ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_microbatches=2"]),
    ):
        run, module, opt = setup(overrides, seed=123)  # other initial weights: only the load can make them equal
        trainer_state = load_sharded(path, module, opt)
        results[f"{name}_loaded_vs_saved"] = _subset_diff(full_state(module, opt), saved)
        for batches in steps[2:]:
            run_step(run, batches)
        results[f"{name}_resumed_vs_straight"] = _subset_diff(full_state(module, opt), straight)
        results[f"{name}_trainer_state_step"] = trainer_state["step"]
    if info.rank == 0:
        results["save_progress_reports"] = reports
        results["save_tensor_bytes"] = sum(t.numel() * t.element_size() for t in saved[0].values())
        torch.save({"saved": saved, "straight": straight, "checkpoint": str(path)}, out / "dcp_reference.pt")
        (out / "dcp_results.json").write_text(json.dumps(results))
    tdist.shutdown()


def _subset_diff(got: tuple[dict, dict], want: tuple[dict, dict]) -> float:
    """`state_diff` over the entries `got` holds (a pipeline rank holds some layers), max over ranks."""
    import torch.distributed as dist

    sub = ({k: want[0][k] for k in got[0]}, {"state": {k: want[1]["state"][k] for k in got[1]["state"]}})
    value = torch.tensor(state_diff(got, sub))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


# ----------------------------------------------------------------------------------------------------
# Compositions with several ranks


def compose_drills(out_path: str, inf_layouts: list[str], offload_layouts: list[list[str]]) -> None:
    """The fp16 found-inf drill over `inf_layouts` and the activation-offload drill over `offload_layouts`,
    in one job (process start-up dominates on a 2-core CI machine); rank 0 writes
    {"found_inf": `found_inf_results`, "offload": `offload_results`}."""
    import json

    from tracetrain.parallel import dist as tdist

    torch.set_num_threads(1)
    info = tdist.init_distributed(120, "cpu")
    results = {
        "found_inf": found_inf_results(inf_layouts, info.rank, info.world_size),
        "offload": offload_results(offload_layouts, info.world_size),
    }
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    tdist.shutdown()


def found_inf_results(layouts: list[str], rank: int, world_size: int) -> dict[str, object]:
    """For each layout over 2 ranks (FSDP, TP, CP) with fp16 loss scaling, one step twice: with an inf
    put into rank 1's local gradient shard alone after the backward ("inject"), then without ("control").
    With the inf, the trainer's optimizer_update must skip the step and back off the scale on every rank
    alike. {layout: {"inject": {scale, changed (params moved), ...} per rank, "control": {...}}}
    (collective: every rank calls it)."""
    return {
        layout: {case: _found_inf_step(layout, case == "inject", rank, world_size) for case in ("inject", "control")}
        for layout in layouts
    }


def _found_inf_step(layout: str, inject: bool, rank: int, world_size: int) -> dict[str, object]:
    """One fp16 step of a fresh model with `layout` (an inf in rank 1's gradient if `inject`): whether
    each rank's weights changed, each rank's scale after the step, and the step's flags."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tracetrain.train.step import forward_backward, optimizer_update

    built = assemble_tiny(tiny_config([layout, "--train.precision=fp16"]), world_size)
    assert built.optimizer is not None and built.spec.autocast_dtype == torch.float16
    scaler = torch.amp.GradScaler("cpu")  # the trainer's fp16 scaler (train/run_setup.py), on the CPU
    ctx = run_step_context(built, scaler=scaler)
    module = built.module
    before = {n: full(p) for n, p in module.named_parameters()}
    total = forward_backward(module, global_batches(built.spec.cfg, 4, 1), ctx)
    if inject and rank == 1:
        p = next(p for p in module.parameters() if p.grad is not None)
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local.view(-1)[0] = float("inf")
    out = optimizer_update(built.optimizer, total, ctx)
    after = {n: full(p) for n, p in module.named_parameters()}
    changed = torch.tensor([float(any(not torch.equal(before[n], after[n]) for n in before))])
    flags = [torch.zeros(2), torch.zeros(2)]
    dist.all_gather(flags, torch.tensor([changed.item(), float(scaler.get_scale())]))
    return {
        "changed": [float(x[0]) for x in flags],
        "scale": [float(x[1]) for x in flags],
        "finite": bool(out.finite),
        "diverged": bool(out.diverged),
    }


def offload_results(layouts: list[list[str]], world_size: int) -> dict[str, object]:
    """For each data-parallel layout (config overrides), streamed activation offload (half the blocks):
    2 steps with the layout and in one process on the same global batches (4 rows).
    {" ".join(overrides): {max loss/grad/param diffs, per rank: the bytes and tensors its last forward
    offloaded next to what one process offloads for a batch of the same shape as that rank's rows}}: equal
    only if the layout's gathered weights (FSDP's unsharded parameters) are recognised as weights and stay
    where they are (collective: every rank calls it)."""
    return {" ".join(overrides): _offload_compared(overrides, world_size) for overrides in layouts}


def _offload_compared(overrides: list[str], world_size: int) -> dict[str, object]:
    """`offload_results` for one layout (collective: every rank calls it)."""
    import torch.distributed as dist

    cfg = tiny_config([*overrides, "--memory.activation_offload=streamed", "--memory.activation_offload_fraction=0.5"])

    def run(a: Assembly, steps: list[list[dict[str, torch.Tensor]]]) -> tuple[dict[str, object], object]:
        offload = a.activation_offload
        # The table's row offloads saved tensors of 1 MiB and more; the tiny model's are a few KiB.
        offload.min_offload_bytes = 1
        assert a.optimizer is not None
        optimizer = GradCapture(a.optimizer, a.module)
        losses = [float(run_step(a, mbs, optimizer).loss) for mbs in steps]
        params = {n: full(p) for n, p in a.module.named_parameters()}
        return {"losses": losses, "grads": optimizer.grads, "params": params}, offload.stats

    steps = [global_batches(cfg, 4, 1, seed=s) for s in range(2)]
    ref, _ = run(reference_of(cfg), steps)
    built = assemble_tiny(cfg, world_size)
    got, stats = run(built, steps)
    local_rows = 4 // built.mesh.size("dp")
    _, local_ref_stats = run(reference_of(cfg), [global_batches(cfg, local_rows, 1)])
    diffs = torch.tensor(
        [
            max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])),  # type: ignore[call-overload]
            max(max_diff(g, r) for g, r in zip(got["grads"], ref["grads"])),  # type: ignore[call-overload]
            max_diff(got["params"], ref["params"]),
        ]
    )  # type: ignore[arg-type]
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    counts = torch.tensor(
        [
            stats.offloaded_bytes,
            stats.num_tensors,  # type: ignore[attr-defined]
            local_ref_stats.offloaded_bytes,
            local_ref_stats.num_tensors,
        ],
        dtype=torch.float64,
    )  # type: ignore[attr-defined]
    gathered = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(gathered, counts)
    return {
        "loss": float(diffs[0]),
        "grad": float(diffs[1]),
        "param": float(diffs[2]),
        "losses": got["losses"],
        "per_rank": [
            {"bytes": int(c[0]), "tensors": int(c[1]), "one_process_bytes": int(c[2]), "one_process_tensors": int(c[3])}
            for c in gathered
        ],
    }


# ----------------------------------------------------------------------------------------------------
# Model states per rank (what the planner's memory model must equal)


def _held_bytes(tensors: list[torch.Tensor | None]) -> dict[str, int]:
    """Bytes and number of the distinct live storages behind `tensors` (a DTensor: its local shard).
    Storages FSDP has freed (resized to 0 bytes) are not held."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return {"bytes": sum(seen.values()), "storages": len(seen)}


def _model_states(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """What this rank holds now: parameters (the optimizer's sharded ones and whatever FSDP has
    registered on the modules: unsharded copies between its all-gather and its reshard), gradients of
    both, AdamW moments and AdamW's per-parameter step counters."""
    sharded = [p for g in optimizer.param_groups for p in g["params"]]
    registered = list(module.parameters())
    states = list(optimizer.state.values())
    return {
        "params": _held_bytes(sharded + registered),
        "grads": _held_bytes([p.grad for p in sharded + registered]),
        "moments": _held_bytes([s[k] for s in states for k in ("exp_avg", "exp_avg_sq") if k in s]),
        "step_counters": _held_bytes([s["step"] for s in states if "step" in s]),
    }


class StateCapture(_OptimizerWrapper):
    """Optimizer wrapper that records `_model_states` right after each update (before zero_grad)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        super().__init__(optimizer, module)
        self.after_step: dict[str, dict[str, int]] = {}

    def step(self) -> None:
        super().step()
        self.after_step = _model_states(self.module, self.optimizer)


def model_states_drill(out_path: str, layouts: list[dict]) -> None:
    """Per layout {"name", "overrides"}: two real trainer steps of 2 micro-batches each (train_step with
    the layout's ParallelModel). Each rank records what it holds by storage: at the start of the second
    micro-batch's forward (between micro-batches), at the end of the last micro-batch's forward, and
    right after the optimizer update of the second step. Rank 0 writes {name: [rank 0, rank 1]}."""
    import json

    import torch.distributed as dist

    from tracetrain.parallel import dist as tdist

    torch.set_num_threads(1)
    info = tdist.init_distributed(120, "cpu")
    results: dict[str, list[dict]] = {}
    for layout in layouts:
        record = _record_model_states(layout["overrides"], info.world_size)
        gathered: list[object] = [None] * info.world_size
        dist.all_gather_object(gathered, record)
        results[layout["name"]] = gathered  # type: ignore[assignment]
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    tdist.shutdown()


def _record_model_states(overrides: list[str], world_size: int) -> dict[str, dict[str, dict[str, int]]]:
    """`model_states_drill` for one layout on this rank (collective: every rank calls it)."""
    built = assemble_tiny(tiny_config(overrides), world_size)
    assert built.optimizer is not None
    optimizer = StateCapture(built.optimizer, built.module)
    record: dict[str, dict[str, dict[str, int]]] = {}
    calls = [0]

    def before_forward(module: nn.Module, args: object) -> None:
        calls[0] += 1
        if calls[0] % 2 == 0:  # the second micro-batch of a step: the first one's backward is done
            record["between_micro_batches"] = _model_states(module, optimizer.optimizer)

    def after_forward(module: nn.Module, args: object, output: object) -> None:
        if calls[0] % 2 == 0:
            record["forward_end"] = _model_states(module, optimizer.optimizer)

    # Prepended: runs before FSDP's own pre-forward hook (which would gather the root's weights).
    built.module.register_forward_pre_hook(before_forward, prepend=True)
    built.module.register_forward_hook(after_forward)
    for seed in range(2):
        run_step(built, global_batches(built.spec.cfg, 4, 2, seed=seed), optimizer)
    record["after_step"] = optimizer.after_step
    return record


def rendezvous_and_count(out: str) -> None:
    """Join the job's gloo group through torchrun's environment, all-reduce a one, and (rank 0) write the sum."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    try:
        total = torch.ones(1)
        tdist.all_reduce(total)
        if tdist.get_rank() == 0:
            with open(out, "w") as f:
                f.write(str(int(total.item())))
    finally:
        tdist.destroy_process_group()


def cli_ranks(world_size: int, *args: str, timeout_s: float = 300.0) -> None:
    """`tracetrain ARGS` on `world_size` gloo ranks started by `launch_local`: each rank runs the CLI's `main`
    with the variables torchrun gives its workers, on one torch thread (torchrun's default for several
    workers). The ranks fork from a server that has torch and the trainer imported, seconds of start-up less
    per rank than torchrun's fresh interpreters: for tests of what the ranks compute. The launcher itself
    (fresh interpreters, its signals, exit statuses and output) is tested under real torchrun in
    test_parallel_trainer.py (the FSDP run and its resume), test_parallel_compose.py (FSDP with activation
    offload), test_parallel_failures.py, test_faults_parallel.py, test_oom_line.py and test_tune.py."""
    from tracetrain.parallel.launch import launch_local

    launch_local(_cli_rank, world_size, list(args), timeout_s=timeout_s)


def _cli_rank(args: list[str]) -> None:
    import os

    from tracetrain.cli import main

    torch.set_num_threads(1)
    code = main(args)
    if code != 0:
        raise RuntimeError(f"rank {os.environ['RANK']}: tracetrain {' '.join(args)} exited with status {code}")
