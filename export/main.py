"""`python -m export.main --checkpoint DIR --out DIR [--step N] [--dtype bf16|fp32]`.

Reads the 'params' item of an orbax checkpoint (never the optimizer state) and writes a model
folder that `serve/` loads with PyTorch or vLLM and no JAX (layout: export/exporter.py), with a
chat template (`--chat-template FILE`, else the tokenizer's own, else a plain role-tagged one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from export import exporter
from export.exporter import ExportError


def resolve_config(args, checkpoint_dir: Path, meta: dict | None):
    """The model config: --config, else the checkpoint's meta, else the run's config.json."""
    from laplace_spec.config import LaplaceConfig, get_config

    if args.config:
        return get_config(args.config, args.override)
    candidates = []
    if meta and isinstance(meta.get("config"), dict):
        candidates.append(("checkpoint meta", meta["config"]))
    for p in (checkpoint_dir.parent / "config.json", checkpoint_dir / "config.json"):
        if p.is_file():
            candidates.append((str(p), json.loads(p.read_text())))
    for where, d in candidates:
        d = d.get("model", d) if isinstance(d.get("model"), dict) else d
        fields = set(LaplaceConfig.__dataclass_fields__)
        cfg = LaplaceConfig.from_saved({k: v for k, v in d.items() if k in fields})
        print(f"config from {where}", file=sys.stderr)
        return cfg.with_overrides(args.override)
    raise ExportError(
        f"no model config found (checkpoint meta, {checkpoint_dir.parent / 'config.json'}); "
        "pass --config PRESET_OR_JSON"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.main", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="orbax checkpoint directory")
    ap.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
    ap.add_argument("--out", required=True, help="output model folder")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--config", default=None, help="preset or JSON (default: from the run)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer.json")
    ap.add_argument("--no-tokenizer", action="store_true", help="export weights and config only")
    ap.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template for the export (default: the tokenizer's own, else a plain "
        "role-tagged template: export/chat_template.jinja)",
    )
    ap.add_argument("--max-len", type=int, default=None, help="serving length limit")
    ap.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    args = ap.parse_args(argv)
    try:
        ckpt = Path(args.checkpoint).resolve()
        params, step, meta = exporter.read_checkpoint(ckpt, args.step)
        cfg = resolve_config(args, ckpt, meta)
        tok, template = None, None
        if args.chat_template:
            if args.no_tokenizer:
                raise ExportError("--chat-template goes with the tokenizer: drop --no-tokenizer")
            try:
                template = Path(args.chat_template).read_text()
            except OSError as e:
                raise ExportError(f"--chat-template {args.chat_template}: {e}") from e
        if not args.no_tokenizer:
            tok = (
                Path(args.tokenizer) if args.tokenizer else exporter.find_tokenizer_dir(ckpt, meta)
            )
            if tok is None:
                raise ExportError(
                    f"no tokenizer.json found for {ckpt} (looked in the checkpoint meta and the "
                    "run directory); pass --tokenizer DIR or --no-tokenizer"
                )
        out = exporter.export_model(
            cfg,
            params,
            args.out,
            dtype=args.dtype,
            tokenizer_dir=tok,
            max_shard_bytes=int(args.max_shard_gb * 1024**3),
            max_len=args.max_len,
            source={"checkpoint": str(ckpt), "step": step},
            chat_template=template,
        )
    except ExportError as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {ckpt} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
