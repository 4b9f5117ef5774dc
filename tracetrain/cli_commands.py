"""The handlers of the `tracetrain` subcommands, one `cmd_<name>(args, overrides) -> exit status` each.

Thin: a handler checks its own flags, loads the config or the trained run, and calls one library
function. `cli.py` builds the parser, checks the flags several subcommands share and turns a
TracetrainError into one `error: ...` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracetrain.errors import DataError, TracetrainError

if TYPE_CHECKING:
    import torch


def cmd_train(a: argparse.Namespace, overrides: list[str]) -> int:
    """Exit 0 when the run finished; 128 + the first signal's number (130, 143, 129) when SIGINT/SIGTERM/
    SIGHUP stopped it after saving a checkpoint, so that a requeue wrapper can tell the two apart; 1 when an
    error stopped it after saving one (train/faults.py)."""
    from tracetrain.config import load_config
    from tracetrain.train.loop import train
    from tracetrain.train.resume import resolve_resume

    if a.resume:
        cfg, point = resolve_resume(a.resume, a.config, overrides)
        if point is not None and point.note and os.environ.get("RANK", "0") == "0":
            print(point.note)
    else:
        cfg, point = load_config(a.config, overrides), None
    # No run directory yet: train() claims one only after the data, model and device checks pass.
    result = train(cfg, resume=point, hold_signals=True)
    return 128 + result.signum if result.signum else 0


def cmd_eval(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.data import build_datasets, check_data_files
    from tracetrain.inference import load_trained
    from tracetrain.train.assemble import build_reference, step_context
    from tracetrain.train.evaluation import exact_match_eval, run_eval

    if a.output:
        check_output_path(a.output, "--output")  # before the model loads and the answers are generated
    loaded = load_trained(a.path, a.device, overrides)
    cfg = loaded.cfg
    try:
        check_data_files(cfg.data)
    except DataError as e:  # the path the run trained with, relative to where it was started
        raise DataError(
            f"{e}, as the run's {loaded.checkpoint / 'config.toml'} names it; to evaluate on a file found "
            "elsewhere, pass --data.path=FILE (and --data.eval_path=FILE if the run had one)"
        ) from None
    _print_decisions(loaded.spec.decision_lines(), str(loaded.device), file=sys.stderr)  # stdout: the JSON result
    _, eval_ds, _ = build_datasets(cfg.data, loaded.tokenizer)
    if a.output and not (cfg.train.eval_generate and getattr(eval_ds, "examples", [])):  # before the eval runs
        raise TracetrainError(
            "--output writes generated answers, but none are scored: this run has no held-out "
            "examples or train.eval_generate = 0 (set e.g. --train.eval_generate=200)"
        )
    # Scored exactly as the training run's evaluations were (full-fine-tuning DPO: against its initial model).
    reference = build_reference(loaded.spec) if loaded.spec.reference == "copy" else None
    ctx = step_context(loaded.spec, reference=reference)
    result = {"checkpoint": str(loaded.checkpoint), **run_eval(loaded.model, eval_ds, cfg, ctx)}
    result.update(
        exact_match_eval(
            loaded.model,
            loaded.tokenizer,
            getattr(eval_ds, "examples", []),
            cfg,
            ctx,
            None,
            samples_path=Path(a.output) if a.output else None,
        )
    )
    print(json.dumps(result, indent=2))
    return 0


def cmd_generate(a: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from tracetrain.data.files import check_data_file
    from tracetrain.data.prompts import prompt_record, read_prompts_jsonl
    from tracetrain.inference import load_trained
    from tracetrain.models.generate import bad_generation_option, generate_records
    from tracetrain.models.prefill import PREFILL_MODES

    if bool(a.prompt) == bool(a.prompts_file):
        given = "both were given" if a.prompt else "neither was given"
        raise TracetrainError(f"generate needs --prompt TEXT (repeatable) or --prompts-file FILE.jsonl ({given})")
    if a.gpu_window and not a.kv_offload:
        raise TracetrainError("--gpu-window needs --kv-offload")
    if a.chat and (a.prompts_file or a.raw):
        raise TracetrainError("--chat takes --prompt TEXT (one user message each), not --prompts-file or --raw")
    if a.system is not None and not a.chat:
        raise TracetrainError("--system goes with --chat")
    bad = bad_generation_option(
        max_new_tokens=a.max_new_tokens,
        batch_size=a.batch_size,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        gpu_window=a.gpu_window,
    )
    if bad is not None:
        raise TracetrainError(f"--{bad[0].replace('_', '-')} {bad[1]}: must be {bad[2]}")
    if a.prefill not in PREFILL_MODES:
        raise TracetrainError(f"--prefill {a.prefill}: must be one of {', '.join(PREFILL_MODES)}")
    if not 0 <= a.seed < 2**63:  # torch.Generator.manual_seed takes a 64-bit seed
        raise TracetrainError(f"--seed {a.seed}: must be from 0 to 2**63 - 1")
    if "" in a.stop:  # every continuation contains '', so every completion would come back empty
        raise TracetrainError("--stop '': a stop string must not be empty")
    output = Path(a.output) if a.output else None
    if output is not None and output.is_dir():  # checked before the model loads, not after generating
        raise TracetrainError(f"--output {output} is a folder; name a file such as {output / 'out.jsonl'}")
    if output is not None and not output.parent.is_dir():
        raise TracetrainError(f"--output {output}: folder {output.parent} does not exist")
    if a.prompts_file:  # before the model loads
        check_data_file(a.prompts_file, "--prompts-file")
    loaded = load_trained(a.path, a.device, overrides, generation=True)
    _print_decisions(loaded.spec.decision_lines(), str(loaded.device), file=sys.stderr)  # stdout: the completions
    data = loaded.cfg.data
    sampling: dict[str, Any] = {  # the same for chat and for plain prompts
        "max_new_tokens": a.max_new_tokens,
        "stop": a.stop,
        "temperature": a.temperature,
        "top_k": a.top_k,
        "top_p": a.top_p,
        "generator": torch.Generator(device=loaded.device).manual_seed(a.seed),
        "dtype": {"bf16": torch.bfloat16, "fp16": torch.float16}.get(loaded.precision),
        "kv_offload": a.kv_offload,
        "gpu_window": a.gpu_window,
        "prefill_mode": a.prefill,
    }
    if a.chat:  # the run's chat template around each --prompt (and --system), answered until end-of-turn
        from tracetrain.data.chat import chat_messages, chat_prompt_ids
        from tracetrain.models.chat import generate_chat

        ids = [chat_prompt_ids(data, loaded.tokenizer, chat_messages(p, a.system)) for p in a.prompt]
        lines, summary = generate_chat(loaded.model, loaded.tokenizer, a.prompt, ids, **sampling)
    else:
        records = (
            read_prompts_jsonl(a.prompts_file, data, a.raw)
            if a.prompts_file
            else [prompt_record({"prompt": p}, data, a.raw) for p in a.prompt]
        )
        lines, summary = generate_records(
            loaded.model,
            loaded.tokenizer,
            records,
            batch_size=a.batch_size,
            **sampling,
        )
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if output is not None:
        try:
            output.write_text(text)
        except OSError as e:
            raise TracetrainError(f"--output {output}: cannot write ({e.strerror})") from None
        if a.as_json:
            print(json.dumps({**summary, "output": a.output}))
        else:
            print(f"wrote {len(lines)} completion(s) to {a.output}")
    elif a.as_json:
        print(text, end="")
    else:  # the text itself; with several prompts, each under its prompt
        for i, line in enumerate(lines):
            if len(lines) > 1:
                print(("\n" if i else "") + f"### {line['prompt']}")
            print(line["completion"])
    return 0


def cmd_export(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.inference import find_checkpoint, load_trained
    from tracetrain.models.export import EXPORT_DTYPES, check_export_target, export_run_hf, export_run_peft, parse_size

    targets = [Path(p) for p in (a.peft, a.hf) if p]
    if not targets and not a.gguf:
        raise TracetrainError("export needs --hf OUT_DIR, --peft OUT_DIR and/or --gguf FILE")
    if a.gguf:
        from tracetrain.models.gguf_export import check_gguf_target

        check_gguf_target(Path(a.gguf), a.overwrite)  # the package and the file, before loading the model
    if len(targets) == 2 and targets[0].resolve() == targets[1].resolve():
        raise TracetrainError(f"--hf and --peft both name {a.hf}; give each its own folder")
    max_shard_bytes = parse_size(a.max_shard_size)
    for out in targets:  # refuse a bad target before loading a possibly large model
        check_export_target(out, a.overwrite)
    dtype = EXPORT_DTYPES.get(a.dtype)  # 'auto' -> None: the run's weights dtype
    ckpt = find_checkpoint(a.path)
    if a.hf and not a.peft and not a.gguf and (ckpt / "dcp" / ".metadata").is_file():
        return _export_sharded(ckpt, a, dtype, max_shard_bytes, overrides)
    loaded = load_trained(a.path, "cpu", overrides)
    if a.peft and loaded.cfg.train.mode != "lora":
        raise TracetrainError(f"{loaded.checkpoint} is a full fine-tune; --peft needs a LoRA run")
    from tracetrain.data.chat import resolve_chat_template

    # Written beside the weights: HF tokenizer files hold it, and a GGUF file names it for any tokenizer.
    tok = loaded.tokenizer
    template = resolve_chat_template(loaded.cfg.data, tok) if tok.has_hf_form or a.gguf else None
    notes: list[str] = []
    if a.peft:
        notes += export_run_peft(loaded, a.peft, a.overwrite, chat_template=template)
        print(f"PEFT adapter written to {a.peft}")
    if a.hf:
        from rich.console import Console

        from tracetrain.progress import live_progress

        with live_progress(Console(stderr=True)) as progress:  # a bar on a terminal, nothing in a pipe
            notes += export_run_hf(loaded, a.hf, dtype, a.overwrite, max_shard_bytes, progress, chat_template=template)
        print(f"Hugging Face model (adapters merged) written to {a.hf}")
    if a.gguf:
        from tracetrain.models.export import run_weights_dtype
        from tracetrain.models.gguf_export import export_run_gguf

        notes += export_run_gguf(
            loaded,
            a.gguf,
            EXPORT_DTYPES.get(a.dtype) or run_weights_dtype(loaded)[0],
            a.overwrite,
            chat_template=template,
        )
        print(f"GGUF file (llama architecture, adapters merged) written to {a.gguf}")
    for note in dict.fromkeys(notes):
        print(note)
    return 0


def _export_sharded(
    ckpt: Path, a: argparse.Namespace, dtype: torch.dtype | None, max_shard_bytes: int, overrides: list[str]
) -> int:
    """--hf of a checkpoint saved by several ranks: streamed tensor by tensor, never gathered in one place."""
    from rich.console import Console

    from tracetrain.progress import live_progress
    from tracetrain.train.sharded_export import export_sharded_run_hf

    with live_progress(Console(stderr=True)) as progress:
        notes = export_sharded_run_hf(ckpt, a.hf, dtype, a.overwrite, max_shard_bytes, progress, overrides)
    print(f"Hugging Face model (adapters merged) written to {a.hf}")
    for note in dict.fromkeys(notes):
        print(note)
    return 0


def cmd_data(a: argparse.Namespace, overrides: list[str]) -> int:
    """Build the configured data as `train` would; print its statistics and --show N examples."""
    from rich.console import Console

    from tracetrain.config import load_config
    from tracetrain.data.inspect import (
        DataReport,
        console_progress,
        examples_json,
        inspect_data,
        render_plain,
        render_terminal,
    )

    if a.show is not None and not 0 <= a.show <= SHOW_LIMIT:
        raise TracetrainError(f"--show {a.show}: must be >= 0 and <= {SHOW_LIMIT:,} (examples printed)")
    num_examples = a.show if a.show is not None else (3 if a.as_json else 0)
    cfg = load_config(a.config, overrides)
    err = Console(stderr=True)
    with console_progress(err) as progress:
        report = inspect_data(cfg, num_examples, progress)
    if a.stats_json:
        try:
            Path(a.stats_json).write_text(json.dumps(report.stats, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise TracetrainError(f"--stats-json {a.stats_json}: cannot write it ({e.strerror})") from None
    if a.as_json:  # stdout: the examples only (a JSON list); the statistics go to stderr
        print(json.dumps(examples_json(report), indent=2, ensure_ascii=False))
        sys.stderr.write(render_plain(DataReport(report.stats, [])))
    elif Console().is_terminal:
        render_terminal(report, Console())
    else:
        sys.stdout.write(render_plain(report))
    return 0


SHOW_LIMIT = 1_000_000  # more examples than anyone reads; a larger count is a typo


def cmd_profile(a: argparse.Namespace, overrides: list[str]) -> int:
    """Train with profiling on; unless --full-run, stop a few steps after the profiled window (timed
    unprofiled, for the real step time)."""
    from tracetrain.config import load_config
    from tracetrain.train.loop import train

    cfg = load_config(a.config, ["--profile.enabled=true", *overrides])
    if not a.full_run:
        from tracetrain.profile.step_timer import NUM_EACH_SIDE

        # A few unprofiled steps after the window give the real step time next to the profiled one.
        steps = min(cfg.train.steps, cfg.profile.start_step + cfg.profile.num_steps - 1 + NUM_EACH_SIDE)
        # The window decides the length, not the data (epochs 0). The learning rate does not change what a
        # step costs: a warmup set longer than the window is cut to it (an unset one adapts by itself).
        window: dict[str, Any] = {
            "train.steps": steps,
            "train.epochs": 0,
            "checkpoint.save_final": False,
            "train.eval_generate": 0,
        }
        if cfg.optim.warmup_steps is not None:
            window["optim.warmup_steps"] = min(cfg.optim.warmup_steps, steps - 1)
        cfg = cfg.replace(window)
    result = train(cfg, hold_signals=True)
    for key in ("trace", "report_html", "report_json"):
        if key in result.summary:
            print(f"{key.replace('_', ' ')}: {result.summary[key]}")
    return 128 + result.signum if result.signum else 0


def cmd_analyze(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.profile.analyze import analyze, compare, render_html, render_json, render_terminal

    if overrides:
        raise TracetrainError(f"analyze takes no config overrides (got {' '.join(overrides)})")
    result: Any = analyze(a.paths, device_name=a.device_name)  # a Report, or a CompareReport below
    if a.compare:
        result = compare(result, analyze(a.compare, device_name=a.device_name))
    _show(result, a, render_terminal, render_html, render_json)
    return 0


def _show(result: object, a: argparse.Namespace, terminal: Callable, html: Callable, as_json: Callable) -> None:
    """Render a report to the console (wide when not a terminal) and to --html / --json files."""
    from rich.console import Console

    console = Console()
    terminal(result, console if console.is_terminal else Console(width=160))
    if a.html:
        _write_output(a.html, "--html", html(result))
        print(f"HTML report: {a.html}")
    if a.json:
        _write_output(a.json, "--json", json.dumps(as_json(result), indent=2))
        print(f"JSON report: {a.json}")


def _print_decisions(lines: list[str], where: str, file: Any = None) -> None:
    """The spec's choices (tracetrain/spec.py), as train prints them (`Reporter.decisions`)."""
    print(f"decided ({where}):" + "".join(f"\n  {line}" for line in lines or ["nothing"]), file=file)


