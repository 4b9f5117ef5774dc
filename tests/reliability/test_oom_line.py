"""Running out of memory is one line on the console, with the phase, the planned and the actual peak
and a suggestion; no traceback from any rank, a non-zero exit, no checkpoint left behind (issue #27).

The failures are real allocation failures on the host, not mocks:
- build: a 2-rank FSDP job whose embedding shard alone would be 1 TiB (the allocator refuses at once);
- forward: one process under an address-space limit (RLIMIT_AS) whose first step's logits need 4 GiB.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--data.seq_len=32", "--data.synthetic_examples=50", "--train.steps=2", "--optim.warmup_steps=0",
        "--train.device=cpu", "--train.precision=fp32", "--logging.progress=false", "--train.eval_interval=0"]  # fmt: skip
# fp32 embedding of 2^24 x 2^15 (each within the model's shape limits): 2 TiB, 1 TiB a rank under FSDP 2;
# refused by the allocator, nothing touched.
HUGE_VOCAB = ["--model.dim=32768", "--model.n_layers=1", "--model.n_heads=64", "--model.n_kv_heads=8",
              "--model.ffn_dim=16384", "--model.vocab_size=16777216"]  # fmt: skip


def _cli(args: list[str], *, torchrun: bool, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun else []
    cmd = [sys.executable, *launcher, "-m", "tracetrain.cli", "train", *args]

    def cap() -> None:  # in the child, before exec: its address space cannot pass the limit
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, preexec_fn=cap)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "ran out of memory" in line]


def _no_rank_traceback(proc: subprocess.CompletedProcess) -> None:
    # Only torchrun's own agent may print one (its ChildFailedError summary); no rank prints any.
    lines = (proc.stdout + proc.stderr).splitlines()
    assert not [line for line in lines if line.startswith("[rank") and "Traceback" in line], proc.stderr[-3000:]
    assert not [line for line in lines if "DefaultCPUAllocator" in line or "enforce fail" in line], proc.stderr[-3000:]


def _no_checkpoint(out: Path) -> None:
    assert not list(out.glob("*/checkpoints/*")), list(out.rglob("*"))


def test_build_oom_on_two_ranks_is_one_line(tmp_path: Path) -> None:
    proc = _cli([*TINY, *HUGE_VOCAB, "--parallel.dp_shard=2", f"--train.output_dir={tmp_path}"], torchrun=True)
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("error: rank ") and "during build" in line and "allocating 1024.0 GiB" in line, line
    assert "planned peak" in line and "GiB resident" in line and "parallel.dp_shard" in line, line
    _no_rank_traceback(proc)
    _no_checkpoint(tmp_path)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS caps the address space on Linux only")
def test_forward_oom_is_one_line(tmp_path: Path) -> None:
    # 64 rows x 512 tokens x 32768 vocabulary fp32 logits = 4 GiB, far past the 3 GiB address space.
    big_step = ["--model.vocab_size=32768", "--data.seq_len=512", "--data.synthetic_examples=4000",
                "--train.micro_batch_size=64", "--train.fused_ce=false"]  # fmt: skip
    args = [*TINY, *big_step, f"--train.output_dir={tmp_path}", "--checkpoint.save_final=true"]
    proc = _cli(args, torchrun=False, limit_bytes=3 * 2**30)
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: CPU ran out of memory during forward"), lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    _no_checkpoint(tmp_path)
