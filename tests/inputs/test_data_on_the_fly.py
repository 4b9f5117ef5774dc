"""On-the-fly tokenisation yields exactly the rows that tokenising ahead (unpacked) yields."""

import re

import pytest
import torch

from tracetrain.config import load_config
from tracetrain.data import build_datasets, build_loader, load_tokenizer
from tracetrain.errors import ConfigError


def test_on_the_fly_rows_equal_ahead_rows():
    base = ["--data.pack=false", "--data.synthetic_examples=300", "--data.seq_len=48"]
    ahead_cfg = load_config(None, base)
    lazy_cfg = load_config(None, [*base, "--data.tokenize=on_the_fly"])
    tok = load_tokenizer("byte")
    ahead, ahead_eval, _ = build_datasets(ahead_cfg.data, tok)
    lazy, lazy_eval, _ = build_datasets(lazy_cfg.data, tok)
    assert len(ahead) == len(lazy)
    for i in range(len(ahead)):
        a, b = ahead[i], lazy[i]
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids")), i
    assert torch.equal(ahead_eval.batch(0, len(ahead_eval))["labels"], lazy_eval.batch(0, len(lazy_eval))["labels"])
    batch = next(build_loader(lazy, 8, lazy_cfg.data, seed=0))
    assert batch["input_ids"].shape == (8, 48) and batch["input_ids"].dtype == torch.int64


def test_on_the_fly_refuses_packing():
    with pytest.raises(ConfigError, match=re.escape("data.tokenize")):
        load_config(None, ["--data.tokenize=on_the_fly"])
