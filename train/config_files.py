"""Config files `--config` reads besides the presets: YAML or JSON, in one of two forms.

Sectioned: the run's three configs as sections, and optionally the preset their unset fields
come from (a run's own `config.json` is this form, so training from it gives the same config):

    preset: small          # optional
    model: {d_model: 512, n_heads: 8, d_v: 64}
    optimizer: {lr: 3.0e-3}
    train: {steps: 500, global_batch_tokens: 8192}

Flat: fields of any of the three configs, routed as `key=value` overrides are (`model.`,
`optim.`, `train.` prefixes settle a name two of them have), and optionally `preset`; a model's
JSON of LaplaceConfig fields is this form:

    preset: tiny
    d_model: 128
    lr: 3.0e-3
    steps: 500

Without `preset`, the model's unset fields are LaplaceConfig's own defaults (as in a model JSON)
and the training and optimizer fields the `small` presets'. A run's `config.json` also holds what
the run was given or measured rather than set (data, tokenizer, mesh, batch, ...): those are
skipped, and its model section is read as a saved config (`LaplaceConfig.from_saved`: a field
added since takes the value that rebuilds the model it was).

Values are checked against each field's type: a whole number for an int, a number (or a string
that parses as one, as YAML 1.1 leaves `3e-3`) for a float, true/false for a bool.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from laplace_spec.config import ConfigError, parse_value

SECTIONS = ("model", "optimizer", "train")
RUN_RECORD_KEYS = ("data", "tokenizer", "tokenizer_source", "mesh", "processes", "batch", "peak")


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    path: str
    preset: str | None  # where unset fields come from
    sections: dict[str, dict[str, Any]]  # "model" / "optimizer" / "train" -> fields
    saved: bool  # a run's config.json: its model section is a saved config
    flat: dict[str, Any]  # the flat form's fields, routed later


def read(path: str) -> ConfigFile:
    """A YAML or JSON config file in either form; ConfigError naming the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            d = yaml.safe_load(text)
        else:
            d = json.loads(text)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        raise ConfigError(f"{path}: not valid {p.suffix.lstrip('.').upper()}: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: a config file is a mapping of field: value")
    preset = d.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{path}: preset is a preset's name, got {preset!r}")
    if not any(k in d for k in SECTIONS):
        return ConfigFile(path, preset, {}, False, {k: v for k, v in d.items() if k != "preset"})
    saved = all(k in d for k in SECTIONS) and any(k in d for k in RUN_RECORD_KEYS)
    unknown = sorted(set(d) - {*SECTIONS, "preset", *(RUN_RECORD_KEYS if saved else ())})
    if unknown:
        raise ConfigError(
            f"{path}: unknown section(s) {', '.join(unknown)} (sections: preset, "
            f"{', '.join(SECTIONS)}; or a flat mapping of fields)"
        )
    sections = {}
    for name in SECTIONS:
        section = d.get(name) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: section {name!r} is a mapping of field: value")
        sections[name] = section
    return ConfigFile(path, preset, sections, saved, {})


def typed_fields(cls, fields: dict[str, Any], where: str) -> dict[str, Any]:
    """`fields` checked against the dataclass `cls`: unknown names and wrong types are a
    ConfigError naming `where`."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(types))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(types))})"
        )
    out = {}
    for name, value in fields.items():
        typ = {"int": int, "float": float, "bool": bool, "str": str}[types[name]]
        if isinstance(value, str) and typ is not str:
            try:
                value = parse_value(name, value, typ)  # "3e-3", as YAML 1.1 reads it
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        elif typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif typ is str and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # gla_branch_scale: 0.1
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: {name} expects {typ.__name__}, got {value!r}")
        out[name] = value
    return out
