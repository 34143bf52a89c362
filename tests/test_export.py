"""Export: orbax checkpoint -> model folder -> PyTorch, and the exporter's errors.

Tolerance of the round trip (fp32): JAX logits vs PyTorch logits from the exported folder,
max abs difference <= 1e-4 on logits of magnitude ~3 (observed ~1e-5), same for the final
recurrent state.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from laplace_export_helpers import make_run, random_params, tiny_config

from export import exporter
from export.exporter import ExportError
from export.main import main as export_main
from laplace_spec import names


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def params(cfg):
    return random_params(cfg)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cfg, params):
    return make_run(tmp_path_factory.mktemp("run"), cfg, params)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run_dir):
    out = tmp_path_factory.mktemp("exported")
    assert export_main(["--checkpoint", str(run_dir / "checkpoints"), "--out", str(out)]) == 0
    return out


def test_name_table_covers_the_jax_model_exactly():
    """The table's paths and shapes are those of the Flax model (tiny and laplace-3b)."""
    from flax.traverse_util import flatten_dict

    from laplace_jax.model import abstract_params
    from laplace_spec.config import get_config

    for preset in ("tiny", "laplace-3b"):
        c = get_config(preset)
        model = {k: tuple(v.shape) for k, v in flatten_dict(abstract_params(c), sep="/").items()}
        table = {e.jax_path: e.jax_shape for e in names.table(c)}
        assert table == model
        if preset == "laplace-3b":
            assert sum(math.prod(s) for s in table.values()) == 3_027_551_232
    assert len({e.name for e in names.table(c)}) == len(names.table(c))


def test_round_trip_jax_logits_equal_torch_logits(cfg, params, exported):
    import jax.numpy as jnp

    from laplace_jax.model import LaplaceLM
    from serve.modeling_laplace import LaplaceForCausalLM

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 45))  # 45: partial chunk
    logits_j, state_j = LaplaceLM(cfg).apply({"params": params}, jnp.asarray(tokens))
    model = LaplaceForCausalLM.from_exported(exported)
    with torch.no_grad():
        out = model(torch.from_numpy(tokens))
    assert np.abs(out.logits.numpy() - np.asarray(logits_j)).max() <= 1e-4
    for i in range(cfg.n_layers):
        s = state_j[f"layer_{i}"]
        assert np.abs(out.state.gla[i].numpy() - np.asarray(s["gla"])).max() <= 1e-4
        assert np.abs(out.state.conv[i].numpy() - np.asarray(s["conv"])).max() <= 1e-4


def test_folder_layout_and_auto_classes(cfg, exported):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from serve.modeling_laplace import LaplaceForCausalLM

    files = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= files
    conf = json.loads((exported / "config.json").read_text())
    assert conf["architectures"] == ["LaplaceForCausalLM"] and conf["model_type"] == "laplace"
    assert {k: conf[k] for k in cfg.to_dict()} == cfg.to_dict()  # every LaplaceConfig field
    hf = AutoConfig.from_pretrained(exported)
    assert hf.hidden_size == cfg.d_model and hf.laplace_config == cfg  # the fields round-trip
    auto = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ours = LaplaceForCausalLM.from_exported(exported)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, ours(ids).logits)
    tok = AutoTokenizer.from_pretrained(exported)
    assert tok.decode(tok("the lazy dog")["input_ids"]) == "the lazy dog"


def test_sharded_and_bf16(cfg, params, tmp_path):
    from safetensors import safe_open

    from serve.modeling_laplace import LaplaceForCausalLM

    one = exporter.export_model(cfg, params, tmp_path / "one")
    sharded = exporter.export_model(cfg, params, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == {e.name for e in names.table(cfg)}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        a = LaplaceForCausalLM.from_exported(one)(ids).logits
        b = LaplaceForCausalLM.from_exported(sharded)(ids).logits
    assert torch.equal(a, b)

    bf = exporter.export_model(cfg, params, tmp_path / "bf16", dtype="bf16")
    assert json.loads((bf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(bf / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mixer.qkvg_proj.weight")
    assert w.dtype == torch.bfloat16
    ref = torch.from_numpy(np.ascontiguousarray(params["layer_0"]["qkvg"]["kernel"].T))
    assert torch.equal(w, ref.to(torch.bfloat16))


# ---- errors ----------------------------------------------------------------------------------


def _without(params, layer, key):
    p = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    del p[layer][key]
    return p


def test_missing_parameter_is_named(cfg, params, tmp_path):
    with pytest.raises(ExportError, match=r"missing parameter layer_1/w3/kernel"):
        exporter.export_model(cfg, _without(params, "layer_1", "w3"), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()  # nothing written


def test_wrong_shape_and_extra_parameter_are_named(cfg, params, tmp_path):
    bad = _without(params, "layer_0", "aug_balance")
    bad["layer_0"]["aug_balance"] = np.zeros((cfg.n_heads, cfg.d_k + 1), np.float32)
    with pytest.raises(ExportError, match=r"layer_0/aug_balance has shape \[4, 9\], expected"):
        exporter.export_model(cfg, bad, tmp_path)
    extra = {**params, "stray": {"kernel": np.zeros(3, np.float32)}}
    with pytest.raises(ExportError, match=r"unexpected parameter stray/kernel"):
        exporter.export_model(cfg, extra, tmp_path)


def test_checkpoint_without_params(cfg, tmp_path, capsys):
    from laplace_export_helpers import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", None, cfg)
    with pytest.raises(ExportError, match=r"no 'params' item"):
        exporter.read_checkpoint(ckpt)
    rc = export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "out"), "--no-tokenizer"])
    assert rc == 2 and "no 'params' item" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2


def test_missing_step_and_missing_tokenizer(cfg, params, tmp_path, run_dir, capsys):
    rc = export_main(
        ["--checkpoint", str(run_dir / "checkpoints"), "--step", "99", "--out", str(tmp_path / "a")]
    )
    assert rc == 2 and "step 99" in capsys.readouterr().err
    from laplace_export_helpers import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "bare" / "checkpoints", params, cfg)
    rc = export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "b")])
    assert rc == 2 and "--tokenizer" in capsys.readouterr().err


