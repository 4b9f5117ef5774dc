import re
import tomllib

import pytest
from helpers import REPO

from tracetrain.config import Config, from_dict, load_config, parse_override, reference_markdown, to_toml
from tracetrain.errors import ConfigError


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # The resolved TOML written to every run directory must load back to the same config.
    round_trip = from_dict(tomllib.loads(to_toml(cfg)))
    assert round_trip == cfg


@pytest.mark.parametrize("overrides", [[], ["--train.steps=20"]], ids=["as_is", "short_run"])
def test_tiny_synthetic_config_is_the_default_run(overrides):
    # README: "the default run, spelled out"; its own header: `tracetrain train` with no config does the same,
    # with the same overrides too (a fixed warm-up of 50 refused --train.steps=20, which the default runs).
    # (it spells out data.tokenizer = 'byte', which 'auto' resolves to without model.init_from)
    default = load_config(None, ["--data.tokenizer=byte", *overrides])
    assert load_config(REPO / "configs" / "tiny-synthetic.toml", overrides) == default


def test_defaults_and_overrides():
    cfg = load_config(None, ["--optim.lr=3e-4", "--train.steps=7", "--optim.warmup_steps=2", "--data.path=my.jsonl",
                             "--data.kind=instruction", "--lora.targets=['q_proj', 'v_proj']"])
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
    with pytest.raises(ConfigError, match=re.escape("broken.toml: not valid TOML")):
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
    assert "| `lr` | `0.001` | > 0 <= 1 | Peak learning rate (AdamW: 0 < lr <= 1). |" in ref


@pytest.mark.parametrize("override, fragment", [
    ("--optim.lr=1e39", "config key 'optim.lr': 1e+39 is out of range; it must be <= 1"),
    ("--optim.lr=nan", "config key 'optim.lr': nan is not a finite number"),
    ("--optim.beta2=inf", "config key 'optim.beta2': inf is not a finite number"),
    ("--memory.activation_offload_fraction=-inf", "not a finite number"),
    ("--logging.peak_tflops=1e400", "config key 'logging.peak_tflops': inf is not a finite number"),
    ("--data.path=x.txt", "config key 'data.path': 'x.txt' is ignored with data.kind = 'synthetic'"),
])
def test_floats_finite_lr_bounded_paths_used_warmup_shorter(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_every_float_field_refuses_non_finite_values():
    import dataclasses
    import typing
    checked = 0
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(section.default_factory)  # type: ignore[arg-type]
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            if "float" not in str(hints[f.name]):
                continue
            with pytest.raises(ConfigError, match=f"'{section.name}.{f.name}': inf is not a finite number"):
                from_dict({section.name: {f.name: float("inf")}})
            checked += 1
    assert checked >= 10  # optim.lr, eps, betas, model.init_std, ... all seen


def test_limits_that_still_load():
    assert load_config(None, ["--optim.lr=1"]).optim.lr == 1.0
    assert load_config(None, ["--train.steps=51"]).train.steps == 51  # warmup 50 ends before step 51
    assert load_config(None, ["--train.steps=1", "--optim.warmup_steps=0"]).train.steps == 1
    cfg = load_config(None, ["--data.kind=text", "--data.path=x.txt"])
    assert cfg.data.path == "x.txt"


def test_warmup_longer_than_a_new_run_is_refused_but_a_saved_config_still_loads():
    from tracetrain.models.build import model_args_from_config
    from tracetrain.validate import validate_run
    # a finished run's config.toml loads (eval, export)
    cfg = load_config(None, ["--train.steps=20", "--optim.warmup_steps=50"])
    with pytest.raises(ConfigError) as e:
        validate_run(cfg, model_args_from_config(cfg))  # ... but a new run with it is refused
    assert ("config key 'optim.warmup_steps': 50 is not shorter than the run (20 steps from train.steps); "
            "set it below 20 (e.g. --optim.warmup_steps=2)") in str(e.value)


def test_unset_warmup_adapts_to_the_run_and_is_never_refused():
    from tracetrain.config import OptimSection, check_warmup, describe_warmup, resolve_warmup
    from tracetrain.models.build import model_args_from_config
    from tracetrain.validate import validate_run

    cfg = load_config(None, ["--train.steps=20"])
    assert cfg.optim.warmup_steps is None
    validate_run(cfg, model_args_from_config(cfg))  # not refused: the user never set a warm-up
    unset = OptimSection()
    assert [resolve_warmup(unset, n) for n in (1, 9, 10, 20, 499, 500, 600, 10_000)] == [0, 0, 1, 2, 49, 50, 50, 50]
    for n in range(1, 1200, 7):
        check_warmup(unset, n)
        assert resolve_warmup(unset, n) < n  # always shorter than the run
    assert describe_warmup(unset, 20) == "warm-up: 2 steps (10% of 20; optim.warmup_steps not set)"
    assert describe_warmup(unset, 600) == "warm-up: 50 steps (10% of 600, at most 50; optim.warmup_steps not set)"
    assert describe_warmup(unset, 15) == "warm-up: 1 step (10% of 15; optim.warmup_steps not set)"
    assert describe_warmup(OptimSection(warmup_steps=3), 20) is None  # the user set it: no note
    assert resolve_warmup(OptimSection(warmup_steps=3), 1000) == 3
    # A run's config.toml keeps it unset, so a resumed run resolves the same rule.
    assert "# warmup_steps = (auto)" in to_toml(cfg)
    assert load_config(None, ["--train.steps=20"]).replace({"optim.lr": 1e-4}).optim.warmup_steps is None


def test_check_warmup_takes_a_resolved_step_count():
    from tracetrain.config import OptimSection, check_warmup
    check_warmup(OptimSection(warmup_steps=50), 51)
    with pytest.raises(ConfigError, match=r"50 is not shorter than the run \(40 steps from train.epochs = 2\)"):
        check_warmup(OptimSection(warmup_steps=50), 40, source="train.epochs = 2")


def test_config_file_encoding_and_kind_errors(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"# r\xe9sum\xe9\n[optim]\nlr = 3e-4\n")
    with pytest.raises(ConfigError, match=r"latin1.toml: line 1: byte 0xe9 is not UTF-8 text"):
        load_config(latin1)
    utf8 = tmp_path / "utf8.toml"
    utf8.write_text("# résumé\n[optim]\nlr = 3e-4\n", encoding="utf-8")
    assert load_config(utf8).optim.lr == 3e-4
    with pytest.raises(ConfigError, match=r"is a directory; give a .toml file"):
        load_config(tmp_path)


@pytest.mark.parametrize(("given", "meant"), [
    ("optim.learning_rate", "optim.lr"),  # another tool's name for the key
    ("train.learning_rate", "optim.lr"),  # ... in the wrong section
    ("train.max_steps", "train.steps"),
    ("train.lr", "optim.lr"),  # the right last component in the wrong section
    ("lora.r", "lora.rank"),
    ("optim.warmup_step", "optim.warmup_steps"),
    ("model.dimm", "model.dim"),
])
def test_did_you_mean_matches_the_last_component_and_common_names(given, meant):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--{given}=1"])
    assert str(e.value) == f"unknown config key '{given}' (did you mean '{meant}'?)"


def test_a_list_key_takes_a_word_or_comma_separated_words():
    assert load_config(None, ["--lora.targets=all-linear"]).lora.targets == ["all-linear"]
    assert load_config(None, ["--lora.targets=q_proj, v_proj"]).lora.targets == ["q_proj", "v_proj"]
    assert load_config(None, ['--lora.targets=["q_proj"]']).lora.targets == ["q_proj"]
