"""A run's set-up, in order: the configs, the data or task pipeline, the mesh, the model and its
state (restored or new), the run directory's files and logs, then the start-up lines (the
`note:` lines of what was chosen, and the model, mesh, batch, data and peak)."""

from __future__ import annotations

from pathlib import Path

import jax

from laplace_jax.sharding import CONTEXT, param_axes
from laplace_spec.config import ConfigError
from train import backend, cli, lost_peer
from train.build import build_model, restore_or_init
from train.checkpoint import Checkpointer
from train.config import batch_layout
from train.distributed import maybe_initialize_distributed
from train.loop import Trainer
from train.metrics import Metrics
from train.peak import mesh_peak
from train.pipelines import build_pipeline, doc_reset_eot, open_data, task_pipeline
from train.profiling import StepTrace
from train.run_dir import restart_aside, write_run_files
from train.step import measure_matmul_flops


def set_up(args) -> Trainer:
    """Configs, data, model, optimizer and state (restored or new), then the run files; prints
    the start-up lines. Nothing in the run directory changes before the restore has succeeded
    (but for what --restart moves aside, and corrupt checkpoints set aside by a restore)."""
    platform = backend.select(args.platform)  # before JAX starts a backend
    maybe_initialize_distributed(args.distributed, args.heartbeat_timeout)
    backend_note = backend.check(platform)  # an accelerator asked for and missing: ConfigError
    if jax.default_backend() == "neuron":
        jax.config.update("jax_default_prng_impl", "rbg")  # Threefry is not fully supported
    from laplace_jax.accounting import training_flops_per_token
    from laplace_jax.sharding import replicated_fallbacks

    cfg = cli.resolve_configs(args)
    profile_steps = cli.parse_profile_steps(args.profile_steps)
    main_proc = jax.process_index() == 0
    say = print if main_proc else (lambda *a, **k: None)
    run_dir = Path(args.run_dir)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "checkpoints"
    task = cli.parse_task_flag(args, cfg.model)
    if task is None:
        train_paths, val_paths, tokenizer_src = open_data(args, cfg.model, main_proc, say)
    else:
        train_paths, val_paths, tokenizer_src = [], [], None
    mesh = cli.mesh_from_flag(args.mesh)
    check_context_groups(mesh)
    layout = batch_layout(
        cfg.train,
        cfg.model.seq_len,
        mesh.size,
        jax.process_count(),
        mesh.shape.get(CONTEXT, 1),
        attention="attention" in cfg.model.layer_mixers,
    )
    if task is None:
        batches, val_batches, train_tokens = build_pipeline(cfg, layout, train_paths, val_paths)
    else:
        batches, val_batches, train_tokens = task_pipeline(cfg, layout, task)
    eot_id = doc_reset_eot(cfg.train, train_paths, task is not None, say)
    data_notes, shares = [], None
    if task is None and main_proc:  # how much same-document context the windows hold
        from train import doc_context
        from train.data import TokenWindows

        source = TokenWindows(train_paths, cfg.model.seq_len)
        shares = doc_context.context_shares(source, eot_id, mesh.shape.get(CONTEXT, 1))
        warning = doc_context.short_documents_warning(shares)
        data_notes = [doc_context.context_note(shares), *([warning] if warning else [])]
    parts = build_model(cfg, mesh, masked=task is not None, eot_id=eot_id)
    if args.restart:  # asked for, and the rest of the set-up is valid
        restart_aside(run_dir, ckpt_dir, say)
    ckpt = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints, cfg.train.async_checkpoints)
    lost_peer.PROGRESS.checkpointer = ckpt  # a peer lost while restoring: the line names them
    try:
        state, start, notes = restore_or_init(cfg, parts, ckpt, batches, args.init_from)
    except BaseException:
        ckpt.close()
        raise

    peak, peak_note = mesh_peak(mesh, cfg.train.peak_flops, measure_matmul_flops)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {"train": train_paths, "val": val_paths, "train_tokens": train_tokens}
    if shares is not None:
        data["context_shares"] = shares
    if task is not None:
        data = {"task": task[0], "task_params": task[1], "train_tokens": train_tokens}
    peak_record = {"flops_per_s": peak, "source": peak_note}
    meta = write_run_files(args, cfg, run_dir, tokenizer_src, mesh, layout, data, peak_record)
    metrics = Metrics(run_dir, start, main_proc)
    trace = StepTrace(profile_steps, run_dir / "profile", main_proc, start, cfg.train.steps, say)
    if trace.note:
        notes.append(trace.note)
    if metrics.superseded:
        notes.append(
            f"note: {metrics.superseded} lines of metrics.jsonl after step {start} (logged by an "
            f"earlier run past its last checkpoint) moved to metrics.superseded.jsonl"
        )
    notes.extend(data_notes)
    notes = [*([backend_note] if backend_note else []), backend.devices_line(), *notes, peak_note]
    fallbacks = replicated_fallbacks(cfg.model, mesh)
    if fallbacks:
        notes.append(replication_notice(fallbacks, mesh))
    t = Trainer(
        cfg=cfg,
        mesh=mesh,
        say=say,
        main_proc=main_proc,
        ckpt_dir=ckpt_dir,
        layout=layout,
        batches=batches,
        val_batches=val_batches,
        tokenizer_src=tokenizer_src,
        train_step=parts["train_step"],
        eval_step=parts["eval_step"],
        state=state,
        start=start,
        ckpt=ckpt,
        metrics=metrics,
        meta=meta,
        trace=trace,
        flops_per_token=training_flops_per_token(cfg.model),
        peak=peak,
        no_bar=args.no_progress,
    )
    announce(t, args.config, train_tokens, [*cfg.notices, *notes])
    return t


