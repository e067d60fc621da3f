"""Typed configs: dataclasses loadable from YAML, overridable per flag, written next to every run's outputs.

Every stage declares its config as a (possibly nested) dataclass. ``load_config`` builds one from defaults,
an optional YAML file and ``key.sub=value`` overrides, in that order; ``save_config`` records what a run used.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override names an unknown key or a value of the wrong type."""


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {hint.__name__}, got {value!r}")
        return _from_dict(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or hint is Any or hint is None:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected a boolean, got {value!r}")
    if hint is str and value is None:  # an empty YAML value: "" rather than the string "None"
        return ""
    if hint is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
        raise ConfigError(f"{where}: expected a whole number (int), got {value!r}")  # int(16.5) would be 16
    if hint in (int, float, str):
        try:
            return hint(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}") from err
    if hint is Path:
        return Path(value)
    return value


def _from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = value


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | dict | None = None) -> T:
    """Defaults < YAML file < overrides (``["train.lr=0.01", ...]`` or a flat ``{"train.lr": 0.01}``)."""
    data: dict[str, Any] = to_dict(cls())
    if path:
        loaded = _yaml(Path(path).read_text(), str(path)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        _deep_update(data, loaded)
    items = overrides.items() if isinstance(overrides, dict) else (_split(o) for o in overrides or [])
    for key, value in items:
        if value is None:
            continue
        if isinstance(value, str):  # "key=" means the empty string, not YAML's null
            value = _yaml(value, f"--set {key}") if value.strip() else ""
        _set_path(data, key, value)
    return _from_dict(cls, data)


def _yaml(text: str, where: str) -> Any:
    """Parsed YAML, or a one-line ConfigError naming where and what (line, column) is wrong."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None


def _split(override: str) -> tuple[str, str]:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key=value (e.g. train.lr=0.01)")
    key, value = override.split("=", 1)
    return key.strip(), value


def _deep_update(base: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def to_dict(cfg: Any) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in dataclasses.asdict(cfg).items()}


def save_config(cfg: Any, out_dir: str | Path, name: str = "config.yaml") -> Path:
    """Record the config a run used next to its outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path
