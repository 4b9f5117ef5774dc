"""Shared fixtures. Real datasets live in ../shared/data beside the checkout; tests that need them skip
with a reason when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_file(rel: str) -> Path:
    path = SHARED_DATA / rel
    if not path.exists():
        pytest.skip(f"{path} not present (the shared data folder sits beside the checkout)")
    return path


@pytest.fixture(scope="module")
def one_thread_torch():
    """Tiny matmuls gain nothing from a second thread, and on a busy machine its spin-waits cost seconds."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# The tiny GQA model the generation and KV-offload tests decode with (3 layers, 2 KV heads for 4 query heads).
GEN_ARGS_KW = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)


@pytest.fixture(scope="module")
def gen_model(one_thread_torch):
    """That model in eval mode, seeded, with torch on one thread for the whole module."""
    from tracetrain.models.llama import ModelArgs, Transformer
    torch.manual_seed(0)
    return Transformer(ModelArgs(**GEN_ARGS_KW)).eval()
