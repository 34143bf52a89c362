"""Orbax checkpoints of a training run: save asynchronously, keep the last N, restore safely.

A checkpoint is an orbax Composite of four items (evaluation and export read `params` and `meta`
through `CheckpointReader`, the one read-only reader):

- `params`: the plain Flax params dict (docs/parameters.md), fp32;
- `opt_state`: the optax optimizer state;
- `data`: the grain iterator state (a small JSON dict), so a resumed run sees the next batch;
- `meta`: JSON with the step, the model config, the optimizer and training configs and the
  tokenizer reference.

Restoring takes target shardings, so a checkpoint written on 8 devices restores onto 4 (or 64).
`restore_latest` tries the checkpoints newest first and sorts every failure into one of two kinds:

- corrupt: its data is missing or undecodable (a missing or truncated array file, JSON that does
  not parse, an item that is absent, tensorstore's NOT_FOUND, DATA_LOSS, OUT_OF_RANGE,
  FAILED_PRECONDITION or INVALID_ARGUMENT). It is skipped with a warning for the next older one;
  once an older one restores, the corrupt newer ones are moved into the sibling directory
  `<checkpoint dir>-corrupt/` (kept, and out of the way of the steps the run saves again). When
  every checkpoint is corrupt, `NoUsableCheckpoint` is raised and nothing is moved.
- anything else stops the run with a `RestoreError`, and nothing on disk is changed: a model
  config in the checkpoint's meta that differs from the requested one (`ConfigMismatch`, naming
  the fields); saved parameter or optimizer-state trees whose paths or shapes differ from what
  this run builds (`LayoutMismatch`, naming the paths; compared from orbax's metadata before any
  array is read); any other error (permission denied, an I/O error, an unknown exception).

The optimizer config is not compared: a new learning rate or run length is a legitimate change
on resume (the trainer prints what changed); a changed optimizer-state layout is refused by the
layout check.

In a multi-process run all processes try the same steps (process 0's list) in the same order and
agree on each outcome (the worst over the processes wins), so they all restore the same step or
all stop.

Full disks: before each save the free space is compared with the checkpoint's size (its arrays'
bytes); a checkpoint that cannot fit is not started, and `DiskFull` names the step, the
directory, the size and the free space, and the checkpoints that remain complete. A save that
runs out of space while writing all the same (ENOSPC, tensorstore's RESOURCE_EXHAUSTED: another
writer filled the disk) raises the same `DiskFull`; its partial checkpoint stays as orbax's
temporary folder (`unfinished_saves`), which the next start removes. Either way the run resumes
from the newest complete checkpoint once space is freed. A save a lost peer left unfinished
(train/lost_peer.py) is the same: never restored, removed by the next start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from laplace_spec.config import saved_before

ITEMS = ("params", "opt_state", "data", "meta")
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's: <step>.orbax-checkpoint-tmp[-<time>], unfinished

# tensorstore status codes (the start of its error messages) that mean missing or undecodable data
CORRUPT_STATUS = (
    "NOT_FOUND",
    "DATA_LOSS",
    "OUT_OF_RANGE",
    "FAILED_PRECONDITION",
    "INVALID_ARGUMENT",
)


class RestoreError(RuntimeError):
    """A checkpoint could not be restored and the run must stop; nothing on disk was changed."""


class ConfigMismatch(RestoreError):
    """The checkpoint was written for another model configuration."""


class LayoutMismatch(RestoreError):
    """The checkpoint's saved trees (paths, shapes) differ from the ones this run builds."""

    def __init__(self, where: Path, problems: list[str], show: int = 12):
        self.problems = problems
        more = [f"... and {len(problems) - show} more"] if len(problems) > show else []
        super().__init__(
            f"checkpoint {where} holds other arrays than this run builds:\n  "
            + "\n  ".join(problems[:show] + more)
            + "\nnothing was changed; use another --run-dir/--ckpt-dir, or the code and "
            "configuration that wrote it"
        )


