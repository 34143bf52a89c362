"""Configs people keep: `--config` with a preset, a YAML or JSON file or a run's own config.json
(train/config_files.py), `--print-config`, and `--help`'s list of every setting."""

import dataclasses
import json
import re

import pytest
import yaml

from laplace_jax.optim import OptimizerConfig
from laplace_jax.sharding import make_mesh
from laplace_spec.config import ConfigError, LaplaceConfig
from train import cli
from train import config as train_config
from train import main as train_main
from train.run_dir import write_run_files


def _resolve(*argv):
    return cli.resolve_configs(cli.parse_args(list(argv)))


def _run_config_json(run_dir, cfg):
    """A run's config.json, as the trainer writes it."""
    data = {"train": ["shards/train_000000.bin"], "val": [], "train_tokens": 12_345}
    peak = {"flops_per_s": 1e11, "source": "note: MFU against ..."}
    write_run_files(None, cfg, run_dir, None, make_mesh(1), (8, 1, 8), data, peak)
    return run_dir / "config.json"


def test_a_runs_own_config_json_trains_the_same_config(tmp_path):
    """`--config RUN/config.json` gives the run's three configs back (it failed before: "unknown
    config field(s): batch, data, mesh, model, ..."); key=value still wins over it."""
    cfg = _resolve("--config", "tiny", "--steps", "30", "lr=0.02", "d_model=128", "d_v=32",
                   "attention_every=2")  # fmt: skip
    path = _run_config_json(tmp_path, cfg)
    again = _resolve("--config", str(path))
    assert (again.model, again.optim, again.train) == (cfg.model, cfg.optim, cfg.train)
    assert again.notices == ()  # nothing left to a preset, the schedule is the run's
    assert again.train.sample_prompt == "def "  # the default prompt's trailing space survives
    assert _resolve("--config", str(path), "--steps", "40", "seed=3").train == (
        dataclasses.replace(cfg.train, steps=40, seed=3)
    )


def test_a_saved_hybrid_from_before_a_field_reads_as_the_model_it_was(tmp_path):
    """A run's config.json of a hybrid written before `embed_scale` existed: its model section is
    a saved config (LaplaceConfig.from_saved), not today's defaults."""
    cfg = _resolve("--config", "tiny", "attention_every=2")
    path = _run_config_json(tmp_path, cfg)
    saved = json.loads(path.read_text())
    del saved["model"]["embed_scale"], saved["model"]["gla_branch_scale"]
    path.write_text(json.dumps(saved))
    model = _resolve("--config", str(path)).model
    assert (model.embed_scale, model.gla_branch_scale) == ("one", "1")


def test_a_yaml_file_with_sections_and_a_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "preset: tiny\n"
        "model: {d_model: 128, d_v: 32}\n"
        "optimizer: {lr: 3e-3}\n"  # YAML 1.1 reads 3e-3 as a string: parsed as the float it is
        "train:\n  steps: 12\n  async_checkpoints: false\n"
    )
    cfg = _resolve("--config", str(path), "seed=2")
    tiny = _resolve("--config", "tiny", "d_model=128", "d_v=32", "lr=3e-3", "--steps", "12",
                    "async_checkpoints=false", "seed=2")  # fmt: skip
    assert (cfg.model, cfg.optim, cfg.train) == (tiny.model, tiny.optim, tiny.train)


def test_a_flat_yaml_file_routes_its_fields_like_overrides(tmp_path):
    path = tmp_path / "flat.yml"
    path.write_text("preset: tiny\nd_model: 128\nd_v: 32\nsteps: 7\noptim.lr: 0.01\n")
    cfg = _resolve("--config", str(path))
    tiny = _resolve("--config", "tiny", "d_model=128", "d_v=32", "--steps", "7", "lr=0.01")
    assert (cfg.model, cfg.optim, cfg.train) == (tiny.model, tiny.optim, tiny.train)
    # without a preset the model's unset fields are LaplaceConfig's own, as in a model JSON
    path.write_text("d_model: 3072\nsteps: 7\n")
    cfg = _resolve("--config", str(path))
    assert cfg.model == LaplaceConfig() and cfg.train.steps == 7
    assert cfg.notices[0].startswith(f"note: {path} names no preset")
    path.write_text("d_model: 64\n")
    with pytest.raises(ConfigError, match="flat.yml: d_model \\(64\\) must equal n_heads"):
        _resolve("--config", str(path))


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {d_model: 128\n", "not valid YAML"),
        ("- a\n- b\n", "a config file is a mapping of field: value"),
        ("model: {colour: red}\n", "unknown field\\(s\\) colour"),
        ("train: {steps: many}\n", "steps expects int, got 'many'"),
        ("train: {steps: 1.5}\n", "steps expects int, got 1.5"),
        ("preset: medium\n", "unknown preset 'medium'"),
        ("model: {}\ndata: {train: x}\n", "unknown section\\(s\\) data"),
        ("colour: red\n", "unknown config key 'colour'"),
    ],
)
def test_a_bad_config_file_names_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        _resolve("--config", str(path))
    assert str(e.value).startswith(str(path))


def test_print_config_writes_a_file_that_reads_back(tmp_path, capsys):
    """`--print-config` (no devices, no data) prints YAML that `--config` reads to the same
    configs."""
    argv = ["--config", "small", "--steps", "50", "lr=1e-3", "attention_every=2"]
    assert train_main.main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "kept.yaml").write_text(text)
    assert set(yaml.safe_load(text)) == {"model", "optimizer", "train"}
    first, again = _resolve(*argv), _resolve("--config", str(tmp_path / "kept.yaml"))
    assert (first.model, first.optim, first.train) == (again.model, again.optim, again.train)


def test_help_lists_every_setting_with_its_default_and_meaning(capsys):
    """Before, --help listed none of the key=value settings a run is set with."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    for cls in (LaplaceConfig, OptimizerConfig, train_config.TrainConfig):
        for f in dataclasses.fields(cls):
            match = re.search(rf"^  {f.name}=(.+?)(  \[.*\])?\n      (.+)$", text, re.MULTILINE)
            assert match, f.name
            shown = repr(f.default) if f.default == "def " else str(f.default)
            assert match[1] == shown and match[3] == f.metadata["meaning"]
    assert "  d_model=3072  [small: 384; tiny: 64]" in text
