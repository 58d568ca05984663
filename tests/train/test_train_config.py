"""The run config: layers (defaults, YAML, dotted overrides), strict types, errors that name the key, round trips."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from megakern.config import (ConfigError, TrainConfig, all_keys, describe_fields, field_docs, load_config, to_dict,
                             to_yaml)
from megakern.models.gpt import GPTConfig
from megakern.train import main

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_gpt_tiny_and_valid():
    config = load_config()
    assert config.model == GPTConfig.preset("gpt-tiny")
    assert config.train.steps >= 100 and config.data.paths == []


def test_overrides_are_parsed_for_their_field_types():
    config = load_config(None, ["optim.lr=3e-4", "train.steps=12", "train.compile=true", "train.global_batch_size=null",
                                "data.weights=[1, 2.5]", "data.paths=[a, b]", "model.kernels.attention=torch",
                                "train.sample_prompt=42", "log.run_dir=runs/x", "schedule.decay=wsd"])
    assert config.optim.lr == 3e-4 and isinstance(config.optim.lr, float)
    assert config.train.steps == 12 and config.train.compile is True and config.train.global_batch_size is None
    assert config.data.weights == [1.0, 2.5] and config.data.paths == ["a", "b"]
    assert config.model.kernels == {"attention": "torch"}
    assert config.train.sample_prompt == "42"  # a str field takes the text as written
    assert config.schedule.decay == "wsd"


def test_model_preset_and_derived_fields_follow_overrides():
    wide = load_config(None, ["model.n_embd=256"])
    assert wide.model.ffn_hidden == 4 * 256  # derived from n_embd, not kept from the preset
    explicit = load_config(None, ["model.n_embd=256", "model.ffn_hidden=300"])
    assert explicit.model.ffn_hidden == 300
    llama = load_config(None, ["model.preset=llama-tiny", "model.n_layer=3"])
    assert llama.model == GPTConfig.preset("llama-tiny", n_layer=3)


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: gpt-tiny\n  n_layer: 2\noptim:\n  lr: 3e-4\ntrain:\n  steps: 50\n")
    config = load_config(path, ["train.steps=70"])
    assert config.model.n_layer == 2 and config.optim.lr == 3e-4  # PyYAML reads 3e-4 as a string: accepted
    assert config.train.steps == 70


@pytest.mark.parametrize("overrides, message", [
    (["train.lr=1e-3"], "unknown config key 'train.lr' (did you mean 'optim.lr'?)"),
    (["model.n_layr=3"], "unknown config key 'model.n_layr' (did you mean 'model.n_layer'"),
    (["nosection.x=1"], "unknown config key 'nosection.x'"),
    (["optim.lr=fast"], "config key 'optim.lr': expected a number, got 'fast'"),
    (["train.steps=1.5"], "config key 'train.steps': expected an integer, got 1.5"),
    (["train.steps=true"], "config key 'train.steps': expected an integer, got True"),
    (["train.compile=3"], "config key 'train.compile': expected true or false, got 3"),
    (["schedule.decay=cosin"], "config key 'schedule.decay': expected one of 'cosine', 'linear', 'wsd', 'constant'"),
    (["data.weights=[1, x]"], "config key 'data.weights[1]': expected a number"),
    (["optim.lr"], "override 'optim.lr' is not of the form key=value"),
    (["model.n_head=5"], "model: GPTConfig: n_head (5) must divide n_embd (128)"),
    (["model.preset=gpt-huge"], "unknown preset 'gpt-huge'"),
    (["eval.seq_length=1024"], "eval.seq_length 1024 exceeds model.max_seqlen 256"),
    (["train.seq_length=300"], "train.seq_length 300 exceeds model.max_seqlen 256"),
    (["train.global_batch_size=20", "train.micro_batch_size=8"], "train.global_batch_size 20 is not a multiple"),
    (["schedule.min_lr=1.0"], "schedule.min_lr 1.0 must be in [0, optim.lr="),
    (["train.device=tpu"], "train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["data.valid_fraction=0"], "data.valid_fraction must be in (0, 1)"),
    (["data.paths=[a, b]", "data.weights=[1]"], "data.weights has 1 entries for 2 data.paths"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("optim:\n  lr: 1e-3\n  momentum: 0.9\n", "unknown config key 'optim.momentum'"),
    ("optimizer:\n  lr: 1e-3\n", "unknown config key 'optimizer'"),
    ("train: 5\n", "config key 'train': expected a mapping of fields"),
    ("- 1\n- 2\n", "expected a mapping of sections, got list"),
    ("train: {steps: [\n", "is not valid YAML"),
    ("format_version: 99\n", "format_version 99"),
    ("model:\n  preset: 3\n", "config key 'model.preset': expected a preset name"),
    ("model:\n  n_layer: two\n", "config key 'model.n_layer': expected an integer, got 'two'"),
])
def test_bad_files_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nothing.yaml: No such file"):
        load_config(tmp_path / "nothing.yaml")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["model.preset=llama-tiny", "model.kernels.attention=torch", "optim.lr=1e-3",
                                "data.weights=[1.0]", "train.global_batch_size=32"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config
    data = yaml.safe_load(path.read_text())
    assert data["format_version"] == 1 and set(data) - {"format_version"} == {f.name for f in
                                                                               dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_config(path)
    assert config.model.n_layer >= 1


def test_every_field_has_a_docstring():
    config = TrainConfig()
    missing = []
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        docs = field_docs(type(value))
        missing += [f"{section.name}.{f.name}" for f in dataclasses.fields(value) if not docs.get(f.name)]
    assert not missing, f"fields without a docstring: {missing}"
    listing = describe_fields(config)
    for key in all_keys(config):
        assert f"  {key}: " in listing


def test_to_dict_is_plain():
    data = to_dict(load_config())
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_cli_print_and_help_config(capsys):
    assert main(["--print-config", "optim.lr=5e-4"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["optim"]["lr"] == 5e-4
    assert main(["--help-config"]) == 0
    assert "optim.lr: float = 0.002" in capsys.readouterr().out
    assert main(["--print-config", "train.lr=1"]) == 2
    assert "unknown config key 'train.lr' (did you mean 'optim.lr'?)" in capsys.readouterr().err


def test_model_config_is_gpt_config():
    from megakern.config import ModelConfig

    assert ModelConfig is GPTConfig and isinstance(load_config().model, ModelConfig)
