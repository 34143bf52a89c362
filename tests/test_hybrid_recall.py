"""The hybrid's attention layer learns the MQAR lookup (docs/design.md s13.5), in the layout
users deploy: three GLA layers, then attention (`n_layers=4 attention_every=4`).

Before a hybrid's GLA layers' mixer branches were multiplied by 0.1 (`gla_branch_scale`) the GLA
layers' outputs came to fill the residual stream, the attention layer never matched a query to
its key, and the model recalled through the GLA layers' fixed states: this test failed then (the
same run with `gla_branch_scale=1`: MEASURED_BEFORE). Truth: accuracy on fresh MQAR sequences,
and the same model with its attention layer's output projection zeroed (the layer's whole
contribution removed)."""

import jax
import jax.numpy as jnp
import numpy as np
from mqar_runs import RECALL_STEPS, VOCAB

from laplace_jax.model import LaplaceLM
from train import eval as train_eval
from train.cli import mesh_from_flag
from train.tasks import mqar

# accuracy at (64, 4) / (128, 8) / (256, 16), and at (128, 8) with the attention layer zeroed
MEASURED = (0.967, 0.948, 0.893, 0.008)
MEASURED_BEFORE = (0.256, 0.110, 0.052, 0.007)  # gla_branch_scale=1


def _accuracy(cfg, params, seq_len, pairs) -> float:
    tokens, mask = mqar(128, seq_len, pairs, VOCAB, seed=(7, seq_len, pairs))
    logits, _ = jax.jit(lambda p, t: LaplaceLM(cfg).apply({"params": p}, t))(
        params, jnp.asarray(tokens[:, :-1])
    )
    hit = (np.asarray(jnp.argmax(logits, -1)) == tokens[:, 1:]) & mask
    return float(hit.sum() / mask.sum())


def test_the_hybrids_attention_layer_does_the_lookup(hybrid_recall_run):
    """The 3:1 hybrid (d_model 128; tests/mqar_runs.py's `recall_args`, trained early in the
    session) trained on MQAR (64, 4) holds 8 pairs over 128 tokens, which pure GLA of this size
    reaches in no run of bench/results/retrieval.json, and without its attention layer it
    recalls nothing."""
    cfg, params, _ = train_eval.load_checkpoint(
        hybrid_recall_run / "run" / "checkpoints", RECALL_STEPS, mesh_from_flag("fsdp=1")
    )
    assert cfg.layer_mixers == ("gla", "gla", "gla", "attention")
    assert cfg.embed_multiplier == 128**0.5 and cfg.mixer_branch_multiplier("gla") == 0.1
    params = jax.device_get(params)
    without = {**params, "layer_3": {**params["layer_3"]}}
    without["layer_3"]["out"] = {"kernel": np.zeros_like(params["layer_3"]["out"]["kernel"])}

    recall = _accuracy(cfg, params, 128, 8)
    assert recall >= 0.75, recall
    dropped = _accuracy(cfg, without, 128, 8)
    assert dropped <= 0.25 * recall, (recall, dropped)
