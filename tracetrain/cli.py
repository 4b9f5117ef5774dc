"""The `tracetrain` command. Thin: each subcommand parses, validates and calls one library function.

User mistakes (TracetrainError) print one line `error: ...` and exit with status 2; no traceback.
This module holds the parser and `main`; the subcommands' handlers are in `cli_commands.py`.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable

from tracetrain import __version__
from tracetrain.cli_commands import (
    check_output_path,
    cmd_analyze,
    cmd_config,
    cmd_data,
    cmd_eval,
    cmd_export,
    cmd_generate,
    cmd_plan,
    cmd_presets,
    cmd_profile,
    cmd_report,
    cmd_train,
    cmd_tune,
)
from tracetrain.errors import TracetrainError
from tracetrain.train.faults import silence_stdout, stdout_reader_gone

EPILOG_OVERRIDES = (
    "Any config key can be overridden as --section.key=value, e.g. --optim.lr=3e-4 "
    "--data.path=my.jsonl --train.steps=200. `tracetrain config --reference` lists every key."
)


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
            s.add_argument(
                "--prefill",
                default="eager",
                metavar="MODE",
                help="eager (default) or compiled: an unpadded prompt goes through torch.compile'd blocks "
                "(compiled once per model; padded batches and --kv-offload run eagerly)",
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
        "--gguf",
        metavar="FILE",
        help="write a llama.cpp GGUF file (llama architecture, adapters merged, tokenizer; "
        "--dtype applies; needs pip install 'tracetrain[gguf]')",
    )
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it holds an earlier tracetrain "
        "export (recognised by its tracetrain_export.json); never a run, a checkpoint or other files",
    )
    e.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="dtype of the --hf and --gguf weights: auto (default) = the run's weights dtype, as its checkpoint stores "
        "them (fp32 for full fine-tuning; an adapters-only LoRA run: its base's); bf16/fp16/fp32 convert",
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
    pl.add_argument(
        "--longest-context",
        action="store_true",
        help="also the longest data.seq_len that fits, with these settings and with the long-context switches",
    )
    pl.add_argument("--gpu-memory-gib", type=float, help="override the GPU's memory")
    pl.add_argument("--host-memory-gib", type=float, help="CPU memory per node (for offload)")
    pl.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    pl.add_argument(
        "--explain", action="store_true", help="also print what the planner assumes for the run (its inputs)"
    )
    pl.add_argument("--html", metavar="FILE", help="write the interactive HTML planner page")
    pl.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    handlers["plan"] = cmd_plan

    tu = sub.add_parser(
        "tune",
        help="measure the advice's and the planner's candidate changes, keep what is faster: tuned.toml",
        epilog=EPILOG_OVERRIDES,
    )
    tu.add_argument("config", nargs="?", help="TOML config file (default: the built-in default run)")
    tu.add_argument("--budget-min", type=float, default=15.0, metavar="N", help="minutes for all trials (default 15)")
    tu.add_argument("--max-memory", type=float, metavar="GIB", help="peak memory per GPU the result may use")
    tu.add_argument(
        "--allow", metavar="KINDS", help="numerics changes to try and accept: fp8, fp16, numerics (comma-separated)"
    )
    tu.add_argument("--out", default=".", metavar="DIR", help="where tuned.toml and tune/ go (default: here)")
    tu.add_argument("--steps", type=int, default=10, help="measured steps per trial (>= 10; the median is used)")
    tu.add_argument("--warmup-steps", type=int, default=3, help="steps before the measured ones (compilation)")
    tu.add_argument("--gpus", type=int, default=1, help="GPUs per trial (torchrun); the planner's top layouts join")
    tu.add_argument(
        "--try",
        dest="try_changes",
        action="append",
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more candidate to measure (repeatable)",
    )
    tu.add_argument(
        "--max-trials", type=int, metavar="N", help="measure at most N candidates (default: the budget decides)"
    )
    handlers["tune"] = cmd_tune

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


# Report files of analyze, plan and data; main checks each before the command does its work.
_OUTPUT_FLAGS = {"html": "--html", "json": "--json", "stats_json": "--stats-json"}


def _check_flags(a: argparse.Namespace) -> None:
    """Flags shared by several subcommands, checked before any of them starts its (possibly long) work."""
    from tracetrain.config import check_device_spec

    if getattr(a, "device", None) is not None:  # eval, generate
        check_device_spec(a.device, "--device")
    for dest, flag in _OUTPUT_FLAGS.items():
        if getattr(a, dest, None):
            check_output_path(getattr(a, dest), flag)


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
        if not getattr(e, "quiet", False):  # an OOM on a rank other than 0: rank 0 prints the job's line
            print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 2: a user mistake; RunStopped: 1 (train/faults.py)
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise  # another pipe (a data worker, a socket) broke: a real failure, keep its traceback
        # Stop quietly, as the Python docs advise (library/signal.html, "Note on SIGPIPE"), with their
        # status 1; rich, which renders the analyze and plan reports, does the same.
        silence_stdout()
        return 1
    except OSError as e:
        # stdout on a full disk (`tracetrain presets > /dev/full`): a stream has no file name to report.
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or e.filename is not None:
            raise
        silence_stdout()  # the interpreter flushes it once more at exit, which would fail again
        print(f"error: cannot write the output ({e.strerror})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