class NoUsableCheckpoint(RestoreError):
    """Every checkpoint of the directory is corrupt."""

    def __init__(self, directory: Path, corrupt: list[tuple[int, str]]):
        self.directory, self.corrupt = directory, corrupt
        lines = "".join(f"\n  {directory / str(s)}: {why}" for s, why in corrupt)
        super().__init__(
            f"no checkpoint in {directory} can be restored; every one is corrupt:{lines}\n"
            "nothing was changed"
        )


class DiskFull(RuntimeError):
    """A write of the run's (a checkpoint or the metrics log) failed for lack of space."""

    def __init__(self, what: str, directory: Path, needed: int | None, complete: list[int]):
        free = shutil.disk_usage(_existing(directory)).free
        size = f"it needs about {_size(needed)}, " if needed is not None else ""
        kept = ", ".join(str(s) for s in complete) or "none"
        then = "resumes from the newest complete checkpoint" if complete else "starts at step 0"
        super().__init__(
            f"no space left on the device: {what} ({size}{_size(free)} free at {directory}). "
            f"Complete checkpoints: {kept}. Free some space and rerun the same command: the run "
            f"{then}"
        )


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from, says the device is out of space."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "No space left on device" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (disk_usage needs one)."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


class CorruptCheckpointWarning(RuntimeWarning):
    """A corrupt checkpoint was skipped for an older one."""


def config_diff(saved: dict, requested: dict) -> list[str]:
    """`["d_model: checkpoint 64, requested 128", ...]` for every differing field."""
    out = []
    for key in sorted(set(saved) | set(requested)):
        a, b = saved.get(key, "<absent>"), requested.get(key, "<absent>")
        if a != b:
            out.append(f"{key}: checkpoint {a!r}, requested {b!r}")
    return out


def check_compatible(meta: dict, requested: dict[str, dict], where: str) -> None:
    """Raise ConfigMismatch if any of the `requested` config dicts differs from the saved one."""
    problems = []
    for section, want in requested.items():
        have = meta.get(section)
        if have is None:
            continue
        if section == "model":  # fields added since it was saved: the values it was trained as
            have = {**saved_before(have), **have}
        problems += [f"{section}.{d}" for d in config_diff(have, want)]
    if problems:
        raise ConfigMismatch(
            f"checkpoint {where} was written for a different configuration; differing fields:\n  "
            + "\n  ".join(problems)
            + "\nnothing was changed; use another --run-dir/--ckpt-dir, or the checkpoint's "
            "configuration"
        )


def layout_diff(saved_tree, target_tree, item: str) -> list[str]:
    """Paths whose presence or shape differs between a saved tree (orbax array metadata) and the
    target (arrays or ShapeDtypeStructs), as `"params/layer_2/w12/kernel: ..."` lines."""
    saved = ocp.tree.to_flat_dict(saved_tree)
    want = ocp.tree.to_flat_dict(target_tree)
    out = []
    for key in sorted(set(saved) | set(want), key=lambda k: tuple(map(str, k))):
        name = "/".join([item, *map(str, key)])
        if key not in want:
            out.append(f"{name}: in the checkpoint, not in this run")
        elif key not in saved:
            out.append(f"{name}: in this run, not in the checkpoint")
        elif tuple(saved[key].shape) != tuple(want[key].shape):
            out.append(
                f"{name}: checkpoint {list(saved[key].shape)}, this run {list(want[key].shape)}"
            )
    return out


def corruption(e: BaseException) -> BaseException | None:
    """The exception in `e`'s chain that shows missing or undecodable checkpoint data, or None
    when the error is something else (permission, I/O, a bug), which must not be skipped."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FileNotFoundError | json.JSONDecodeError | UnicodeDecodeError):
            return e
        if isinstance(e, OSError):
            return None  # permission denied, I/O error, ...: not the checkpoint's content
        if isinstance(e, KeyError) and "not found in the checkpoint" in str(e):
            return e  # orbax: an item's directory is absent
        if isinstance(e, ValueError) and str(e).split(":", 1)[0].strip() in CORRUPT_STATUS:
            return e  # tensorstore
        e = e.__cause__ or e.__context__
    return None


@dataclasses.dataclass
class _Attempt:
    """One process's outcome of restoring one step: a result, a corruption, or an error."""

    result: dict[str, Any] | None = None
    corrupt: str | None = None
    error: Exception | None = None

    @property
    def code(self) -> int:  # ordered by severity, for the agreement over processes
        return 0 if self.result is not None else 1 if self.corrupt is not None else 2