def check_output_path(path: str, flag: str) -> None:
    """Refuse an output file that cannot be created, before the work whose result it would hold."""
    p = Path(path)
    if p.is_dir():
        raise TracetrainError(f"{flag} {path}: is a directory; give the path of a file to write")
    if not p.parent.exists():
        raise TracetrainError(f"{flag} {path}: folder {p.parent} does not exist; create it first")
    if not p.parent.is_dir():
        raise TracetrainError(f"{flag} {path}: {p.parent} is not a folder")
    if not os.access(p.parent, os.W_OK):
        raise TracetrainError(f"{flag} {path}: folder {p.parent} is not writable")


def _write_output(path: str, flag: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:  # e.g. a read-only file system, or the disk filled up since the check
        raise TracetrainError(f"{flag} {path}: cannot write it ({e.strerror})") from None


def cmd_plan(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.config import load_config
    from tracetrain.models.build import model_args_from_config
    from tracetrain.plan import (
        plan,
        plan_input_from_spec,
        plan_spec,
        plan_to_config_overrides,
        render_html,
        render_json,
        render_terminal,
        search,
    )
    from tracetrain.validate import validate_run

    for flag, value, least in (
        ("--gpus", a.gpus, 1),
        ("--top", a.top, 1),
        ("--gpus-per-node", a.gpus_per_node, 1),
        ("--gpu-memory-gib", a.gpu_memory_gib, 0),
        ("--host-memory-gib", a.host_memory_gib, 0),
    ):
        if value is not None and (value < least if least else not 0 < value < math.inf):
            raise TracetrainError(f"{flag} {value}: must be {f'at least {least}' if least else 'above 0 and finite'}")
    cfg = load_config(a.config, overrides)
    validate_run(cfg, model_args_from_config(cfg))  # plan only runs that train would accept
    spec = plan_spec(cfg, a.gpus)
    inp = plan_input_from_spec(spec, a.gpu, a.gpus)  # PlanInputError: one line, as the others
    _print_decisions(spec.decision_lines(), "on a CUDA GPU")
    changes = {
        k: v
        for k, v in (
            ("gpu_memory_gib", a.gpu_memory_gib),
            ("host_memory_gib", a.host_memory_gib),
            ("gpus_per_node", a.gpus_per_node),
        )
        if v is not None
    }
    inp = inp.replace(**changes) if changes else inp
    if a.explain:
        fields = [f.name for f in dataclasses.fields(inp) if f.name != "model"]  # the model: its preset/shape
        print("planned as: " + ", ".join(f"{name}={getattr(inp, name)}" for name in fields))
    result = search(inp, a.gpus, a.top) if a.search else plan(inp)
    if a.search and not result:
        raise TracetrainError(f"no layout of {a.gpus} GPU(s) fits; try more GPUs, recomputation or offload")
    _show(result, a, render_terminal, render_html, render_json)
    if a.search:
        assert isinstance(result, list)  # search() returns the ranked plans
        print("overrides for the top row: " + " ".join(plan_to_config_overrides(result[0])))
    elif not result.fits:  # type: ignore[union-attr]  # plan() returns one Plan
        from tracetrain.plan.longest import fitting_remedy, remedy_text

        remedy = fitting_remedy(
            cfg, cfg.data.seq_len, inp.gpu, a.gpus, host_memory_gib=a.host_memory_gib, hardware=changes
        )
        if remedy is not None:  # the long-context switches under which this length fits, the fastest planned
            print(remedy_text(*remedy))
    if a.longest_context:
        from tracetrain.plan.longest import longest_context_report

        print(f"longest context on {a.gpus} x {inp.gpu} (micro-batch {cfg.train.micro_batch_size}):")
        for line in longest_context_report(cfg, inp.gpu, a.gpus, hardware=changes):
            print("  " + line)
    return 0


def cmd_presets(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.models.accounting import num_params
    from tracetrain.models.presets import PRESETS

    for name, args in PRESETS.items():
        experts = f" experts {args.num_experts} (top {args.experts_top_k}, ffn {args.expert_ffn_dim})"
        count = num_params(args)  # exact, as sum(p.numel()) of the built model; billions for a glance
        print(
            f"{name:<14} {count / 1e9:>7.3f}B {count:>14,}  dim {args.dim:<5} layers {args.n_layers:<3} "
            f"heads {args.n_heads}/{args.n_kv_heads} ffn {args.ffn_dim} vocab {args.vocab_size}"
            + (f" head_dim {args.head_dim}" if args.head_dim_override else "")
            + (experts if args.num_experts else "")
        )
    return 0


def cmd_report(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.train.run_report import write_report

    if a.out:  # before the runs are read and the page drawn
        check_output_path(a.out, "--out")
    out = write_report([Path(r) for r in a.runs], Path(a.out) if a.out else None)
    print(f"wrote {out}")
    return 0


def cmd_config(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.config import load_config, reference_markdown, to_toml

    print(reference_markdown() if a.reference else to_toml(load_config(a.config, overrides)))
    return 0


def cmd_tune(a: argparse.Namespace, overrides: list[str]) -> int:
    """Exit 0 when the search ended (finished or out of budget); 130 when Ctrl-C stopped it (both files
    are written either way, from the trials that finished)."""
    from tracetrain.tune.api import tune

    allow = [w.strip() for w in (a.allow or "").split(",") if w.strip()]
    result = tune(
        a.config,
        overrides=overrides,
        budget_min=a.budget_min,
        max_memory_gib=a.max_memory,
        allow=allow,
        out_dir=a.out,
        measured_steps=a.steps,
        warmup_steps=a.warmup_steps,
        gpus=a.gpus,
        tries=a.try_changes or [],
        max_trials=a.max_trials,
    )
    return 130 if result.interrupted else 0
