from dataclasses import dataclass, field

import pytest

from gemflow.config import ConfigError, load_config, save_config


@dataclass
class Inner:
    lr: float = 0.1
    name: str = "base"


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)
    parent: str = ""


def test_defaults_file_and_overrides_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  lr: 0.5\n  name: file\n")
    cfg = load_config(Outer, path, ["inner.name=cli", "tags=a,b"])
    assert cfg == Outer(inner=Inner(lr=0.5, name="cli"), tags=["a", "b"])


def test_empty_values_are_empty_strings_not_none(tmp_path):
    assert load_config(Outer, None, ["parent="]).parent == ""
    assert load_config(Outer, None, {"inner.name": ""}).inner.name == ""
    path = tmp_path / "c.yaml"
    path.write_text("parent:\n")
    assert load_config(Outer, path).parent == ""


def test_saved_config_round_trips_empty_strings(tmp_path):
    cfg = load_config(Outer, None, ["parent=", "inner.lr=0.25"])
    again = load_config(Outer, save_config(cfg, tmp_path))
    assert again == cfg


def test_bad_keys_and_types_are_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['nope'\]"):
        load_config(Outer, None, ["nope=1"])
    with pytest.raises(ConfigError, match="config.inner.lr: expected float"):
        load_config(Outer, None, ["inner.lr=fast"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Outer, None, ["inner.lr"])


@dataclass
class Sized:
    d_model: int = 64


def test_malformed_yaml_is_one_line_naming_file_and_place(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("inner:\n  lr: [0.5\n  name: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(Outer, path)
    message = str(err.value)
    assert message.startswith(f"{path}: not valid YAML at line ") and "\n" not in message
    with pytest.raises(ConfigError, match="--set inner.name: not valid YAML"):
        load_config(Outer, None, ["inner.name=[a"])


def test_sizes_must_be_whole_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("d_model: 16.5\n")
    with pytest.raises(ConfigError, match=r"config.d_model: expected a whole number \(int\), got 16.5"):
        load_config(Sized, path)
    with pytest.raises(ConfigError, match="whole number"):
        load_config(Sized, None, ["d_model=true"])
    assert load_config(Sized, None, ["d_model=32.0"]).d_model == 32  # an exact whole number is fine