def test_loading_a_folder_with_a_missing_or_misshaped_tensor_fails(cfg, params, tmp_path):
    from safetensors.torch import load_file, save_file

    from serve.modeling_laplace import LaplaceForCausalLM

    out = exporter.export_model(cfg, params, tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.w12.weight"]
    tensors["model.norm.weight"] = torch.zeros(cfg.d_model + 1)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(names.WeightError) as e:
        LaplaceForCausalLM.from_exported(out)
    assert "missing tensor model.layers.1.mlp.w12.weight" in str(e.value)
    assert "tensor model.norm.weight has shape [65]" in str(e.value)


def test_a_hybrid_saved_before_its_scales_exports_and_loads_as_it_was(cfg, tmp_path):
    """A hybrid checkpoint whose config predates `embed_scale` and `gla_branch_scale` (no such
    fields) holds the model with the embedding and the GLA branches unscaled (docs/design.md
    s13.5): it exports as embed_scale "one" and gla_branch_scale "1", the PyTorch model then
    equals JAX's of that form, and so does an export written before the fields (config.json
    without them), which vLLM's config reads the same way."""
    import types

    import jax.numpy as jnp

    from laplace_jax.model import LaplaceLM
    from serve.configuration_laplace import LaplaceHFConfig
    from serve.modeling_laplace import LaplaceForCausalLM

    new = cfg.replace(attention_every=2)  # "auto": sqrt(D) and 0.1 for a hybrid
    old = new.replace(embed_scale="one", gla_branch_scale="1")
    added = ("embed_scale", "gla_branch_scale")
    params = random_params(old, seed=1)
    saved = {k: v for k, v in old.to_dict().items() if k not in added}
    meta = types.SimpleNamespace(to_dict=lambda: saved, vocab_size=old.vocab_size)
    run = make_run(tmp_path / "run", meta, params)
    out = tmp_path / "exported"
    assert export_main(["--checkpoint", str(run / "checkpoints"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["embed_scale"] == "one" and config["gla_branch_scale"] == "1"

    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
    want = np.asarray(LaplaceLM(old).apply({"params": params}, jnp.asarray(tokens))[0])
    scaled = np.asarray(LaplaceLM(new).apply({"params": params}, jnp.asarray(tokens))[0])
    assert np.abs(scaled - want).max() > 1e-2  # the two forms are different models
    for label in ("exported now", "exported before the fields"):
        if label == "exported before the fields":
            for name in added:
                del config[name]
            (out / "config.json").write_text(json.dumps(config))
            assert LaplaceHFConfig(**config).laplace_config == old  # vLLM's reads the same
        with torch.no_grad():
            got = LaplaceForCausalLM.from_exported(out)(torch.from_numpy(tokens)).logits.numpy()
        assert np.abs(got - want).max() <= 1e-4, label


def test_the_chat_template_written_with_an_export(tmp_path):
    """export/exporter.py `write_chat_template`: the tokenizer's own is kept; --chat-template
    replaces it (one template, not two: tokenizer_config.json's is removed), rendered as
    transformers renders (a `{% break %}` needs its loop-controls extension); the plain default
    needs an end-of-text token; a template that does not render is refused by name."""
    from export.exporter import ExportError, write_chat_template

    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert write_chat_template(tmp_path, None, "</s>") == "the tokenizer's"
    assert not (tmp_path / "chat_template.jinja").exists()
    given = "{% for m in messages %}{{ m['content'] }}{% break %}{% endfor %}"
    assert write_chat_template(tmp_path, given, "</s>") == "given"
    assert (tmp_path / "chat_template.jinja").read_text() == given
    assert "chat_template" not in json.loads(config.read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    assert write_chat_template(bare, None, None) == "none"
    assert write_chat_template(bare, None, "<|end_of_text|>") == "the plain default"
    with pytest.raises(ExportError, match="does not render a conversation"):
        write_chat_template(tmp_path / "bare", "{% for m in messages %}", "</s>")
