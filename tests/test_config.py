"""LaplaceConfig: presets, validation errors that name the problem, JSON and overrides."""

import dataclasses
import re

import pytest

from laplace_jax.accounting import parameter_counts
from laplace_spec.config import PRESETS, ConfigError, LaplaceConfig, get_config


def test_laplace_3b_preset_is_the_design_table():
    cfg = PRESETS["laplace-3b"]
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads) == (50_304, 3_072, 24, 16)
    assert (cfg.d_k, cfg.d_v, cfg.conv_width, cfg.ffn_dim) == (96, 192, 4, 8_192)
    assert (cfg.t_min, cfg.t_max, cfg.n_tiers) == (1.0, 2_048.0, 4)
    assert (cfg.seq_len, cfg.chunk_size, cfg.n_chunks, cfg.qkvg_dim) == (2_048, 128, 16, 9_216)


def test_small_preset_size():
    total = parameter_counts(PRESETS["small"])["total_params"]
    assert 10e6 <= total <= 30e6


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"d_model": 100}, "d_model (100) must equal n_heads * d_v"),
        ({"n_tiers": 3}, "n_heads (16) must be divisible by n_tiers (3)"),
        ({"vocab_size": 50_257}, "vocab_size (50257) must be a multiple of 64"),
        ({"chunk_size": 100}, "chunk_size (100) must divide seq_len (2048)"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"d_k": -4}, "d_k must be positive"),
        ({"t_min": 4096.0}, "t_min (4096.0) must not exceed t_max"),
        ({"n_heads": 16.0}, "n_heads must be int"),
        ({"compute_dtype": "float16"}, "compute_dtype must be one of"),
        ({"embed_scale": "gemma"}, "embed_scale must be one of"),
    ],
)
def test_validation_names_the_problem(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        PRESETS["laplace-3b"].replace(**changes)


def test_json_round_trip(tmp_path):
    for cfg in PRESETS.values():
        assert LaplaceConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "model.json"
    path.write_text(PRESETS["small"].to_json())
    assert get_config(str(path)) == PRESETS["small"]


def test_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config field"):
        LaplaceConfig.from_dict({**PRESETS["tiny"].to_dict(), "n_experts": 8})
    with pytest.raises(ConfigError, match="not valid JSON"):
        LaplaceConfig.from_json("{d_model: 3}")
    bad = tmp_path / "bad.json"
    bad.write_text('{"d_model": "wide"}')
    with pytest.raises(ConfigError, match="bad.json: d_model must be int"):
        get_config(str(bad))
    with pytest.raises(ConfigError, match="config file not found"):
        get_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="unknown config 'laplace-7b'"):
        get_config("laplace-7b")


