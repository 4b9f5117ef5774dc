import tomllib
from pathlib import Path

import pytest

from tracetrain.config import Config, from_dict, load_config, parse_override, reference_markdown, to_toml
from tracetrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # The resolved TOML written to every run directory must load back to the same config.
    round_trip = from_dict(tomllib.loads(to_toml(cfg)))
    assert round_trip == cfg


def test_defaults_and_overrides():
    cfg = load_config(None, ["--optim.lr=3e-4", "--train.steps=7", "--data.path=my.jsonl", "--data.kind=instruction",
                             "--lora.targets=['q_proj', 'v_proj']"])
    assert cfg.optim.lr == 3e-4 and cfg.train.steps == 7 and cfg.data.path == "my.jsonl"
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    assert load_config().model.preset == "tiny"


@pytest.mark.parametrize("override, fragment", [
    ("--optim.lrr=1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("--optimizer.lr=1", "unknown config section 'optimizer'"),
    ("--optim.lr=-1", "config key 'optim.lr': -1.0 is out of range; it must be > 0"),
    ("--train.steps=1.5", "config key 'train.steps': 1.5 is not an integer"),
    ("--train.steps=true", "is not an integer"),
    ("--train.precision=fp64", "choose one of 'auto', 'fp32', 'bf16'"),
    ("--data.kind=instruction", "'data.path' is required"),
    ("--train.device=tpu", "train.device"),
    ("--data.pack=yes", "'data.pack': 'yes' is not true or false"),
    ("optim.lr", "must look like --section.key=value"),
])
def test_bad_values_name_key_value_and_allowed(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlr = 'fast'\n")
    with pytest.raises(ConfigError, match=r"bad.toml: config key 'optim.lr': 'fast' is not a number"):
        load_config(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("[optim\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_override_value_parsing():
    assert parse_override("--a.b=3") == ("a.b", 3)
    assert parse_override("--a.b=3e-4") == ("a.b", 3e-4)
    assert parse_override("--a.b=true") == ("a.b", True)
    assert parse_override("--a.b=path/to/x.jsonl") == ("a.b", "path/to/x.jsonl")
    assert parse_override("--a.b=") == ("a.b", "")


def test_reference_lists_every_key():
    ref = reference_markdown()
    for section in ("model", "data", "train", "optim", "lora", "checkpoint", "logging"):
        assert f"### [{section}]" in ref
    assert "| `lr` | `0.001` | > 0 | Peak learning rate. |" in ref
