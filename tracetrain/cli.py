"""The `tracetrain` command. Thin: each subcommand parses, validates and calls one library function.

User mistakes (TracetrainError) print one line `error: ...` and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracetrain import __version__
from tracetrain.errors import TracetrainError

EPILOG_OVERRIDES = (
    "Any config key can be overridden as --section.key=value, e.g. --optim.lr=3e-4 "
    "--data.path=my.jsonl --train.steps=200. `tracetrain config --reference` lists every key."
)


def cmd_train(a: argparse.Namespace, overrides: list[str]) -> int:
    """Exit 0 when the run finished; 128 + the signal's number (130, 143) when SIGINT/SIGTERM stopped it
    after saving a checkpoint, so that a requeue wrapper can tell the two apart."""
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
    result = train(cfg, resume=point)
    return 128 + result.signum if result.signum else 0


def cmd_eval(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.data import build_datasets
    from tracetrain.inference import load_trained
    from tracetrain.train.assemble import step_context
    from tracetrain.train.evaluation import exact_match_eval, run_eval

    if a.output:
        _check_output_path(a.output, "--output")  # before the model loads and the answers are generated
    loaded = load_trained(a.path, a.device, overrides)
    cfg = loaded.cfg
    _, eval_ds, _ = build_datasets(cfg.data, loaded.tokenizer)
    ctx = step_context(loaded.spec)  # scored exactly as the training run's evaluations were
    result = {"checkpoint": str(loaded.checkpoint), **run_eval(loaded.model, eval_ds, cfg, ctx)}
    if a.output and not (cfg.train.eval_generate and getattr(eval_ds, "examples", [])):
        raise TracetrainError(
            "--output writes generated answers, but none are scored: this run has no held-out "
            "examples or train.eval_generate = 0 (set e.g. --train.eval_generate=200)"
        )
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

    from tracetrain.inference import load_trained
    from tracetrain.models.generate import bad_generation_option, generate_records, prompt_record, read_prompts_jsonl

    if bool(a.prompt) == bool(a.prompts_file):
        raise TracetrainError("generate needs --prompt TEXT (repeatable) or --prompts-file FILE.jsonl, not both")
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
    output = Path(a.output) if a.output else None
    if output is not None and output.is_dir():  # checked before the model loads, not after generating
        raise TracetrainError(f"--output {output} is a folder; name a file such as {output / 'out.jsonl'}")
    if output is not None and not output.parent.is_dir():
        raise TracetrainError(f"--output {output}: folder {output.parent} does not exist")
    loaded = load_trained(a.path, a.device, overrides)
    data = loaded.cfg.data
    if a.chat:  # the run's chat template around each --prompt (and --system), answered until end-of-turn
        from tracetrain.models.chat import generate_chat

        lines, summary = generate_chat(
            loaded.model,
            loaded.tokenizer,
            loaded.cfg,
            a.prompt,
            a.system,
            max_new_tokens=a.max_new_tokens,
            stop=a.stop,
            temperature=a.temperature,
            top_k=a.top_k,
            top_p=a.top_p,
            generator=torch.Generator(device=loaded.device).manual_seed(a.seed),
            dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(loaded.precision),
            kv_offload=a.kv_offload,
            gpu_window=a.gpu_window,
        )
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
            max_new_tokens=a.max_new_tokens,
            stop=a.stop,
            batch_size=a.batch_size,
            temperature=a.temperature,
            top_k=a.top_k,
            top_p=a.top_p,
            generator=torch.Generator(device=loaded.device).manual_seed(a.seed),
            dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(loaded.precision),
            kv_offload=a.kv_offload,
            gpu_window=a.gpu_window,
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
    from tracetrain.inference import load_trained
    from tracetrain.models.export import EXPORT_DTYPES, check_export_target, export_run_hf, export_run_peft, parse_size

    targets = [Path(p) for p in (a.peft, a.hf) if p]
    if not targets:
        raise TracetrainError("export needs --hf OUT_DIR and/or --peft OUT_DIR")
    if len(targets) == 2 and targets[0].resolve() == targets[1].resolve():
        raise TracetrainError(f"--hf and --peft both name {a.hf}; give each its own folder")
    max_shard_bytes = parse_size(a.max_shard_size)
    for out in targets:  # refuse a bad target before loading a possibly large model
        check_export_target(out, a.overwrite)
    loaded = load_trained(a.path, "cpu", overrides)
    if a.peft and loaded.cfg.train.mode != "lora":
        raise TracetrainError(f"{loaded.checkpoint} is a full fine-tune; --peft needs a LoRA run")
    notes: list[str] = []
    if a.peft:
        notes += export_run_peft(loaded, a.peft, a.overwrite)
        print(f"PEFT adapter written to {a.peft}")
    if a.hf:
        dtype = EXPORT_DTYPES[a.dtype] if a.dtype else None
        from rich.console import Console

        from tracetrain.progress import live_progress

        with live_progress(Console(stderr=True)) as progress:  # a bar on a terminal, nothing in a pipe
            notes += export_run_hf(loaded, a.hf, dtype, a.overwrite, max_shard_bytes, progress)
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

    if a.show is not None and a.show < 0:
        raise TracetrainError(f"--show {a.show}: must be >= 0")
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


def cmd_profile(a: argparse.Namespace, overrides: list[str]) -> int:
    """Train with profiling on; unless --full-run, stop right after the profiled window."""
    from tracetrain.config import load_config
    from tracetrain.train.loop import train

    cfg = load_config(a.config, ["--profile.enabled=true", *overrides])
    if not a.full_run:
        steps = min(cfg.train.steps, cfg.profile.start_step + cfg.profile.num_steps - 1)
        # The window decides the length, not the data (epochs 0). The learning rate does not change what a
        # step costs: a warmup longer than the window is cut to it.
        cfg = cfg.replace(
            {
                "train.steps": steps,
                "train.epochs": 0,
                "optim.warmup_steps": min(cfg.optim.warmup_steps, steps - 1),
                "checkpoint.save_final": False,
                "train.eval_generate": 0,
            }
        )
    result = train(cfg)
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


# Report files of analyze and plan; main checks each before the command does its work.
_OUTPUT_FLAGS = {"html": "--html", "json": "--json"}


def _check_output_path(path: str, flag: str) -> None:
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
        plan_input_from_config,
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
        if value is not None and (value < least if least else not value > 0):
            raise TracetrainError(f"{flag} {value}: must be {f'at least {least}' if least else 'above 0'}")
    cfg = load_config(a.config, overrides)
    validate_run(cfg, model_args_from_config(cfg))  # plan only runs that train would accept
    inp = plan_input_from_config(cfg, num_gpus=a.gpus, gpu=a.gpu)  # PlanInputError: one line, as the others
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
    result = search(inp, a.gpus, a.top) if a.search else plan(inp)
    if a.search and not result:
        raise TracetrainError(f"no layout of {a.gpus} GPU(s) fits; try more GPUs, recomputation or offload")
    _show(result, a, render_terminal, render_html, render_json)
    if a.search:
        assert isinstance(result, list)  # search() returns the ranked plans
        print("overrides for the top row: " + " ".join(plan_to_config_overrides(result[0])))
    return 0


def cmd_presets(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.models.accounting import num_params
    from tracetrain.models.presets import PRESETS

    for name, args in PRESETS.items():
        print(
            f"{name:<14} {num_params(args) / 1e9:>7.3f}B  dim {args.dim:<5} layers {args.n_layers:<3} "
            f"heads {args.n_heads}/{args.n_kv_heads} ffn {args.ffn_dim} vocab {args.vocab_size}"
        )
    return 0


def cmd_report(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.train.run_report import write_report

    out = write_report([Path(r) for r in a.runs], Path(a.out) if a.out else None)
    print(f"wrote {out}")
    return 0


def cmd_config(a: argparse.Namespace, overrides: list[str]) -> int:
    from tracetrain.config import load_config, reference_markdown, to_toml

    print(reference_markdown() if a.reference else to_toml(load_config(a.config, overrides)))
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace, list[str]], int]]]:
    p = argparse.ArgumentParser(
        prog="tracetrain",
        description="Train and fine-tune Llama-family models, and see where every millisecond and gigabyte goes.",
    )
    p.add_argument("--version", action="version", version=f"tracetrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {}

    t = sub.add_parser(
        "train", help="train or fine-tune (default: a tiny model on a built-in task)", epilog=EPILOG_OVERRIDES
    )
    t.add_argument("--config", help="TOML config file (default: built-in defaults)")
    t.add_argument("--resume", metavar="RUN_DIR|auto", help="continue a run from its latest checkpoint")
    handlers["train"] = cmd_train

    for name, helptext in (
        ("eval", "held-out loss, perplexity and exact match of a trained run"),
        ("generate", "sample from a trained run"),
    ):
        s = sub.add_parser(name, help=helptext, epilog=EPILOG_OVERRIDES)
        s.add_argument("path", help="run directory (latest checkpoint) or checkpoint folder")
        s.add_argument("--device", default="auto")
        handlers[name] = cmd_eval if name == "eval" else cmd_generate
        s.add_argument(
            "--output",
            metavar="OUT.jsonl",
            help="write one JSON line per prompt (generate) or per "
            "scored held-out example: prompt, reference, prediction, correct (eval)",
        )
        if name == "generate":
            s.add_argument("--prompt", action="append", help="prompt text (repeatable)")
            s.add_argument(
                "--json",
                dest="as_json",
                action="store_true",
                help="print one JSON line per prompt (prompt, completion, finish_reason, tokens) instead of the text",
            )
            s.add_argument(
                "--prompts-file",
                metavar="FILE.jsonl",
                help="JSONL, one prompt per line: a 'prompt' "
                "field, or the run's instruction (+ context) fields; optional 'stop', 'max_new_tokens'",
            )
            s.add_argument(
                "--stop",
                action="append",
                default=[],
                metavar="STR",
                help="stop when the continuation contains STR (repeatable; cut from the completion)",
            )
            s.add_argument("--batch-size", type=int, default=16, help="prompts generated together")
            s.add_argument(
                "--kv-offload",
                action="store_true",
                help="keep the KV cache in pinned CPU memory, streamed to the GPU layer by layer",
            )
            s.add_argument(
                "--gpu-window",
                type=int,
                default=0,
                metavar="N",
                help="with --kv-offload: keep the N most recent positions of every layer on the GPU",
            )
            s.add_argument("--max-new-tokens", type=int, default=128, help=">= 0")
            s.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy")
            s.add_argument("--top-k", type=int, default=0, help=">= 0; 0 = off")
            s.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
            s.add_argument("--seed", type=int, default=0)
            s.add_argument(
                "--raw",
                action="store_true",
                help="send the prompt as is (default: wrap it in the run's prompt template)",
            )
            s.add_argument(
                "--chat",
                action="store_true",
                help="send each --prompt as a user message through the "
                "run's chat template (generation prompt added); stop at EOS or end-of-turn",
            )
            s.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user message")

    e = sub.add_parser("export", help="export a trained run to Hugging Face and/or PEFT format")
    e.add_argument("path", help="run directory or checkpoint folder")
    e.add_argument(
        "--hf",
        metavar="OUT_DIR",
        help="write a transformers model folder: config.json, "
        "generation_config.json, safetensors (adapters merged), tokenizer files, README.md",
    )
    e.add_argument("--peft", metavar="OUT_DIR", help="write a PEFT LoRA adapter (+ tokenizer files)")
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it holds an earlier tracetrain "
        "export (recognised by its tracetrain_export.json); never a run, a checkpoint or other files",
    )
    e.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help="dtype of the --hf weights (default: the "
        "run's train.precision when fp32 or fp16, else bf16; bf16 for LoRA runs)",
    )
    e.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="split --hf weights into safetensors shards of at most SIZE (e.g. 5GB, 500MB, 2GiB)",
    )
    handlers["export"] = cmd_export

    d = sub.add_parser(
        "data",
        help="build the configured data as training would; show statistics and examples with the trained tokens marked",
        epilog=EPILOG_OVERRIDES,
    )
    d.add_argument("--config", help="TOML config file (default: built-in defaults)")
    d.add_argument(
        "--show",
        type=int,
        metavar="N",
        help="show the first N examples of the data file, trained tokens "
        "highlighted (in a terminal) or wrapped in ⟦ ⟧ (default 0; 3 with --json)",
    )
    d.add_argument(
        "--json",
        dest="as_json",
        action="store_true",
        help="print the examples as a JSON list of "
        "{where, text, trained_text, trained_spans, num_tokens, num_trained}; statistics go to stderr",
    )
    d.add_argument("--stats-json", metavar="FILE", help="also write the statistics as JSON to FILE")
    handlers["data"] = cmd_data

    pr = sub.add_parser(
        "profile",
        help="train with a profiled window of steps, then analyze the trace",
        epilog="Window: --profile.start_step=N --profile.num_steps=K. " + EPILOG_OVERRIDES,
    )
    pr.add_argument("--config", help="TOML config file")
    pr.add_argument("--full-run", action="store_true", help="keep training after the window (default: stop)")
    handlers["profile"] = cmd_profile

    an = sub.add_parser(
        "analyze", help="explain where time goes in PyTorch profiler traces or Nsight Systems SQLite exports"
    )
    an.add_argument(
        "paths",
        nargs="+",
        help="trace files (Kineto .json / .json.gz, one per rank; or an "
        "`nsys export --type sqlite` file) or a folder of them",
    )
    an.add_argument("--compare", nargs="+", metavar="PATH", help="second set of traces to compare against")
    an.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    an.add_argument("--json", metavar="FILE", help="write the report as JSON")
    an.add_argument("--device-name", help="GPU name for peak FLOP/s (default: from the trace)")
    handlers["analyze"] = cmd_analyze

    pl = sub.add_parser(
        "plan", help="predict memory per GPU and step time before running; search layouts", epilog=EPILOG_OVERRIDES
    )
    pl.add_argument("--config", help="TOML config file (the run to plan)")
    pl.add_argument("--gpus", type=int, default=1, help="number of GPUs")
    pl.add_argument(
        "--gpu",
        help="GPU type: h100-sxm, h100-pcie, h100-nvl, h200, gh200, a100, l40s "
        "(default: the visible GPU, else h100-sxm)",
    )
    pl.add_argument("--search", action="store_true", help="enumerate layouts and settings, rank those that fit")
    pl.add_argument("--top", type=int, default=10, help="rows to show with --search")
    pl.add_argument("--gpu-memory-gib", type=float, help="override the GPU's memory")
    pl.add_argument("--host-memory-gib", type=float, help="CPU memory per node (for offload)")
    pl.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    pl.add_argument("--html", metavar="FILE", help="write the interactive HTML planner page")
    pl.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    handlers["plan"] = cmd_plan

    rp = sub.add_parser(
        "report",
        help="draw a run's training report page (loss, throughput, memory...), or overlay several runs",
        description="One run: writes RUN/report.html (the trainer keeps it current while it runs). Several "
        "runs: one page with every run overlaid, written to --out (default report-A-vs-B.html here).",
    )
    rp.add_argument("runs", nargs="+", metavar="RUN", help="run directories (runs/NAME)")
    rp.add_argument("--out", metavar="FILE", help="where to write the page")
    handlers["report"] = cmd_report

    sub.add_parser("presets", help="list model presets with parameter counts")
    handlers["presets"] = cmd_presets
    c = sub.add_parser("config", help="print the resolved config (or --reference for every key)")
    c.add_argument("--config", help="TOML config file")
    c.add_argument("--reference", action="store_true", help="print the config reference as Markdown")
    handlers["config"] = cmd_config
    return p, handlers


def _check_flags(a: argparse.Namespace) -> None:
    """Flags shared by several subcommands, checked before any of them starts its (possibly long) work."""
    from tracetrain.config import check_device_spec

    if getattr(a, "device", None) is not None:  # eval, generate
        check_device_spec(a.device, "--device")
    for dest, flag in _OUTPUT_FLAGS.items():
        if getattr(a, dest, None):
            _check_output_path(getattr(a, dest), flag)


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reading end is closed (`tracetrain presets | head -1`)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file object (tests capturing output)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _quit_on_closed_stdout() -> int:
    """Stop quietly, as the Python docs advise (library/signal.html, "Note on SIGPIPE"), with their status 1.

    Rich, which renders the analyze and plan reports, does the same, so every subcommand ends alike.
    """
    # Point stdout at devnull: the interpreter flushes it once more at exit, which would fail again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    unknown = [r for r in rest if not (r.startswith("--") and "=" in r and "." in r.split("=", 1)[0])]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides look like --section.key=value)")
    try:
        _check_flags(args)
        code = handlers[args.command](args, rest)
        sys.stdout.flush()  # output piped to a reader that quit shows up here, while we can still handle it
        return code
    except TracetrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe (a data worker, a socket) broke: a real failure, keep its traceback
        return _quit_on_closed_stdout()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
