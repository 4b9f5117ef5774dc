"""Advice after a CUDA out-of-memory error comes from the planner, and names switches that would fit."""

from tracetrain.config import load_config
from tracetrain.train.oom import suggestions

H100 = "NVIDIA H100 80GB HBM3"


def test_7b_full_finetune_needs_optimizer_offload():
    cfg = load_config(None, ["--model.preset=llama2-7b", "--data.seq_len=2048", "--train.micro_batch_size=4"])
    advice = suggestions(cfg, H100)
    assert "--memory.optimizer_offload=true" in advice
    assert "--memory.recompute=full (" not in advice  # recomputation alone cannot fit 112 GB of states


def test_switch_already_on_is_not_suggested():
    cfg = load_config(None, ["--model.preset=llama2-7b", "--data.seq_len=2048", "--train.micro_batch_size=4",
                             "--memory.optimizer_offload=true", "--data.seq_len=32768"])
    assert "--memory.optimizer_offload=true" not in suggestions(cfg, H100)
