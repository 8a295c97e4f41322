"""`--config FILE.yaml` for every stage: the file supplies defaults, flags on the command line win.

The file is read by an eager option callback that installs its values as click's `default_map`
before any other option is parsed, so click converts and validates them exactly like flags and
reports a missing required value the usual way. Keys are option names, with `-` or `_`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml

from spec_cli.errors import ConfigError


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror}", "check the path given to --config"
        ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path} is not valid YAML: {exc}", "fix the YAML syntax"
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of option names to values",
            "write it as `option-name: value` lines",
        )
    return data


def _as_flag_value(param: click.Parameter, value: Any) -> Any:
    """YAML lists for comma-separated string options (`aux-layers: [1, 14, 26]`)."""
    if isinstance(value, (list, tuple)) and not param.multiple and param.nargs == 1:
        return ",".join(str(v) for v in value)
    return value


def apply_config_file(
    ctx: click.Context, param: click.Parameter, value: Path | None
) -> Path | None:
    """Eager callback for `--config`: validate keys and install them as defaults."""
    if value is None or ctx.resilient_parsing:
        return value
    data = load_yaml(Path(value))
    params = {p.name: p for p in ctx.command.params if p.name and p.name != "config"}
    defaults: dict[str, Any] = {}
    for key, raw in data.items():
        name = str(key).replace("-", "_")
        if name not in params:
            known = ", ".join(sorted(n.replace("_", "-") for n in params))
            raise ConfigError(
                f"unknown key {key!r} in config file {value}",
                f"`spec {ctx.info_name}` accepts: {known}",
            )
        defaults[name] = _as_flag_value(params[name], raw)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value
