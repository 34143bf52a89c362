"""Orbax checkpoint -> model folder (config.json, safetensors, tokenizer files).

Folder layout written by `export_model`:

    config.json                    HF style: architectures, model_type "laplace", every
                                   LaplaceConfig field, torch_dtype, token ids
    model.safetensors              one file, or above `max_shard_bytes`:
    model-00001-of-0000N.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, generation_config.json (copied or written)
    chat_template.jinja            the tokenizer's, one given, or the plain default
                                   (`write_chat_template`)
    vllm_serve.yaml                vLLM's settings for it, whatever the platform (`vllm serve
                                   FOLDER --config FOLDER/vllm_serve.yaml`; the adapter reads it)
    export_meta.json               where it came from (checkpoint dir, step, dtype)
    config.py, names.py, kernels.py,     Hugging Face remote code (`REMOTE_CODE`): config.json's
    configuration_laplace.py,            `auto_map` names the two classes, so any transformers
    modeling_laplace.py                  process loads the folder with trust_remote_code=True

Only `read_checkpoint` touches orbax (train/checkpoint.py's reader, imported lazily); the rest
is numpy (and flax's `flatten_dict`), so the checks and the writer are testable and reusable
without a checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax.traverse_util import flatten_dict

from laplace_spec import names
from laplace_spec.config import DEFAULT_SERVE_LENGTH, LaplaceConfig
from laplace_spec.tokenizer_files import TOKENIZER_FILES, folder_end_of_text
from laplace_spec.vllm_settings import vllm_settings, write_settings

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3  # 2 GiB per safetensors file, as HF writes them


class ExportError(ValueError):
    """The checkpoint cannot be exported; the message says what and where."""


# ---- reading the checkpoint (train/checkpoint.py's reader, the one orbax reader) --------------


def read_checkpoint(checkpoint_dir: str | Path, step: int | None = None):
    """Read the 'params' item (and the 'meta' item if present) of an orbax checkpoint.

    Returns (params: nested dict of numpy arrays in host memory, step: int, meta: dict | None).
    The optimizer state and the data-iterator state are never read.
    """
    from train.checkpoint import CheckpointReader, ReadError  # JAX side only

    try:
        with CheckpointReader(checkpoint_dir) as reader:
            step = reader.step(step)
            return reader.params(step), step, reader.meta(step)
    except ReadError as e:
        raise ExportError(str(e)) from e


# ---- checks and conversion (numpy only) -------------------------------------------------------


def check_params(cfg: LaplaceConfig, flat: Mapping[str, np.ndarray]) -> None:
    """Every JAX parameter the table expects, with its shape, and nothing else."""
    expected = {e.jax_path: e.jax_shape for e in names.table(cfg)}
    problems = names.mismatches(expected, {p: x.shape for p, x in flat.items()}, "parameter")
    if problems:
        raise ExportError("checkpoint parameters do not match the config: " + "; ".join(problems))


class ConvertedTensors(Mapping):
    """{exported name: array in exported layout and dtype}, converted when read.

    Writing reads each tensor once, so an export holds the checkpoint plus one converted
    tensor at a time (3B in fp32: 12 GB, not 24 GB).
    """

    def __init__(self, cfg: LaplaceConfig, flat: Mapping[str, np.ndarray], dtype: str):
        self.entries = {e.name: e for e in names.table(cfg)}
        self.flat = flat
        self.dtype = np.dtype(_np_dtype(dtype))

    def __getitem__(self, name: str) -> np.ndarray:
        e = self.entries[name]
        x = e.to_exported(np.asarray(self.flat[e.jax_path], dtype=np.float32))
        return np.ascontiguousarray(x.astype(self.dtype))

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype without converting."""
        return self.entries[name].shape, self.dtype


def convert(cfg: LaplaceConfig, params: Mapping, dtype: str = "fp32") -> ConvertedTensors:
    """Flax params (nested or flat) -> exported tensors (lazy), after checking every one."""
    if cfg.token_mixer != "gla":  # the PyTorch and vLLM models are Laplace's (GLA) only
        raise ExportError(
            f"token_mixer={cfg.token_mixer!r} is the retrieval baseline (trained and evaluated "
            "in JAX); only token_mixer='gla' checkpoints export"
        )
    flat = flatten_dict(dict(params), sep="/")  # flat `/` paths pass through unchanged
    check_params(cfg, flat)
    out = ConvertedTensors(cfg, flat, dtype)
    names.check_tensors(cfg, {k: out.spec(k)[0] for k in out}, side="export")
    return out


def _np_dtype(dtype: str):
    if dtype in ("fp32", "float32"):
        return np.float32
    if dtype in ("bf16", "bfloat16"):
        import ml_dtypes  # ships with JAX

        return ml_dtypes.bfloat16
    raise ExportError(f"dtype must be fp32 or bf16, got {dtype!r}")