def test_overrides():
    cfg = get_config("tiny", ["n_layers=3", "t_max=128", "compute_dtype=bfloat16"])
    assert (cfg.n_layers, cfg.t_max, cfg.compute_dtype) == (3, 128.0, "bfloat16")
    assert (
        dataclasses.replace(cfg, n_layers=2, t_max=64.0, compute_dtype="float32") == PRESETS["tiny"]
    )
    with pytest.raises(ConfigError, match="unknown config key 'n_experts'"):
        get_config("tiny", ["n_experts=8"])
    with pytest.raises(ConfigError, match="n_layers expects int, got 'two'"):
        get_config("tiny", ["n_layers=two"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        get_config("tiny", ["n_layers"])
    with pytest.raises(ConfigError, match="must equal n_heads"):
        get_config("tiny", ["d_model=65"])


def test_embed_scale_default_and_a_config_saved_before_it():
    """ "auto" (every preset's) scales a hybrid's embedding by sqrt(D) and leaves pure Laplace's
    (docs/design.md s13.5); a saved hybrid config without the field predates it and is the
    unscaled model, a pure one is today's; a user's partial config is not a saved one and takes
    the default."""
    for cfg in PRESETS.values():
        assert cfg.embed_scale == "auto" and cfg.embed_multiplier == 1.0
        hybrid = cfg.replace(attention_every=2)
        assert hybrid.embed_multiplier == hybrid.d_model**0.5
        assert cfg.replace(embed_scale="sqrt_d_model").embed_multiplier == cfg.d_model**0.5
        assert hybrid.replace(embed_scale="one").embed_multiplier == 1.0
    big = PRESETS["laplace-3b"].replace(attention_every=4)
    assert big.embed_multiplier == pytest.approx(55.4256, abs=1e-4)
    saved = {k: v for k, v in PRESETS["tiny"].to_dict().items() if k != "embed_scale"}
    old = LaplaceConfig.from_saved({**saved, "attention_every": 2})
    assert old.embed_scale == "one" and old.embed_multiplier == 1.0
    # pure Laplace saved before the field is today's default model: read as "auto" (1)
    assert LaplaceConfig.from_saved(saved) == PRESETS["tiny"]
    assert LaplaceConfig.from_saved(PRESETS["tiny"].to_dict()) == PRESETS["tiny"]
    assert LaplaceConfig.from_dict({**saved, "attention_every": 2}).embed_multiplier == 8.0


def test_gla_branch_scale_default_and_a_config_saved_before_it():
    """ "auto" multiplies a hybrid's GLA branches by 0.1 and no attention layer's, and leaves
    pure Laplace's at 1 (docs/design.md s13.5); a number is taken as given (from JSON too); a
    saved hybrid config without the field predates it and is the unscaled model, whatever its
    embed_scale; bad values are refused naming the field."""
    for cfg in PRESETS.values():
        assert cfg.gla_branch_scale == "auto" and cfg.mixer_branch_multiplier("gla") == 1.0
        hybrid = cfg.replace(attention_every=2)
        assert hybrid.mixer_branch_multiplier("gla") == 0.1
        assert hybrid.mixer_branch_multiplier("attention") == 1.0
        assert hybrid.replace(gla_branch_scale="1").mixer_branch_multiplier("gla") == 1.0
        assert cfg.replace(gla_branch_scale="0.25").mixer_branch_multiplier("gla") == 0.25
    tiny = PRESETS["tiny"]
    from_json = LaplaceConfig.from_dict({**tiny.to_dict(), "gla_branch_scale": 0.5})
    assert from_json.gla_branch_scale == "0.5"
    for bad in ("0", "-1", "nan", "inf", "tenth"):
        with pytest.raises(ConfigError, match="gla_branch_scale must be 'auto' or a positive"):
            tiny.replace(gla_branch_scale=bad)
    saved = {k: v for k, v in tiny.to_dict().items() if k != "gla_branch_scale"}
    old = LaplaceConfig.from_saved({**saved, "attention_every": 2})  # embed_scale "auto" kept
    assert old.gla_branch_scale == "1" and old.embed_multiplier == tiny.d_model**0.5
    assert LaplaceConfig.from_saved(saved) == tiny  # pure Laplace: today's model


def test_gla_branch_forms_and_attention_input():
    """The branch forms' constant s (docs/design.md s13.5): LayerScale starts at 0.1, the
    post-norm at the scaled embedding's RMS at initialisation (init_std sqrt(D) in a hybrid),
    both times gla_branch_scale when it is a number, and W_out starts at its fan-in's scale
    under the post-norm only; attention layers are never scaled; reading the embedding is for a
    hybrid only; bad values are refused naming the field; a saved config without the fields
    predates them and is today's model."""
    hybrid = PRESETS["tiny"].replace(attention_every=2)
    assert hybrid.mixer_branch_form("gla") == "multiplier" and not hybrid.attention_reads_embedding
    scaled = hybrid.replace(gla_branch="layer_scale")
    assert scaled.mixer_branch_form("gla") == "layer_scale"
    assert scaled.mixer_branch_multiplier("gla") == 0.1
    assert scaled.replace(gla_branch_scale="0.5").mixer_branch_multiplier("gla") == 0.5
    normed = hybrid.replace(gla_branch="post_norm")
    embedding_rms = hybrid.init_std * hybrid.d_model**0.5
    assert normed.mixer_branch_multiplier("gla") == pytest.approx(embedding_rms)
    half = normed.replace(gla_branch_scale="0.5").mixer_branch_multiplier("gla")
    assert half == pytest.approx(0.5 * embedding_rms)
    for cfg in (scaled, normed):
        assert cfg.mixer_branch_form("attention") == "multiplier"
        assert cfg.mixer_branch_multiplier("attention") == 1.0
        assert cfg.mixer_out_init_scale("attention") == cfg.residual_init_scale
    # W_out starts at its fan-in's scale under the post-norm only (the norm sets the size)
    assert normed.mixer_out_init_scale("gla") == 1.0
    assert scaled.mixer_out_init_scale("gla") == hybrid.mixer_out_init_scale("gla") == 0.5
    assert hybrid.replace(attention_input="stream_and_embedding").attention_reads_embedding
    with pytest.raises(ConfigError, match="gla_branch must be one of"):
        hybrid.replace(gla_branch="postnorm")
    with pytest.raises(ConfigError, match="attention_input must be one of"):
        hybrid.replace(attention_input="embedding")
    with pytest.raises(ConfigError, match="needs attention_every >= 2"):
        PRESETS["tiny"].replace(attention_input="stream_and_embedding")
    saved = {
        k: v for k, v in hybrid.to_dict().items() if k not in ("gla_branch", "attention_input")
    }
    assert LaplaceConfig.from_saved(saved) == hybrid


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].n_layers = 5
