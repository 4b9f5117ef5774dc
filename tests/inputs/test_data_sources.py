"""`[[data.sources]]`: several sources mixed by weight, deterministically, resumable, visible in `tracetrain data`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from helpers import read_metrics

from tracetrain.config import load_config
from tracetrain.data import build_datasets, load_tokenizer
from tracetrain.data.inspect import inspect_data, render_plain
from tracetrain.data.mixture import mix_counts
from tracetrain.errors import ConfigError, DataError
from tracetrain.train.resume import data_fingerprint

TOK = load_tokenizer("byte", "")


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def alpaca(n: int, tag: str) -> list[dict]:
    return [{"instruction": f"{tag} {i}", "input": "", "output": f"{tag}{i}"} for i in range(n)]


def chats(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
        for i in range(n)
    ]


def mix_config(tmp_path: Path, *extra: str, weights: tuple[float, float] = (3, 1)) -> Path:
    a = write_jsonl(tmp_path / "a.jsonl", alpaca(40, "aa"))
    b = write_jsonl(tmp_path / "b.jsonl", chats(120))
    text = (
        '[data]\nkind = "instruction"\nseq_len = 512\nchat_template = "chatml"\neval_fraction = 0.1\n'
        f'[[data.sources]]\npath = "{a}"\nweight = {weights[0]}\n'
        f'[[data.sources]]\npath = "{b}"\nkind = "chat"\nweight = {weights[1]}\n' + "".join(extra)
    )
    (tmp_path / "mix.toml").write_text(text)
    return tmp_path / "mix.toml"


@pytest.mark.parametrize(
    ("sizes", "weights", "expected"),
    [([100, 10], [1, 1], [55, 55]), ([30, 30, 30], [1, 1, 1], [30, 30, 30]), ([5, 5], [2, 1], [7, 3])],
)
def test_mix_counts_follow_the_weights_and_add_up(sizes: list[int], weights: list[float], expected: list[int]) -> None:
    assert mix_counts(sizes, weights) == expected
    assert sum(mix_counts(sizes, weights)) == sum(sizes)


def test_mixture_follows_the_weights_and_is_deterministic(tmp_path: Path) -> None:
    cfg = load_config(mix_config(tmp_path))
    train, _, stats = build_datasets(cfg.data, TOK)
    a, b = stats.sources
    # 36 + 108 training examples (10% held out of each); 144 drawn 3:1.
    assert (a["train_examples"], b["train_examples"]) == (36, 108)
    assert (a["examples_drawn"], b["examples_drawn"]) == (108, 36)
    assert a["repeats"] == 3.0 and a["share_examples"] == 0.75 and a["format"].startswith("alpaca")
    assert stats.train_examples == 144 and stats.eval_examples == 4 + 12
    assert abs(a["share_tokens"] + b["share_tokens"] - 1) < 1e-9
    # Every drawn document is in the rows: real tokens counted per source add up to the rows' tokens.
    assert a["tokens"] + b["tokens"] == stats.train_tokens
    again, _, _ = build_datasets(cfg.data, TOK)
    assert data_fingerprint(again) == data_fingerprint(train)
    other, _, _ = build_datasets(cfg.replace({"data.seed": 7}).data, TOK)
    assert data_fingerprint(other) != data_fingerprint(train)
    _, _, swapped_stats = build_datasets(load_config(mix_config(tmp_path, weights=(1, 3))).data, TOK)
    assert [s["examples_drawn"] for s in swapped_stats.sources] == [36, 108]


def test_cached_rows_equal_fresh_rows_and_a_changed_source_is_a_new_entry(tmp_path: Path) -> None:
    cfg = load_config(mix_config(tmp_path))
    fresh, _, _ = build_datasets(cfg.data, TOK)
    cached, _, _ = build_datasets(cfg.data, TOK, cache_dir=tmp_path / "cache")
    reused, _, _ = build_datasets(cfg.data, TOK, cache_dir=tmp_path / "cache")
    assert data_fingerprint(fresh) == data_fingerprint(cached) == data_fingerprint(reused)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    write_jsonl(tmp_path / "b.jsonl", chats(121))
    changed, _, _ = build_datasets(cfg.data, TOK, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert data_fingerprint(changed) != data_fingerprint(fresh)


def test_resume_on_a_mixture_recomputes_identical_losses(tmp_path: Path, one_thread_torch: None) -> None:
    config = mix_config(tmp_path)
    args = [
        "--config",
        str(config),
        "--data.seq_len=256",
        "--train.steps=8",
        "--train.micro_batch_size=4",
        "--model.n_layers=2",
        "--logging.log_interval=1",
        "--train.eval_interval=0",
        "--train.eval_generate=0",
        "--train.eval_batches=1",
        "--checkpoint.interval=4",
        "--checkpoint.keep_last=3",
        "--optim.warmup_steps=2",
        f"--train.output_dir={tmp_path / 'runs'}",
        "--train.run_name=r",
    ]
    cli_here("train", *args)
    run = tmp_path / "runs" / "r"
    reference = [r["loss"] for r in read_metrics(run)[0]]
    stats = json.loads((run / "data_stats.json").read_text())
    assert [s["path"] for s in stats["sources"]] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    shutil.rmtree(run / "checkpoints" / "step_00000008")  # as if it died after step 4's save
    cli_here("train", "--resume", str(run))
    assert [r["loss"] for r in read_metrics(run)[0]] == reference


def test_data_command_shows_each_source(tmp_path: Path) -> None:
    report = inspect_data(load_config(mix_config(tmp_path)), num_examples=2)
    text = render_plain(report)
    assert f"source 0          {tmp_path / 'a.jsonl'} (instruction): weight 75% -> 108 of 36 examples (x3)" in text
    assert f"source 1          {tmp_path / 'b.jsonl'} (chat): weight 25% -> 36 of 108 examples (x0.333)" in text
    assert "realised 75.0% of examples" in text
    # The shown examples take the sources in turn.
    assert [v.where.rsplit(":", 1)[0] for v in report.examples] == [
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"),
    ]
    assert json.loads(json.dumps(report.stats))["sources"][1]["kind"] == "chat"


def test_the_mixtures_95_percent_length_is_never_shorter_than_its_examples(tmp_path: Path) -> None:
    # A chat source measures no lengths (0); the mixture took the largest of the others, so `tracetrain
    # data` said 95% of examples fit whole in the short instruction rows' length while the chats, a
    # quarter of the examples, were longer. Unknown (0, not shown) is true; too short is not.
    report = inspect_data(load_config(mix_config(tmp_path), ["--data.template=plain"]))
    keeps = report.stats["data_stats"]["seq_len_keeps_95"]
    bins = report.stats["train"]["length_histogram"]
    longer = sum(b["count"] for b in bins if b["lo"] > keeps) / sum(b["count"] for b in bins)
    assert keeps == 0 or longer <= 0.05, (keeps, longer)


SOURCE = '[[data.sources]]\npath = "a.jsonl"\n'


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[data]\nkind = "instruction"\n' + SOURCE + "weight = 0\n",
            r"'data.sources\[0\].weight': 0.0 is out of range",
        ),
        ('[data]\nkind = "instruction"\npath = "x.jsonl"\n' + SOURCE, r"'data.path': 'x.jsonl' is not used with"),
        ('[data]\nkind = "instruction"\neval_path = "x.jsonl"\n' + SOURCE, r"'data.eval_path': 'x.jsonl' is not"),
        ('[data]\nkind = "text"\n' + SOURCE, r"'data.kind': 'text' cannot be mixed from data.sources"),
        (
            '[data]\nkind = "instruction"\n' + SOURCE + "[[data.sources]]\nweight = 1\n",
            r"'data.sources\[1\].path' is required",
        ),
        ('[data]\nkind = "instruction"\n' + SOURCE + "weigth = 1\n", r"unknown config key 'data.sources\[0\].weigth'"),
        (
            '[data]\nkind = "instruction"\n' + SOURCE + 'kind = "text"\n',
            r"'data.sources\[0\].kind': 'text' is not allowed",
        ),
        (
            '[data]\nkind = "instruction"\nsources = ["a.jsonl"]\n',
            r"'data.sources': \['a.jsonl'\] is not a list of tables",
        ),
        (
            '[data]\nkind = "instruction"\n' + SOURCE + 'kind = "chat"\nformat = "alpaca"\n',
            r"'data.sources\[0\].format': 'alpaca' is for instruction sources",
        ),
        (
            '[data]\nkind = "chat"\nformat = "dolly"\npath = "c.jsonl"\n',
            r"'data.format': 'dolly' is for instruction data",
        ),
    ],
)
def test_bad_sources_are_one_line_errors_naming_the_key(tmp_path: Path, toml: str, message: str) -> None:
    (tmp_path / "c.toml").write_text(toml)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(tmp_path / "c.toml")
    assert "\n" not in str(e.value)


def test_missing_source_file_names_its_key(tmp_path: Path) -> None:
    config = mix_config(tmp_path)
    (tmp_path / "b.jsonl").unlink()
    with pytest.raises(DataError, match=r"b\.jsonl does not exist \(config key 'data.sources\[1\].path'\)"):
        build_datasets(load_config(config).data, TOK)


def test_source_errors_name_the_source(tmp_path: Path) -> None:
    config = mix_config(tmp_path)
    write_jsonl(tmp_path / "a.jsonl", chats(3))  # chat rows in an instruction source
    with pytest.raises(DataError, match=r"a\.jsonl:1: .*set data\.sources\[0\]\.kind = 'chat'"):
        build_datasets(load_config(config).data, TOK)


def test_loader_state_resumes_exactly_on_a_mixture(tmp_path: Path) -> None:
    from tracetrain.data import build_loader

    cfg = load_config(mix_config(tmp_path))
    train, _, _ = build_datasets(cfg.data, TOK)
    loader = build_loader(train, 4, cfg.data, seed=cfg.data.seed)
    for _ in range(5):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader)["input_ids"] for _ in range(3)]
    rebuilt, _, _ = build_datasets(cfg.data, TOK)
    resumed = build_loader(rebuilt, 4, cfg.data, seed=cfg.data.seed)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed)["input_ids"], e) for e in expected)
