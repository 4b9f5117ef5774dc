"""The spec decides, and says so (tracetrain/spec.py): every choice `resolve` makes is recorded with its
reason, printed at the start of train/eval/generate/plan, saved as the run's spec.json and shown on the
report page; a value the user set is recorded as asked."""

import json

import torch
from conftest import cli_here

from tracetrain.config import load_config
from tracetrain.spec import resolve

ARGS = ["--data.synthetic_examples=64", "--data.seq_len=32", "--train.eval_interval=0", "--train.eval_generate=0"]


def _by_key(spec):
    return {d.key: d for d in spec.decisions}


def test_auto_choices_carry_their_reason_and_set_values_say_asked():
    auto = _by_key(resolve(load_config(None, []), torch.device("cpu")))
    assert auto["train.precision"].value == "fp32" and auto["train.precision"].reason == "no bf16 GPU"
    assert auto["train.attention"].value == "sdpa" and "cpu" in auto["train.attention"].reason
    assert auto["optim.fused"].value == "off" and auto["train.compile"].value == "off"
    asked = resolve(load_config(None, ["--train.precision=bf16", "--optim.fused=on"]), torch.device("cpu"))
    got = _by_key(asked)
    assert got["train.precision"].reason == "asked: bf16" and got["optim.fused"].value == "on"
    assert asked.asked("train.precision") and not asked.asked("train.attention")


def test_lora_records_the_base_dtype_and_what_checkpoints_hold():
    got = _by_key(resolve(load_config(None, ["--train.mode=lora"]), torch.device("cpu")))
    assert got["lora.base_dtype"].value == "float32"
    assert got["checkpoint contents"].value == "whole model"  # a random base cannot be reloaded


def test_the_planner_decides_for_a_gpu_and_says_so_on_cuda_terms():
    from tracetrain.plan import plan_spec

    got = _by_key(plan_spec(load_config(None, ["--parallel.dp_shard=2"]), 2))
    assert got["train.precision"].value == "bf16" and got["train.compile"].value == "on"
    assert got["fsdp compute dtype"].value == "bfloat16"
    tp = _by_key(plan_spec(load_config(None, ["--parallel.tp=2"]), 2))
    assert tp["train.fused_ce"].value == "off" and "tensor" in tp["train.fused_ce"].reason


def test_train_prints_saves_and_shows_its_decisions(tmp_path):
    run = cli_here("train", *ARGS, "--train.steps=2", f"--train.output_dir={tmp_path}", "--train.run_name=r")
    assert "decided: train.precision = fp32 (no bf16 GPU)" in run.stdout
    saved = json.loads((tmp_path / "r" / "spec.json").read_text())
    spec = resolve(load_config(tmp_path / "r" / "config.toml", []), torch.device("cpu"))
    assert saved["decisions"] == [d._asdict() for d in spec.decisions]
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Decided by tracetrain (spec.json)" in page and "train.attention" in page
    # eval: the block on stderr, stdout stays the JSON result
    ev = cli_here("eval", str(tmp_path / "r"))
    assert "decided (cpu):" in ev.stderr and json.loads(ev.stdout)["checkpoint"]


def test_plan_prints_decisions_and_explain_prints_its_inputs():
    out = cli_here("plan", "--explain").stdout
    assert "decided (on a CUDA GPU):\n  train.precision = bf16" in out
    assert "planned as: seq_len=" in out and "precision=bf16" in out
    assert "planned as" not in cli_here("plan").stdout


def test_recompute_pointwise_is_on_for_a_4bit_base_decided_once_and_refused_where_it_cannot_act():
    import pytest

    from tracetrain.errors import ConfigError
    from tracetrain.plan import plan_input_from_config, plan_spec

    lora = ["--train.mode=lora"]
    off = plan_spec(load_config(None, lora))  # a CUDA GPU: compile 'auto' -> on; a bf16 base: 'auto' -> off
    assert not off.recompute_pointwise and _by_key(off)["memory.recompute_pointwise"].value == "off"
    assert not off.asked("memory.recompute_pointwise")
    assert not plan_input_from_config(load_config(None, lora)).recompute_pointwise
    qlora_cfg = load_config(None, [*lora, "--lora.base_quant=nf4"])
    qlora = plan_spec(qlora_cfg)  # a 4-bit base: 'auto' -> on, and the planner plans what runs
    assert qlora.recompute_pointwise and not qlora.asked("memory.recompute_pointwise")
    assert _by_key(qlora)["memory.recompute_pointwise"].line().startswith("memory.recompute_pointwise = on (a 4-bit")
    assert plan_input_from_config(qlora_cfg).recompute_pointwise
    qlora_off = load_config(None, [*lora, "--lora.base_quant=nf4", "--memory.recompute_pointwise=off"])
    assert not plan_spec(qlora_off).recompute_pointwise and not plan_input_from_config(qlora_off).recompute_pointwise
    assert not resolve(qlora_cfg, torch.device("cpu")).recompute_pointwise  # 'auto' without compiled blocks: off
    recomputed = plan_spec(load_config(None, [*lora, "--lora.base_quant=nf4", "--memory.recompute=full"]))
    assert not recomputed.recompute_pointwise  # 'auto' with blocks recomputed: off, as measured
    on_cfg = load_config(None, [*lora, "--memory.recompute_pointwise=on"])
    on = plan_spec(on_cfg)
    assert on.recompute_pointwise and _by_key(on)["memory.recompute_pointwise"].line() == (
        "memory.recompute_pointwise = on (asked: on)"
    )
    assert plan_input_from_config(on_cfg).recompute_pointwise
    assert not plan_spec(load_config(None, ["--memory.recompute_pointwise=auto"])).recompute_pointwise  # full FT
    with pytest.raises(ConfigError) as full:  # no adapters
        load_config(None, ["--memory.recompute_pointwise=on"])
    with pytest.raises(ConfigError) as cpu:  # compile 'auto' is off on the CPU
        resolve(on_cfg, torch.device("cpu"))
    with pytest.raises(ConfigError) as eager:
        plan_spec(load_config(None, [*lora, "--memory.recompute_pointwise=on", "--train.compile=off"]))
    with pytest.raises(ConfigError) as old_bool:  # the switch was a boolean before 'auto'
        load_config(None, [*lora, "--memory.recompute_pointwise=true"])
    for e, allowed in ((full, "train.mode = 'lora'"), (cpu, "train.compile = 'on'"), (eager, "train.compile = 'on'"),
                       (old_bool, "auto")):
        message = str(e.value)
        assert "\n" not in message and "'memory.recompute_pointwise'" in message and allowed in message, message
