"""Golden per-step training losses of tiny CPU runs, one per transform and data kind, recorded from the
real trainer so a refactor of the build path or the step can be checked bitwise (issue #17).

`python3 tests/golden_losses.py --write` reruns every case twice (the losses must be deterministic)
and rewrites tests/data/golden_losses.json; tests/train/test_golden_losses.py recomputes and compares with ==.
Losses are the float32 values the trainer logs, stored as float64 (json round-trips them exactly).

Bitwise equality holds only on the kind of CPU the file was recorded on: MKL and ATen pick kernels by
vector width and vendor (AVX2 vs AVX-512, AMD vs Intel), which changes summation order in the last bit.
The file records that CPU (`cpu_fingerprint`); elsewhere the test compares to a relative 1e-4 (measured
across an AVX-512 and an AMD AVX2 machine: at most 5e-5, in the bf16 case; 1e-5 with optimizer offload;
1e-7 otherwise), still far below what a wrong mask, scale or order of transforms does (1e-3 and more).

Data files a case needs are written by this module into a scratch folder; overrides name that folder
as `{data_dir}`, so the recorded overrides do not depend on where the run happened.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GOLDEN_PATH = REPO / "tests" / "data" / "golden_losses.json"

# A tiny GQA model on short rows: a whole 6-step run takes well under a second on one CPU thread.
BASE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=128", "--data.seq_len=32", "--data.synthetic_examples=200", "--train.steps=6",
        "--train.micro_batch_size=4", "--optim.warmup_steps=1", "--train.device=cpu",
        "--train.precision=fp32", "--train.eval_interval=0", "--train.eval_generate=0",
        "--train.eval_batches=1", "--logging.log_interval=1", "--logging.progress=false",
        "--checkpoint.save_final=false"]

CASES: dict[str, list[str]] = {
    "full_fp32": [],
    "grad_accum_2": ["--train.grad_accum_steps=2"],
    "no_pack": ["--data.pack=false"],
    "lora": ["--train.mode=lora"],
    "lora_all_linear_dropout": ["--train.mode=lora", "--lora.targets=['all-linear']", "--lora.dropout=0.1"],
    "recompute_full": ["--memory.recompute=full"],
    "recompute_selective": ["--memory.recompute=selective"],
    "recompute_every_2": ["--memory.recompute=full", "--memory.recompute_every=2"],
    "offload_save_on_cpu": ["--memory.activation_offload=save_on_cpu"],
    "offload_streamed": ["--memory.activation_offload=streamed"],
    "optimizer_offload": ["--memory.optimizer_offload=true"],
    "fused_ce_off": ["--train.fused_ce=false"],
    "fused_ce_chunked": ["--train.fused_ce=true", "--train.fused_ce_chunk=32"],  # 4 chunks a micro-batch
    "moe_4": ["--model.num_experts=4"],
    # Longer rows for these two: a prompt alone fills 32 tokens, and a byte-tokenised chatml
    # conversation (two exchanges, markers spelt out in bytes) is ~150 tokens.
    "instruction_jsonl": ["--data.kind=instruction", "--data.path={data_dir}/instruct.jsonl",
                          "--data.template=plain", "--data.seq_len=128"],
    "chat_chatml": ["--data.kind=chat", "--data.chat_template=chatml", "--data.tokenizer=byte",
                    "--data.path={data_dir}/chat.jsonl", "--data.seq_len=192"],
    "text_file": ["--data.kind=text", "--data.path={data_dir}/corpus.txt"],
    # steps back at its default, which is how "unset" reads once epochs is set.
    "epochs_1": ["--train.steps=600", "--train.epochs=1", "--data.synthetic_examples=40"],
    "bf16_autocast": ["--train.precision=bf16"],
}

# Two ranks on gloo through the real CLI, started by launch_local (parallel_harness.cli_ranks: torchrun's
# variables, the ranks forked with torch imported). Same global batch as full_fp32 (4 rows a step): the
# data-parallel layouts split it, TP shares it.
LAYOUTS: dict[str, list[str]] = {
    "fsdp_dp_shard_2": ["--parallel.dp_shard=2", "--train.micro_batch_size=2"],
    "ddp_dp_replicate_2": ["--parallel.dp_replicate=2", "--train.micro_batch_size=2"],
    "tp_2": ["--parallel.tp=2"],
}


def write_data(data_dir: Path) -> None:
    """The instruction, chat and text files the data-kind cases read (small, fixed, written each run)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    with open(data_dir / "instruct.jsonl", "w") as f:
        for i in range(80):
            w = words[i % 8] + words[(3 * i) % 8]
            f.write(json.dumps({"instruction": f"reverse: {w}", "context": "", "response": w[::-1]}) + "\n")
    with open(data_dir / "chat.jsonl", "w") as f:
        for i in range(80):
            w = words[(5 * i) % 8]
            messages = [{"role": "user", "content": f"upper {w}"},
                        {"role": "assistant", "content": w.upper()}, {"role": "user", "content": "again"},
                        {"role": "assistant", "content": w.upper()[::-1]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    lines = [" ".join(words[(i + j) % 8] for j in range(i % 5 + 3)) + "." for i in range(300)]
    (data_dir / "corpus.txt").write_text("\n".join(lines) + "\n")


def overrides_for(case: str, data_dir: Path, out_dir: Path) -> list[str]:
    extra = CASES.get(case, LAYOUTS.get(case))
    assert extra is not None, case
    return [*BASE, *(o.format(data_dir=data_dir) for o in extra), f"--train.output_dir={out_dir}",
            "--train.run_name=run"]


def _read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def losses(case: str) -> list[float]:
    """Per-step training losses of `case`: in process for CASES, two gloo ranks for LAYOUTS."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_data(tmp_path)
        args = overrides_for(case, tmp_path, tmp_path / "runs")
        if case in LAYOUTS:
            from parallel_harness import cli_ranks

            cli_ranks(2, "train", *args)
        else:
            from tracetrain.config import load_config
            from tracetrain.train.loop import train
            train(load_config(None, args))
        return _read_losses(tmp_path / "runs" / "run")


def cpu_fingerprint() -> str:
    """The CPU properties that decide the last bit of a CPU run: vendor and the vector ISA ATen uses."""
    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def all_cases() -> dict[str, list[str]]:
    return {**CASES, **LAYOUTS}


def _commit() -> str:
    """HEAD, with '-dirty' when the library has uncommitted changes (the losses then belong to no commit)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--", "tracetrain"], capture_output=True, text=True,
                             cwd=REPO).stdout.strip()
    return head + ("-dirty" if changed else "")


def write_golden(names: list[str]) -> None:
    """Run each case twice, refuse any that is not bitwise deterministic, and write the golden file."""
    torch.set_num_threads(1)
    cases = {}
    for name in names:
        first, second = losses(name), losses(name)
        if first != second:
            raise RuntimeError(f"{name}: losses differ between two runs:\n{first}\n{second}")
        cases[name] = {"overrides": all_cases()[name], "losses": first}
        print(f"{name}: {first}", flush=True)
    golden = {"commit": _commit(), "torch": torch.__version__, "cpu": cpu_fingerprint(), "base": BASE, "cases": cases}
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_PATH.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {GOLDEN_PATH.relative_to(REPO)}")
    parser.add_argument("cases", nargs="*", help="case names to print the losses of (default: all)")
    ns = parser.parse_args()
    if ns.write and ns.cases:
        parser.error("--write records every case (one file, one commit): leave out case names")
    selected = ns.cases or list(all_cases())
    if ns.write:
        write_golden(selected)
    else:
        torch.set_num_threads(1)
        for name in selected:
            print(name, losses(name), flush=True)