# ---- writing ---------------------------------------------------------------------------------

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _spec(tensors: Mapping, name: str) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(tensors, "spec"):
        return tensors.spec(name)
    x = tensors[name]
    return tuple(x.shape), np.dtype(x.dtype)


def _nbytes(tensors: Mapping, name: str) -> int:
    shape, dtype = _spec(tensors, name)
    return math.prod(shape) * dtype.itemsize


def write_safetensors(path: Path, tensors: Mapping, names_: list[str], metadata=None) -> None:
    """Minimal safetensors writer (8-byte header length, JSON header, raw little-endian data).

    Written here rather than with `safetensors.numpy` so bf16 (ml_dtypes) needs no torch, and
    so tensors are converted and written one at a time.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in names_:
        shape, dtype = _spec(tensors, name)
        n = _nbytes(tensors, name)
        header[name] = {
            "dtype": _ST_DTYPES[dtype.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names_:
            x = np.ascontiguousarray(tensors[name])
            assert x.nbytes == header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            f.write(x.tobytes())


def write_weights(out_dir: Path, tensors: Mapping, max_shard_bytes: int) -> None:
    """One model.safetensors, or shards plus model.safetensors.index.json above the limit."""
    total = sum(_nbytes(tensors, name) for name in tensors)
    if total <= max_shard_bytes:
        write_safetensors(out_dir / "model.safetensors", tensors, list(tensors))
        return
    shards: list[list[str]] = [[]]
    size = 0
    for name in tensors:
        n = _nbytes(tensors, name)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / fname, tensors, shard)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hf_config(
    cfg: LaplaceConfig, dtype: str, token_ids: Mapping[str, int | None], max_len: int
) -> dict:
    """config.json contents: every LaplaceConfig field plus what HF/vLLM look for."""
    return {
        "architectures": [cfg.architecture],
        "model_type": "laplace",
        **cfg.to_dict(),
        "layer_types": cfg.layer_types,  # each layer's kind, as hybrid models' configs name it
        "torch_dtype": "bfloat16" if dtype in ("bf16", "bfloat16") else "float32",
        # The state is fixed-size, so any length is servable; this is the serving limit.
        "max_position_embeddings": int(max_len),
        "tie_word_embeddings": False,
        "auto_map": dict(AUTO_MAP),  # the remote code beside config.json (`write_remote_code`)
        **{k: v for k, v in token_ids.items() if v is not None},
    }


# ---- Hugging Face remote code ------------------------------------------------------------------
#
# The serving modules, copied into the folder so that a process without this package loads it
# (`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`, lm-eval's `hf` backend).
# Each keeps its file name; its imports of this repo's packages (`from laplace_spec.config import
# X`, `from serve.kernels import Y`) become imports of the sibling file (`from .config import X`),
# the form transformers' dynamic-module loader follows. Nothing else in the files changes.

REMOTE_CODE = (  # module -> <name>.py in the folder (the names must stay distinct)
    "laplace_spec.config",
    "laplace_spec.names",
    "serve.kernels",
    "serve.configuration_laplace",
    "serve.modeling_laplace",
)
AUTO_MAP = {
    "AutoConfig": "configuration_laplace.LaplaceHFConfig",
    "AutoModelForCausalLM": "modeling_laplace.LaplaceForCausalLM",
}
_PACKAGE_IMPORT = re.compile(r"^(\s*)from (?:laplace_spec|serve)\.(\w+) import ", re.MULTILINE)
_ANY_PACKAGE_IMPORT = re.compile(r"^\s*(?:from|import) (?:laplace_spec|serve)\b.*$", re.MULTILINE)


def remote_code_source(module: str) -> str:
    """`module`'s source with its package imports made relative (see `REMOTE_CODE`)."""
    spec = importlib.util.find_spec(module)  # the file only: nothing of it is executed
    text = Path(spec.origin).read_text()
    local = {m.rsplit(".", 1)[1] for m in REMOTE_CODE}
    for m in _PACKAGE_IMPORT.finditer(text):
        if m.group(2) not in local:
            raise ExportError(f"{module} imports {m.group(0).split()[1]}, not in REMOTE_CODE")
    text = _PACKAGE_IMPORT.sub(r"\1from .\2 import ", text)
    left = _ANY_PACKAGE_IMPORT.findall(text)
    if left:  # e.g. `from laplace_spec import names`: transformers would not copy names.py
        raise ExportError(f"{module}: write package imports as `from pkg.mod import X`: {left}")
    origin = module.replace(".", "/") + ".py"
    return f"# {origin}, copied by export/exporter.py (package imports made relative)\n" + text


def write_remote_code(out_dir: Path) -> list[str]:
    """Copy the `REMOTE_CODE` modules into the folder; returns the file names written."""
    written = []
    for module in REMOTE_CODE:
        fname = module.rsplit(".", 1)[1] + ".py"
        (out_dir / fname).write_text(remote_code_source(module))
        written.append(fname)
    return written