def check_context_groups(mesh) -> None:
    """Each process loads its own sequences, so every device of a context group (the devices
    that share one sequence) must belong to one process; ConfigError otherwise."""
    S = mesh.shape.get(CONTEXT, 1)
    groups = mesh.devices.reshape(-1, S)  # context is the innermost mesh axis
    split = [g for g in groups if len({d.process_index for d in g}) > 1]
    if split:
        raise ConfigError(
            f"--mesh: a context group of {S} devices spans processes "
            f"({sorted({d.process_index for d in split[0]})}); each process loads its own "
            "sequences, so use a context axis no larger than one process's devices"
        )


def replication_notice(fallbacks: list[str], mesh, show: int = 4) -> str:
    more = f"; and {len(fallbacks) - show} more" if len(fallbacks) > show else ""
    axes = param_axes(mesh)
    names = " x ".join((axes,) if isinstance(axes, str) else axes)
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in ((axes,) if isinstance(axes, str) else axes))
    return (
        f"note: {len(fallbacks)} parameters are replicated, not sharded: their {names} axis does "
        f"not divide by {sizes} (Muon orthogonalises each whole on every device): "
        + "; ".join(fallbacks[:show])
        + more
    )


def announce(t: Trainer, name: str, train_tokens: int, notes: list[str]) -> None:
    from laplace_jax.accounting import parameter_counts

    m, (B, A, M) = t.cfg.model, t.layout
    for line in notes:
        t.say(line)
    t.say(
        f"model {name}: {m.d_model}d x {m.n_layers}L"
        + (", softmax attention (baseline)" if m.token_mixer == "attention" else "")
        + (f", hybrid: attention every {m.attention_every} layers" if m.attention_every else "")
        + ", "
        f"{parameter_counts(m)['total_params'] / 1e6:.1f}M params; "
        f"mesh {cli.mesh_text(t.mesh)} ({jax.default_backend()}); "
        f"batch {B} x {m.seq_len} tokens (accum {A} x micro {M}); "
        f"{train_tokens:,} training tokens"
    )
