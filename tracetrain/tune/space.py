"""The search space of `tracetrain tune`: candidate config changes, each with its reason and predicted gain.

Candidates come from three places, in the order they are tried (largest predicted gain first within each):
1. the profile's advice (profile/analyze/advice.py): each rule that fired on the baseline's trace, turned
   into the config change its action names (`ADVICE_CHANGES`), predicted to give back the share of the
   step the rule measured;
2. the planner's what-ifs (plan/): one knob of the resolved spec changed at a time (`knob_changes`),
   planned next to the baseline; the planner's tokens/s ratio is the prediction, and its memory model
   prunes what cannot fit (the GPU's memory, or --max-memory);
3. with several GPUs, the planner's top layouts (`layout_changes`): the best row of each of the
   fastest distinct layouts, tried before the what-ifs.

Knobs that change numerics (FP8, fp16) are offered only when the user allows them (`--allow`); every
candidate still faces the numerics guard (tune/session.py) after it is measured.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracetrain.config import Config
from tracetrain.errors import TracetrainError
from tracetrain.plan import Plan, plan, plan_input_from_config, plan_to_config_overrides, search, search_layouts
from tracetrain.plan.mapping import FIELDS, LAYOUT_FIELDS, plan_spec
from tracetrain.plan.memory import GIB

# Config keys the planner reads (plan/mapping.py's one table, the batch and the layout): a what-if on
# any other key (data workers, the learning rate) predicts nothing (None, not 0%).
PLANNED = frozenset(
    {f.key for f in FIELDS}
    | {"train.micro_batch_size", "train.grad_accum_steps", "parallel.pp_microbatches"}
    | {f"parallel.{name}" for name in LAYOUT_FIELDS}
)
# What may be passed to --allow: numerics-changing kinds of candidate.
ALLOW_CHOICES = ("fp8", "fp16", "numerics")


@dataclass(frozen=True)
class Candidate:
    """One change to measure: config keys and values, why, and what the planner or the profile predicted.

    `predicted_gain`: tokens/s ratio minus 1 (+0.10 = 10% faster); None when nothing predicts it.
    `predicted_tokens_per_s`: per GPU, as the trials measure it (the planner's figure is for all GPUs).
    `numerics`: the --allow word under which a numerics change is accepted ('' = none expected).
    """

    label: str
    changes: tuple[tuple[str, Any], ...]
    reason: str
    source: str  # "advice:<rule>", "planner", "layout", "--try", "combination", "start"
    predicted_gain: float | None = None
    predicted_tokens_per_s: float | None = None
    predicted_peak_gib: float | None = None
    fits: bool | None = None  # the planner's verdict (None: not planned)
    numerics: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def change_dict(self) -> dict[str, Any]:
        return dict(self.changes)

    def overrides(self) -> list[str]:
        return [override(k, v) for k, v in self.changes]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "changes": dict(self.changes),
            "reason": self.reason,
            "source": self.source,
            "predicted_gain": self.predicted_gain,
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "predicted_peak_gib": self.predicted_peak_gib,
            "fits": self.fits,
            "numerics": self.numerics,
        }


def override(key: str, value: Any) -> str:
    """`--section.key=value`, the value as a TOML literal the config loader reads back."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, (list, tuple)):
        text = json.dumps(list(value), separators=(",", ":"))
    else:
        text = repr(value)
    return f"--{key}={text}"


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def knob_changes(cfg: Config, cuda: bool, allow: Sequence[str]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, changes, reason) for each single-knob what-if of `cfg`'s resolved switches. GPU-only
    switches (compile, LoRA's pointwise recompute in compiled blocks, Triton kernels, FlexAttention, offload to
    the host, FP8) are offered on CUDA only:
    on the CPU they are either off by rule (spec.py) or mean nothing (offloading the CPU to itself)."""
    t, m, d = cfg.train, cfg.memory, cfg.data
    out: list[tuple[str, dict[str, Any], str]] = []
    batch = t.micro_batch_size * t.grad_accum_steps
    for mb in _divisors(batch):
        if mb != t.micro_batch_size and mb * 8 >= t.micro_batch_size:  # not far below the current size
            changes = {"train.micro_batch_size": mb, "train.grad_accum_steps": batch // mb}
            out.append((f"micro-batch {mb} x {batch // mb}", changes, f"same global batch {batch} in other pieces"))
    for policy, every in (("none", 1), ("selective", 1), ("full", 1), ("full", 2)):
        if (policy, every) != (m.recompute, m.recompute_every if m.recompute != "none" else 1):
            label = f"recompute {policy}" + (f" every {every}" if every > 1 else "")
            out.append((label, {"memory.recompute": policy, "memory.recompute_every": every}, "activation memory"))
    if cuda:
        out += _gpu_knobs(cfg, allow)
    if t.fused_ce:
        out.append(("fused cross-entropy off", {"train.fused_ce": False}, "full logits instead of chunks"))
        for chunk in (t.fused_ce_chunk // 2, t.fused_ce_chunk * 2):
            out.append((f"fused cross-entropy chunk {chunk}", {"train.fused_ce_chunk": chunk}, "loss chunk size"))
    else:
        out.append(("fused cross-entropy on", {"train.fused_ce": True}, "no full-vocabulary fp32 logits"))
    for workers in (1, 2, 4):
        if workers != d.num_workers and (d.tokenize == "on_the_fly" or workers <= 2):
            out.append((f"data workers {workers}", {"data.num_workers": workers}, "data loading off the main process"))
    return out


def _gpu_knobs(cfg: Config, allow: Sequence[str]) -> list[tuple[str, dict[str, Any], str]]:
    t, m = cfg.train, cfg.memory
    out: list[tuple[str, dict[str, Any], str]] = []
    compile_on = t.compile != "off"
    out.append((f"compile {'off' if compile_on else 'on'}", {"train.compile": "off" if compile_on else "on"}, "fusion"))
    spec = plan_spec(cfg) if t.mode == "lora" else None
    if spec is not None and spec.compile:  # acts on compiled blocks only (spec.py refuses 'on' without)
        on = not spec.recompute_pointwise
        label = f"recompute pointwise {'on' if on else 'off'}"
        why = "adapter inputs recomputed in backward" if on else "adapter inputs saved"
        out.append((label, {"memory.recompute_pointwise": "on" if on else "off"}, why))
    if t.fused_kernels != "on":
        out.append(("Triton kernels on", {"train.fused_kernels": "on"}, "fused RMSNorm/RoPE/SwiGLU"))
    for backend in ("sdpa", "flex"):
        if t.attention != backend:
            out.append((f"attention {backend}", {"train.attention": backend}, "attention kernel"))
    if m.activation_offload == "none":
        for fraction in (1.0, 0.5):
            changes = {"memory.activation_offload": "streamed", "memory.activation_offload_fraction": fraction}
            out.append((f"activation offload {fraction:g}", changes, "activations in host memory"))
    else:
        out.append(("activation offload off", {"memory.activation_offload": "none"}, "no host copies"))
    if cfg.parallel.dp_shard * cfg.parallel.dp_replicate * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 1:
        out.append(
            (
                f"optimizer offload {'off' if m.optimizer_offload else 'on'}",
                {"memory.optimizer_offload": not m.optimizer_offload},
                "AdamW states in host memory" if not m.optimizer_offload else "AdamW on the GPU",
            )
        )
    if not cfg.data.pin_memory:
        out.append(("pinned memory", {"data.pin_memory": True}, "asynchronous host-to-GPU copies"))
    if "fp8" in allow and t.fp8 == "none":
        for recipe in ("rowwise", "tensorwise"):
            out.append((f"FP8 {recipe}", {"train.fp8": recipe, "train.precision": "bf16"}, "FP8 GEMMs"))
    if "fp16" in allow and t.precision != "fp16":
        out.append(("fp16", {"train.precision": "fp16"}, "fp16 autocast with loss scaling"))
    return out


# Advice rule -> the change its action names, for a run of tracetrain's trainer (advice.py's actions).
def advice_changes(rule: str, cfg: Config, cuda: bool) -> list[tuple[str, dict[str, Any]]]:
    """The candidate changes that act on one advice rule (empty: no config key acts on it)."""
    t, d, m = cfg.train, cfg.data, cfg.memory
    batch = t.micro_batch_size * t.grad_accum_steps
    bigger = [mb for mb in _divisors(batch) if mb > t.micro_batch_size][:2]
    table: dict[str, list[tuple[str, dict[str, Any]]]] = {
        "data_loader": [(f"data workers {w}", {"data.num_workers": w}) for w in (2, 4) if w > d.num_workers],
        "pageable_copies": [("pinned memory", {"data.pin_memory": True})] if not d.pin_memory else [],
        "cpu_optimizer": [("optimizer offload off", {"memory.optimizer_offload": False})]
        if m.optimizer_offload
        else [],
        "launch_bound": ([("compile on", {"train.compile": "on"})] if cuda and t.compile != "on" else [])
        + [(f"micro-batch {mb} x {batch // mb}", _batch(mb, batch)) for mb in bigger],
        "host_bound": ([("compile on", {"train.compile": "on"})] if cuda and t.compile != "on" else [])
        + [(f"micro-batch {mb} x {batch // mb}", _batch(mb, batch)) for mb in bigger],
        "small_gemm": [(f"micro-batch {mb} x {batch // mb}", _batch(mb, batch)) for mb in bigger],
        "memory_headroom": [(f"micro-batch {mb} x {batch // mb}", _batch(mb, batch)) for mb in bigger]
        + (
            [("recompute none", {"memory.recompute": "none", "memory.recompute_every": 1})]
            if m.recompute != "none"
            else []
        ),
        "fp32_gemm": [("bf16", {"train.precision": "bf16"})] if t.precision != "bf16" and cuda else [],
        "recompilation": [("compile off", {"train.compile": "off"})] if t.compile != "off" else [],
    }
    return table.get(rule, [])


def _batch(mb: int, batch: int) -> dict[str, Any]:
    return {"train.micro_batch_size": mb, "train.grad_accum_steps": batch // mb}


@dataclass(frozen=True)
class Planner:
    """The planner's view of the baseline: its plan, the GPU it plans for and the memory cap."""

    cfg: Config
    gpu: str
    gpus: int
    cap_gib: float | None  # --max-memory (None: the GPU's own memory)
    base: Plan | None

    @classmethod
    def of(cls, cfg: Config, gpu: str, gpus: int, cap_gib: float | None) -> Planner:
        return cls(cfg, gpu, gpus, cap_gib, _plan(cfg, gpu, gpus, cap_gib))

    def predict(self, changes: dict[str, Any]) -> tuple[Config | None, Plan | None]:
        """The changed config (None: the config refuses the change) and its plan (None: not plannable)."""
        try:
            changed = self.cfg.replace(changes)
        except TracetrainError:
            return None, None
        return changed, _plan(changed, self.gpu, self.gpus, self.cap_gib)


def _plan(cfg: Config, gpu: str, gpus: int, cap_gib: float | None) -> Plan | None:
    try:
        inp = plan_input_from_config(cfg, num_gpus=gpus, gpu=gpu)
        if cap_gib is not None:
            inp = inp.replace(gpu_memory_gib=cap_gib)
        return plan(inp)
    except (TracetrainError, ValueError):
        return None  # a combination the planner does not model (it says why elsewhere)


def make_candidate(
    planner: Planner, label: str, changes: dict[str, Any], reason: str, source: str, gain: float | None = None
) -> Candidate | None:
    """A candidate with the planner's prediction; None when the config refuses the change or it changes
    nothing. `gain`: a prediction from elsewhere (the profile's advice) that wins over the planner's."""
    changes = {k: v for k, v in changes.items() if _get(planner.cfg, k) != v}
    if not changes:
        return None
    changed, p = planner.predict(changes)
    if changed is None:
        return None
    base = planner.base
    planned = set(changes) & PLANNED
    if p is not None and base is not None and p.input == base.input and planned == set(changes):
        return None  # what `auto` resolves to already (attention flex for packed rows): the same run
    planned_gain = None
    if p is not None and base is not None and planned:
        planned_gain = p.tokens_per_s / base.tokens_per_s - 1
    numerics = (
        "fp8"
        if changes.get("train.fp8", "none") != "none"
        else "fp16"
        if changes.get("train.precision") == "fp16"
        else ""
    )
    return Candidate(
        label=label,
        changes=tuple(sorted(changes.items())),
        reason=reason,
        source=source,
        predicted_gain=gain if gain is not None else planned_gain,
        predicted_tokens_per_s=per_gpu_tokens_per_s(p) if p is not None else None,
        predicted_peak_gib=p.memory.peak_bytes / GIB if p is not None else None,
        fits=p.fits if p is not None else None,
        numerics=numerics,
    )


def per_gpu_tokens_per_s(p: Plan) -> float:
    """The planner's tokens/s (all GPUs of the plan) per GPU: what a trial's metrics.jsonl records."""
    return p.tokens_per_s / p.input.num_gpus


def advice_gain(share: float | None) -> float | None:
    """An advice's share of the step given back, as a tokens/s gain: 1 / (1 - share) - 1."""
    if share is None or share <= 0:
        return None
    return 1 / (1 - min(share, 0.95)) - 1


def build_candidates(
    planner: Planner,
    advice: Iterable[dict[str, Any]],
    cuda: bool,
    allow: Sequence[str],
    tries: Sequence[dict[str, Any]] = (),
) -> list[Candidate]:
    """Every candidate, deduplicated by its changes, in the order to try them: the user's --try first,
    then advice (largest predicted gain first), then, with several GPUs, the planner's top layouts, then
    its what-ifs (each group largest predicted gain first; unpredicted ones last)."""
    found: list[Candidate] = []
    for changes in tries:
        label = ", ".join(f"{k}={v}" for k, v in changes.items())
        if (c := make_candidate(planner, label, changes, "asked with --try", "--try")) is not None:
            found.append(c)
    from_advice = []
    for item in advice:
        gain = advice_gain(item.get("gain"))
        for label, changes in advice_changes(str(item.get("rule")), planner.cfg, cuda):
            reason = f"profile advice: {item.get('title', item.get('rule'))}"
            c = make_candidate(planner, label, changes, reason, f"advice:{item.get('rule')}", gain)
            if c is not None:
                from_advice.append(c)
    found += sorted(from_advice, key=_order)
    # With several GPUs the top layouts come before the what-ifs: the layout is the largest decision,
    # and the what-ifs are planned (and measured) on the baseline's layout, which a layout may replace.
    if planner.gpus > 1:
        found += sorted(layout_changes(planner, cuda), key=_order)
    planned = [
        make_candidate(planner, label, ch, f"planner what-if: {why}", "planner")
        for label, ch, why in knob_changes(planner.cfg, cuda, allow)
    ]
    found += sorted((c for c in planned if c is not None), key=_order)
    unique: dict[tuple, Candidate] = {}
    for c in found:
        unique.setdefault(c.changes, c)
    return list(unique.values())


def _order(c: Candidate) -> tuple[bool, float]:
    return (c.predicted_gain is None, -(c.predicted_gain or 0.0))


def row_changes(planner: Planner, row: Plan) -> dict[str, Any]:
    """The config changes that turn the baseline into `row` (empty: the row is the baseline's settings)."""
    assert planner.base is not None
    base_overrides = dict(_pairs(plan_to_config_overrides(planner.base)))
    changes = {k: v for k, v in _pairs(plan_to_config_overrides(row)) if base_overrides.get(k) != v}
    typed = _typed(planner.cfg, changes)
    return {k: v for k, v in typed.items() if _get(planner.cfg, k) != v}


# Switches of a layout's row that move data to the host: GPU-only, as in `_gpu_knobs`.
_HOST_OFFLOAD = {"memory.activation_offload", "memory.optimizer_offload", "parallel.fsdp_cpu_offload"}


def layout_changes(planner: Planner, cuda: bool = True, top: int = 3) -> list[Candidate]:
    """The planner's top `top` layouts for `planner.gpus` GPUs other than the baseline's own (each the
    best row of its layout), as changes of the baseline's config. On the CPU, rows that offload to the
    host are passed over (the CPU offloading to itself measures nothing)."""
    if planner.base is None:
        return []
    out = []
    for row in search_layouts(planner.base.input, planner.gpus):
        if row.layout() == planner.base.layout():
            continue  # the baseline's layout: its memory settings are the what-ifs' business
        changes = row_changes(planner, row)
        if not cuda and any(k in _HOST_OFFLOAD and v not in (False, "none") for k, v in changes.items()):
            continue
        c = make_candidate(planner, f"layout {row.layout()}", changes, row.reason, "layout")
        if c is not None:
            out.append(c)
        if len(out) == top:
            break
    return out


def _pairs(lines: list[str]) -> list[tuple[str, str]]:
    return [tuple(line[2:].split("=", 1)) for line in lines if line.startswith("--")]  # type: ignore[misc]  # override lines are --key=value, so split('=', 1) gives the two parts


def _typed(cfg: Config, changes: dict[str, str]) -> dict[str, Any]:
    """Override texts (`--train.compile=on`) as config values, read as the command line reads them."""
    from tracetrain.config import parse_override

    return dict(parse_override(f"--{k}={v}") for k, v in changes.items() if _has(cfg, k))


def _has(cfg: Config, key: str) -> bool:
    section, name = key.split(".", 1)
    return hasattr(getattr(cfg, section, None), name)


def fitting_start(planner: Planner, top: int = 3, below_gib: float | None = None) -> list[Candidate]:
    """When the baseline does not fit (planner), the planner's best fitting rows on the same GPUs, as
    changes: the starting points to measure instead. `below_gib`: the baseline fitted on paper but ran
    out of memory; rows planned under this peak instead."""
    if planner.base is None or (planner.base.fits and below_gib is None):
        return []
    rows = search(planner.base.input, planner.gpus, top + 5 if below_gib else top)
    rows = [r for r in rows if below_gib is None or r.peak_gib < below_gib][:top]
    base_overrides = dict(_pairs(plan_to_config_overrides(planner.base)))
    why = "does not fit" if below_gib is None else "ran out of memory"
    out = []
    for row in rows:
        changes = {k: v for k, v in _pairs(plan_to_config_overrides(row)) if base_overrides.get(k) != v}
        reason = f"the baseline {why} ({planner.base.peak_gib:.0f} GiB planned): planner's pick, {row.reason}"
        c = make_candidate(
            planner,
            "fit: " + ", ".join(f"{k}={v}" for k, v in changes.items()),
            _typed(planner.cfg, changes),
            reason,
            "start",
        )
        if c is not None:
            out.append(c)
    return out
