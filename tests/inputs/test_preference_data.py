"""Preference data and runs: rows of prompt / chosen / rejected (strings, chat messages, or whole
conversations with a shared prompt) become pairs of documents packed whole into one row, chosen first,
with loss on the completions only; bad rows and bad combinations are one line; `tracetrain train` with
train.objective = dpo writes reward margins and accuracies to metrics.jsonl and the run report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracetrain.config import DataSection, load_config
from tracetrain.data import ByteTokenizer, build_datasets, tokenize_rows
from tracetrain.data.chat_templates import CHATML, render
from tracetrain.errors import ConfigError, DataError
from tracetrain.labels import IGNORE_INDEX
from tracetrain.train.preference import count_pairs, sequence_logps
from tracetrain.validate import refuse_with_parallel

TOK = ByteTokenizer()


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def string_rows(n: int) -> list[dict]:
    return [{"prompt": f"Q{i}: 2+{i}=", "chosen": f"{2 + i}", "rejected": f"{3 + i} maybe"} for i in range(n)]


def pairs_of(rows: dict[str, torch.Tensor]) -> list[tuple[str, str, str, str]]:
    """Every pair of the rows as (chosen text, chosen trained text, rejected text, rejected trained text)."""
    out = []
    for r in range(rows["input_ids"].shape[0]):
        docs = rows["document_ids"][r]
        sides = []
        for d in range(int(docs.max()) + 1):
            at = docs == d
            ids, labels = rows["input_ids"][r][at].tolist(), rows["labels"][r][at]
            sides += [TOK.decode(ids), TOK.decode([t for t in labels.tolist() if t != IGNORE_INDEX])]
        assert len(sides) % 4 == 0, "a row holds whole pairs"
        out += [tuple(sides[i : i + 4]) for i in range(0, len(sides), 4)]
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_string_pairs_share_a_row_chosen_first_loss_on_completions(tmp_path: Path, pack: bool) -> None:
    path = write_rows(tmp_path / "p.jsonl", string_rows(12))
    data = DataSection(kind="preference", path=path, seq_len=96, pack=pack, eval_fraction=0.0)
    train, _, stats = build_datasets(data, TOK)
    rows = train.batch(0, len(train))
    found = pairs_of(rows)
    assert (
        stats.train_examples == len(found) == 12 == sum(count_pairs(train.batch(i, i + 1)) for i in range(len(train)))
    )
    # (BOS and EOS decode to nothing with the byte tokenizer; their ids are checked below.)
    expected = {(f"Q{i}: 2+{i}={2 + i}", f"{2 + i}", f"Q{i}: 2+{i}={3 + i} maybe", f"{3 + i} maybe") for i in range(12)}
    assert set(found) == expected
    first = rows["document_ids"][0] == 0
    assert rows["input_ids"][0][first][0] == TOK.bos_id and rows["input_ids"][0][first][-1] == TOK.eos_id
    assert rows["labels"][0][first][-2] == TOK.eos_id  # EOS is trained (labels are shifted: predicted one earlier)
    assert (len(train) < 12) == pack  # packed: several pairs a row; unpacked: one each


def test_chat_pairs_explicit_and_implicit_prompt_give_the_same_rows(tmp_path: Path) -> None:
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    explicit = [{"prompt": prompt, "chosen": "Paris.", "rejected": [{"role": "assistant", "content": "Lyon."}]}]
    implicit = [
        {
            "chosen": prompt + [{"role": "assistant", "content": "Paris."}],
            "rejected": prompt + [{"role": "assistant", "content": "Lyon."}],
        }
    ]
    got = []
    for name, rows in (("explicit", explicit), ("implicit", implicit)):
        data = DataSection(
            kind="preference",
            path=write_rows(tmp_path / f"{name}.jsonl", rows * 3),
            seq_len=256,
            chat_template="chatml",
            eval_fraction=0.0,
        )
        got.append(build_datasets(data, TOK)[0].batch(0, 1))
    for key in got[0]:
        assert torch.equal(got[0][key], got[1][key]), key
    chosen, chosen_trained, rejected, rejected_trained = pairs_of(got[0])[0]
    prompt_text, _ = render(CHATML, TOK.special_tokens(), prompt, add_generation_prompt=True)
    assert chosen.startswith(prompt_text) and rejected.startswith(prompt_text)
    # The completion is what the template renders after the generation prompt: the answer and its end of turn.
    assert chosen_trained.startswith("Paris.<|im_end|>") and rejected_trained.startswith("Lyon.<|im_end|>")


def test_rows_shown_by_inspection_are_the_pair_sides(tmp_path: Path) -> None:
    data = DataSection(kind="preference", path=write_rows(tmp_path / "p.jsonl", string_rows(2)), seq_len=96)
    sides = list(tokenize_rows(data, TOK))
    assert [s.text for s in sides] == ["Q0: 2+0=2", "Q0: 2+0=3 maybe", "Q1: 2+1=3", "Q1: 2+1=4 maybe"]
    assert all(s.where.endswith(f":{1 + i // 2}") for i, s in enumerate(sides))


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
        ({"prompt": "p", "chosen": "a", "rejected": 3}, "field 'rejected' is int"),
        ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [], "rejected": "x"}, "field 'chosen' must be"),
        (
            {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
            "must share their leading (prompt) messages",
        ),
    ],
)
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path: Path, row: dict, reason: str) -> None:
    path = write_rows(tmp_path / "p.jsonl", string_rows(2) + [row])
    data = DataSection(kind="preference", path=path, seq_len=96, chat_template="chatml")
    with pytest.raises(DataError) as e:
        build_datasets(data, TOK)
    assert f"{path}:3: " in str(e.value) and reason in str(e.value) and "\n" not in str(e.value)
    skipped = build_datasets(
        DataSection(
            kind="preference", path=path, seq_len=96, chat_template="chatml", skip_bad_lines=True, eval_fraction=0.0
        ),
        TOK,
    )[2]
    assert skipped.bad_lines_skipped == 1 and skipped.train_examples == 2


def test_each_side_is_cut_to_half_a_row_and_long_prompts_drop_the_pair(tmp_path: Path) -> None:
    rows = [
        {"prompt": "p" * 10, "chosen": "c" * 40, "rejected": "r"},
        {"prompt": "q" * 40, "chosen": "c", "rejected": "r"},
    ]
    data = DataSection(
        kind="preference", path=write_rows(tmp_path / "p.jsonl", rows + string_rows(1)), seq_len=48, eval_fraction=0.0
    )
    train, _, stats = build_datasets(data, TOK)
    assert stats.examples_truncated == 1 and stats.examples_dropped == 1 and stats.train_examples == 2
    rows_ = train.batch(0, len(train))
    for r in range(len(train)):
        for d in range(int(rows_["document_ids"][r].max()) + 1):
            assert int((rows_["document_ids"][r] == d).sum()) <= 24


def test_sequence_logps_sum_each_document_and_count_its_targets() -> None:
    logits = torch.randn(1, 8, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX, 3, 4, IGNORE_INDEX, IGNORE_INDEX]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, -1, -1]])
    sums = sequence_logps(logits, labels, docs)
    logp = logits.log_softmax(-1)[0]
    assert torch.allclose(sums[0, 0], torch.stack([logp[1, 1] + logp[2, 2], torch.tensor(2.0)]))
    assert torch.allclose(sums[0, 1], torch.stack([logp[4, 3] + logp[5, 4], torch.tensor(2.0)]))
    assert torch.equal(sums[0, 2:], torch.zeros(6, 2))


def test_bad_combinations_are_one_line() -> None:
    with pytest.raises(
        ConfigError, match=r"'train.objective': 'dpo' trains on preference pairs, but data.kind = 'synthetic'"
    ):
        load_config(None, ["--train.objective=dpo"])
    with pytest.raises(ConfigError, match=r"'data.kind': 'preference' pairs need train.objective = 'dpo' or 'simpo'"):
        load_config(None, ["--data.kind=preference", "--data.path=p.jsonl"])
    with pytest.raises(ConfigError, match=r"'data.path' is required when data.kind = 'preference'"):
        load_config(None, ["--data.kind=preference", "--train.objective=simpo"])
    base = ["--data.kind=preference", "--data.path=p.jsonl", "--train.objective=dpo"]
    for layout, mode in (("--parallel.tp=2", "lora"), ("--parallel.pp=2", "lora"), ("--parallel.dp_shard=2", "full")):
        with pytest.raises(ConfigError, match=r"'train.objective' is not supported together with several ranks"):
            refuse_with_parallel(load_config(None, [*base, layout, f"--train.mode={mode}"]))
    refuse_with_parallel(load_config(None, [*base, "--parallel.dp_shard=2", "--train.mode=lora"]))  # allowed


def test_cli_dpo_run_logs_rewards_and_report(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", string_rows(40))
    args = [
        "train",
        "--data.kind=preference",
        f"--data.path={path}",
        "--train.objective=dpo",
        "--train.mode=lora",
        "--data.seq_len=64",
        "--train.steps=4",
        "--train.micro_batch_size=4",
        "--logging.log_interval=2",
        "--train.eval_interval=2",
        "--train.eval_batches=1",
        "--optim.warmup_steps=1",
        "--optim.lr=1e-2",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=dpo",
        "--train.device=cpu",
    ]
    proc = subprocess.run([sys.executable, "-m", "tracetrain.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert len(train) == 4 and all({"reward_margin", "reward_accuracy", "reward_chosen"} <= set(r) for r in train)
    assert all(0 <= r["reward_accuracy"] <= 1 for r in train)
    assert abs(train[0]["loss"] - 0.6931) < 1e-3  # step 1: adapters start at zero, policy = reference
    final = next(r for r in lines if r.get("final"))
    assert {"eval_loss", "eval_reward_margin", "eval_reward_accuracy", "eval_pairs"} <= set(final)
    assert "reward accuracy" in proc.stdout
    report = (tmp_path / "dpo" / "report.html").read_text()
    assert "Reward margin (chosen - rejected)" in report and "held-out reward accuracy" in report


def test_fsdp_two_ranks_lora_dpo_equals_one_process(tmp_path: Path) -> None:
    """2 CPU ranks (gloo) started by launch_local (parallel_harness.cli_ranks), FSDP: each rank scores its
    rows' whole pairs; the loss divisor (pairs) and the reward statistics are summed over the ranks, so
    losses and rewards equal one process's (run through the CLI's main in this process; the DPO run above
    is the real process)."""
    path = write_rows(tmp_path / "p.jsonl", string_rows(40))
    args = [
        "train",
        "--data.kind=preference",
        f"--data.path={path}",
        "--train.objective=dpo",
        "--train.mode=lora",
        "--data.seq_len=64",
        "--train.steps=3",
        "--logging.log_interval=1",
        "--train.eval_interval=0",
        "--train.eval_batches=1",
        "--optim.warmup_steps=1",
        "--optim.lr=1e-2",
        "--model.n_layers=2",
        "--logging.progress=false",
        f"--train.output_dir={tmp_path}",
        "--train.device=cpu",
    ]
    from conftest import cli_here
    from parallel_harness import cli_ranks

    cli_ranks(2, *args, "--parallel.dp_shard=2", "--train.micro_batch_size=2", "--train.run_name=fsdp")
    cli_here(*args, "--train.micro_batch_size=4", "--train.run_name=one")
    keys = ("loss", "reward_margin", "reward_accuracy", "reward_chosen")
    runs = [
        [
            [r[k] for k in keys]
            for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"
        ]
        for name in ("fsdp", "one")
    ]
    assert len(runs[0]) == 3 and runs[1][1][1] != 0
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), atol=1e-5, rtol=1e-4)