class _Corrupt(Exception):
    pass


class Checkpointer:
    """A thin wrapper over `ocp.CheckpointManager` with the run's four items."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.pending: tuple[int, int] | None = None  # (step, bytes) of the save in flight
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
                cleanup_tmp_directories=True,  # saves a run left unfinished (unfinished_saves)
            ),
            item_handlers=_item_handlers(),
        )
        # Restores go through a read-only manager of this process alone: orbax ends every
        # restore with a barrier of its active processes, and a process whose read fails skips
        # it, which would leave the others waiting (and every later barrier out of step). Each
        # process reads its own shards with no barrier; `restore_latest` then makes them agree.
        me = jax.process_index()
        self.reader = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                read_only=True,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=me, active_processes={me}
                ),
            ),
            item_handlers=_item_handlers(),
        )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, data_state: dict, meta: dict) -> None:
        """Start an asynchronous save (the arrays are copied before this returns).

        Raises `DiskFull`, with nothing written, when the free space is smaller than the
        checkpoint (after the previous save has finished: orbax waits for it anyway), and when
        this save or the previous one runs out of space while writing."""
        self.wait()
        needed = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
        free = shutil.disk_usage(_existing(self.directory)).free
        if not _agreed(free >= needed):  # process 0's view, so every process stops together
            what = f"the checkpoint of step {step} was not started"
            raise DiskFull(what, self.directory, needed, self.complete_steps())
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave({**meta, "step": step}),
        )
        with self._out_of_space(f"saving the checkpoint of step {step} failed", needed):
            self.manager.save(step, args=args, force=True)
        self.pending = (step, needed)

    @contextlib.contextmanager
    def _out_of_space(self, what: str, needed: int | None):
        """Turn a lack of space in the block (or in the save still in flight) into DiskFull."""
        try:
            yield
        except Exception as e:
            if not is_disk_full(e):
                raise
            if self.pending is not None:  # an asynchronous save's error shows up at the next call
                what = f"saving the checkpoint of step {self.pending[0]} failed"
                needed = self.pending[1]
            self.pending = None
            raise DiskFull(what, self.directory, needed, self.complete_steps()) from None

    def complete_steps(self) -> list[int]:
        """The steps whose checkpoints are complete on disk (orbax's finalised directories)."""
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def unfinished_saves(self) -> list[str]:
        """orbax's temporary directories of saves that were never committed (a process lost or a
        disk full while writing): no restore takes them, and the next start removes them."""
        return sorted(p.name for p in self.directory.iterdir() if TMP_SUFFIX in p.name)

    def read_meta(self, step: int) -> dict:
        return self.reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def restore_latest(
        self,
        abstract_params,
        abstract_opt_state,
        requested: dict[str, dict] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> dict[str, Any] | None:
        """Newest restorable checkpoint as {step, params, opt_state, data, meta}; None when the
        directory has no checkpoint. Corrupt ones are skipped (`warn` is told, by default as a
        CorruptCheckpointWarning); `RestoreError` otherwise (see the module docstring).

        `abstract_*` are pytrees of `jax.ShapeDtypeStruct` carrying the target shardings.
        """
        warn = warn or _warn
        skipped: list[tuple[int, str]] = []
        for step in reversed(_agreed_steps(self.all_steps())):
            where = self.directory / str(step)
            attempt = self._attempt(step, abstract_params, abstract_opt_state, requested)
            verdict = _worst_over_processes(attempt.code)
            if verdict == 0:
                self._set_aside([s for s, _ in skipped], warn)
                return attempt.result
            if verdict == 2:
                raise attempt.error or RestoreError(
                    f"checkpoint {where}: another process could not restore it (see its output); "
                    "nothing was changed"
                )
            why = attempt.corrupt or "another process found it corrupt (see its output)"
            warn(f"checkpoint {where} is corrupt ({why}); skipping it")
            skipped.append((step, why))
        if skipped:
            raise NoUsableCheckpoint(self.directory, skipped)
        return None

    def _attempt(self, step, abstract_params, abstract_opt_state, requested) -> _Attempt:
        where = str(self.directory / str(step))
        try:
            meta = _read("meta", lambda: self.read_meta(step))
            check_compatible(meta, requested or {}, where)
            self._check_layout(step, {"params": abstract_params, "opt_state": abstract_opt_state})
            restored = _read(
                "restore",
                lambda: self.reader.restore(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(abstract_params),
                        opt_state=ocp.args.StandardRestore(abstract_opt_state),
                        data=ocp.args.JsonRestore(),
                    ),
                ),
            )
        except _Corrupt as e:
            return _Attempt(corrupt=str(e))
        except RestoreError as e:
            return _Attempt(error=e)
        except Exception as e:  # noqa: BLE001 - not corruption: stop, naming it
            error = RestoreError(
                f"checkpoint {where} could not be read: {_short(_root(e))}\n"
                "this is not missing or undecodable data, so the checkpoint is not skipped; "
                "nothing was changed: fix the cause and run again"
            )
            error.__cause__ = e
            return _Attempt(error=error)
        return _Attempt(
            result={
                "step": step,
                "params": restored["params"],
                "opt_state": restored["opt_state"],
                "data": restored["data"],
                "meta": meta,
            }
        )

    def _check_layout(self, step: int, targets: dict) -> None:
        """LayoutMismatch unless the saved arrays' paths and shapes are the targets', read from
        orbax's metadata (no array data); `_Corrupt` when that metadata is unreadable."""
        metadata = _read("metadata", lambda: self.reader.item_metadata(step))
        problems = []
        for item, target in targets.items():
            saved = metadata.get(item) if hasattr(metadata, "get") else None
            if saved is None:
                raise _Corrupt(f"{item}: no array metadata")
            problems += layout_diff(getattr(saved, "tree", saved), target, item)
        if problems:
            raise LayoutMismatch(self.directory / str(step), problems)

    def _set_aside(self, steps: list[int], warn: Callable[[str], None]) -> None:
        """Move corrupt checkpoints into `<dir>-corrupt/` (process 0; the others wait)."""
        if not steps:
            return
        aside = self.directory.with_name(self.directory.name + "-corrupt")
        if jax.process_index() == 0:
            aside.mkdir(parents=True, exist_ok=True)
            for step in steps:
                dest = aside / str(step)
                if dest.exists():
                    dest = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                (self.directory / str(step)).rename(dest)
                warn(f"moved corrupt checkpoint {self.directory / str(step)} to {dest}")
        multihost_utils.sync_global_devices("laplace: corrupt checkpoints set aside")
        self.manager.reload()
        self.reader.reload()

    def wait(self) -> None:
        """Wait for the save in flight; DiskFull when it ran out of space."""
        with self._out_of_space("a checkpoint save failed", None):
            self.manager.wait_until_finished()
        self.pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()
            self.reader.close()

    def abandon(self) -> None:
        """After a failed save: stop orbax's writers, without reporting that failure again."""
        for stop in (self.manager.wait_until_finished, self.manager.close, self.reader.close):
            with contextlib.suppress(Exception):
                stop()
        self.pending = None


class ReadError(RuntimeError):
    """A checkpoint cannot be read for evaluation or export; the message names it and why."""


class CheckpointReader:
    """Read-only access to a checkpoint directory for evaluation and export: the one reader
    besides `Checkpointer.restore_latest` (which resumes training and handles corruption).

        with CheckpointReader(run / "checkpoints") as reader:
            step = reader.step(None)                      # the newest complete step
            meta = reader.meta(step)                      # the JSON item, or None
            params = reader.params(step, target)          # placed as `target` says

    Every failure is a `ReadError` naming the checkpoint: no such directory or step, an
    incomplete save, a missing `params` item, corrupt or unreadable data (as `corruption`
    judges it), parameters whose paths or shapes differ from the target.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()
        if not self.directory.is_dir():
            raise ReadError(f"checkpoint directory not found: {self.directory}")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(read_only=True),
            item_handlers={k: v for k, v in _item_handlers().items() if k in ("params", "meta")},
        )

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.manager.close()

    def step(self, step: int | None) -> int:
        """`step` if a finished save of it exists (None: the newest one)."""
        steps = sorted(self.manager.all_steps())
        if step is None:
            if not steps:
                raise ReadError(f"no checkpoint steps under {self.directory}")
            return steps[-1]
        if step not in steps:
            if (self.directory / str(step)).is_dir():
                raise ReadError(
                    f"checkpoint {self.directory / str(step)} is incomplete (no finished save "
                    f"of step {step})"
                )
            raise ReadError(f"step {step} not in {self.directory} (steps: {steps})")
        return step

    def meta(self, step: int) -> dict | None:
        """The `meta` JSON item of `step`, or None when it has none."""
        if not (self.directory / str(step) / "meta").exists():
            return None
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return self._read(step, "its meta", lambda: self.manager.restore(step, args=args)["meta"])

    def params(self, step: int, target=None) -> dict:
        """The `params` item of `step`. `target`: `jax.ShapeDtypeStruct`s with shardings (e.g.
        `abstract_with_shardings(abstract_params(cfg), param_shardings(cfg, mesh))`), checked
        against the saved paths and shapes before any array is read; None: the saved layout,
        as numpy arrays in host memory (the exporter)."""
        where = self.directory / str(step)
        if not (where / "params").exists():
            items = sorted(p.name for p in where.iterdir() if not p.name.startswith("_"))
            listed = ", ".join(items)
            raise ReadError(f"checkpoint {where} has no 'params' item (items: {listed})")
        saved = self._read(step, "its parameter metadata", lambda: self._saved_tree(step))
        if saved is None:
            raise ReadError(f"checkpoint {where} is corrupt: it holds no parameters")
        to_host = target is None
        if to_host:
            host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=host), saved
            )
        else:
            problems = layout_diff(saved, target, "params")
            if problems:
                raise ReadError(
                    f"checkpoint {where} holds other parameters than its model config builds:\n  "
                    + "\n  ".join(problems[:12])
                )
        args = ocp.args.Composite(params=ocp.args.StandardRestore(target))
        restore = lambda: self.manager.restore(step, args=args)  # noqa: E731
        restored = self._read(step, "its parameters", restore)
        params = jax.block_until_ready(restored["params"])
        return jax.tree.map(np.asarray, params) if to_host else params

    def _saved_tree(self, step: int):
        metadata = self.manager.item_metadata(step)
        saved = metadata.get("params") if hasattr(metadata, "get") else None
        return getattr(saved, "tree", saved)

    def _read(self, step: int, what: str, fn):
        """fn(), its failure a ReadError: `checkpoint W is corrupt: ...` when the data is missing
        or undecodable, else `... cannot be read: ...` (permission, I/O)."""
        try:
            return fn()
        except ReadError:
            raise
        except Exception as e:
            kind = "is corrupt" if corruption(e) is not None else "cannot be read"
            where = self.directory / str(step)
            detail = _short(_root(e))
            raise ReadError(f"checkpoint {where} {kind}: {what} cannot be read ({detail})") from e


def _item_handlers() -> dict:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _read(what: str, fn):
    """fn(), with an error that shows corrupt data turned into `_Corrupt` naming `what`."""
    try:
        return fn()
    except Exception as e:
        cause = corruption(e)
        if cause is None:
            raise
        raise _Corrupt(f"{what}: {_short(cause)}") from e


def _agreed(flag: bool) -> bool:
    """Process 0's `flag`, on every process."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _agreed_steps(local: list[int]) -> list[int]:
    """Process 0's list of steps, on every process."""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(local))))
    if n == 0:
        return []
    mine = np.asarray(local if jax.process_index() == 0 else [0] * n, np.int32)
    return [int(s) for s in multihost_utils.broadcast_one_to_all(mine)]


def _worst_over_processes(code: int) -> int:
    return int(np.max(multihost_utils.process_allgather(np.int32(code))))


def _root(e: BaseException) -> BaseException:
    """The innermost exception `e` was raised from (orbax wraps tensorstore's errors)."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return e


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 300 else text[:300] + "..."


def _warn(message: str) -> None:
    warnings.warn(message, CorruptCheckpointWarning, stacklevel=3)
