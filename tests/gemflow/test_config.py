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
