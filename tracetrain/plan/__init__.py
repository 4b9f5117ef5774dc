"""The planner: will a run fit, how fast will it go, which layout to use, before any GPU hour is spent.

Pure functions over the same config the trainer reads (STYLE.md rule 5: counts come from
`models/accounting.py` and `devices.py`):

    from tracetrain.plan import PlanInput, plan, search, render_terminal, render_json, render_html
    p = plan(PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200"))
    p.memory.breakdown      # bytes per item at the peak phase; p.fits, p.advice
    p.time.breakdown        # seconds per kind; p.tokens_per_s, p.mfu
    rows = search(base, gpus=8, top=10)   # fitting layouts ranked by tokens/s, each with a reason
    rows = search_layouts(base, gpus=8)   # the best row of each distinct layout

Modules, in the order data flows: inputs (PlanInput, GPU and link tables), activations (saved tensors
per token, derived from models/llama.py), params (what each GPU holds), memory (phases and peak),
traffic (memory-bound bytes), comm + time (step time), core (Plan, advice), search (layouts),
report / html (rendering), mapping (a run's resolved spec -> PlanInput, and a planned row -> config
overrides: one table both ways).
"""

from tracetrain.plan.core import Plan, advice, max_micro_batch, plan
from tracetrain.plan.html import render_html
from tracetrain.plan.inference import GenerationPlan, PrefillPlan, plan_generation, plan_prefill
from tracetrain.plan.inputs import GPU_NAMES, LINKS, Links, PlanInput
from tracetrain.plan.mapping import plan_input_from_config, plan_input_from_spec, plan_spec, plan_to_config_overrides
from tracetrain.plan.report import render_json, render_terminal
from tracetrain.plan.search import search, search_layouts

__all__ = [
    "GPU_NAMES",
    "LINKS",
    "GenerationPlan",
    "Links",
    "Plan",
    "PlanInput",
    "PrefillPlan",
    "advice",
    "max_micro_batch",
    "plan",
    "plan_generation",
    "plan_input_from_config",
    "plan_input_from_spec",
    "plan_prefill",
    "plan_spec",
    "plan_to_config_overrides",
    "render_html",
    "render_json",
    "render_terminal",
    "search",
    "search_layouts",
]