def find_tokenizer_dir(checkpoint_dir: Path, meta: Mapping | None) -> Path | None:
    """The training run's tokenizer: meta's reference, else beside the checkpoints dir."""
    candidates = []
    ref = (meta or {}).get("tokenizer")
    if isinstance(ref, Mapping):
        ref = ref.get("path") or ref.get("dir")
    if isinstance(ref, str):
        p = Path(ref)
        candidates += [p, checkpoint_dir.parent / p]
    run_dir = checkpoint_dir.parent
    candidates += [run_dir, run_dir / "tokenizer", checkpoint_dir]
    for c in candidates:
        if c.is_file() and c.name == "tokenizer.json":
            return c.parent
        if (c / "tokenizer.json").is_file():
            return c
    return None


def copy_tokenizer(
    src: Path, out_dir: Path, chat_template: str | None = None
) -> dict[str, int | None]:
    """Copy the tokenizer files; write tokenizer_config / generation_config when absent, and the
    chat template (`write_chat_template`).

    Returns the special token ids found (bos/eos/pad) for config.json.
    """
    if not (src / "tokenizer.json").is_file():
        raise ExportError(f"no tokenizer.json in {src}")
    same = src.resolve() == out_dir.resolve()
    for fname in TOKENIZER_FILES:
        if not same and (out_dir / fname).is_file() and fname != "tokenizer.json":
            (out_dir / fname).unlink()  # an earlier export's, not this tokenizer's
        if not same and (src / fname).is_file():
            shutil.copyfile(src / fname, out_dir / fname)
    eos = folder_end_of_text(out_dir)  # the rule train.prepare separated documents by
    eos_tok = eos[0] if eos else None
    write_chat_template(out_dir, chat_template, eos_tok)
    ids = {"eos_token_id": eos[1] if eos else None, "bos_token_id": None}
    if not (out_dir / "tokenizer_config.json").is_file():
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
        if eos_tok:
            tc.update(eos_token=eos_tok, bos_token=eos_tok)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    if not (out_dir / "generation_config.json").is_file():
        gc = {k: v for k, v in ids.items() if v is not None}
        (out_dir / "generation_config.json").write_text(json.dumps(gc, indent=2) + "\n")
    return ids


DEFAULT_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def write_chat_template(out_dir: Path, template: str | None, eos_token: str | None) -> str:
    """The folder's chat template, as transformers and vLLM read it (`chat_template.jinja` beside
    tokenizer.json): `template` when given (it replaces the tokenizer's own), else the tokenizer's
    own (a chat_template.jinja or tokenizer_config.json's `chat_template`), else
    DEFAULT_CHAT_TEMPLATE, the plain role-tagged template of a base model, which separates turns
    by the end-of-text token `eos_token` (none without one: said on stderr). Returns which."""
    path = out_dir / "chat_template.jinja"
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if template is None and (path.is_file() or config.get("chat_template")):
        return "the tokenizer's"
    if template is None and eos_token is None:
        print(
            "export: no chat template written: the plain one separates turns by the end-of-text "
            "token, and this tokenizer has none (give --chat-template FILE)",
            file=sys.stderr,
        )
        return "none"
    if template is not None and "chat_template" in config:  # one template, not two
        del config["chat_template"]
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    text = DEFAULT_CHAT_TEMPLATE.read_text() if template is None else template
    check_chat_template(text, eos_token)
    path.write_text(text)
    return "given" if template is not None else "the plain default"


def check_chat_template(text: str, eos_token: str | None) -> None:
    """ExportError when `text` is not a Jinja template that renders a conversation, in the
    environment transformers renders chat templates in (where jinja2 is installed: it comes with
    transformers and vLLM)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    try:
        special = {} if eos_token is None else {"eos_token": eos_token}  # as transformers
        env.from_string(text).render(messages=messages, add_generation_prompt=True, **special)
    except jinja2.TemplateError as e:
        raise ExportError(f"the chat template does not render a conversation: {e}") from e


def export_model(
    cfg: LaplaceConfig,
    params: Mapping,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    max_len: int | None = None,
    source: Mapping | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a model folder from a Flax params tree (nested dict or flat `/` paths);
    `chat_template` replaces the tokenizer's (`write_chat_template`)."""
    tensors = convert(cfg, params, dtype)  # checks everything before writing anything
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    write_weights(out_dir, tensors, max_shard_bytes)
    ids: dict[str, int | None] = {}
    if tokenizer_dir is not None:
        ids = copy_tokenizer(Path(tokenizer_dir), out_dir, chat_template)
    config = hf_config(cfg, dtype, ids, max_len or max(DEFAULT_SERVE_LENGTH, cfg.seq_len))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_settings(out_dir, vllm_settings(cfg, dtype))  # what vllm serve and the adapter read
    write_remote_code(out_dir)
    meta = {"dtype": dtype, "n_tensors": len(tensors), **dict(source or {})}
    (out_dir / "export_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir
