"""`python -m bench.device`: the accelerator evidence, one prepared command for a GPU.

    python -m bench.device                          # on a GPU machine -> bench/results/device.json
    python -m bench.device --dry-run [--out PATH]   # the same code paths at tiny shapes, on CPU
    python -m bench.device --parts gla,decode --budget train=300 ...

Four parts, each in its own child process with its own time budget (`run.BUDGETS`): the part
checks the clock between its measured rounds and stops with what it has, and the parent kills a
child that overruns its budget by `run.GRACE_S`, keeping what the child had saved. A part that
fails, runs out of memory or is killed is recorded as such; the other parts still run. Separate
processes also keep JAX and PyTorch from holding each other's GPU memory (each child sets its own
`XLA_PYTHON_CLIENT_*`).

    env     jax.devices(), torch.cuda, the versions of jax, jaxlib, torch, triton, fla-core, ...;
            what the other parts can run, and why not (the skips, printed and in the JSON)
    gla     forward + backward of our `gla_chunked` (jitted XLA) beside fla's Triton
            `chunk_simple_gla(g_gamma=...)` at the 3B head shapes (16 heads, d_k 96, d_v 192),
            T = 2,048 / 8,192 / 32,768 at 32,768 tokens per call, bf16 inputs, fp32 state; outputs
            and q, k, v gradients compared (`gla.TOLERANCE`), times in interleaved rounds;
            headline `gla_over_fla_triton_T8192` = our time / fla Triton's (median over rounds)
    train   the project's training step (`train.build.build_model`: `make_train_step`, bf16
            compute, fp32 master weights, Muon + AdamW, remat=layer, document resets at the EOT
            id) on Laplace 3B at seq 2,048 on one device, the largest micro-batch that fits
            (compiled sizes checked by XLA's memory analysis, out-of-memory caught); tokens/s,
            MFU against a bf16 matmul rate probed in the same rounds, and MFU against the device
            kind's published peak (train/peak.py, as the trainer logs it; the kind is recorded);
            headlines `train_tokens_per_s_3b`, `train_mfu_3b`, `train_mfu_published_peak_3b`;
            reference: the write-up's per-chip figure
    decode  the PyTorch model (`serve/`) with Laplace 3B bf16 weights (random init) and fp32
            state for 1,280 sequences, `DecodeRunner` compiled (inductor) at that fixed width,
            greedy tokens fed back; eager rounds beside it; headline
            `decode_tokens_per_s_3b_1280`; reference: the write-up's whole trn2.48xlarge

`--dry-run` runs every part's code at small shapes on whatever is there (here: CPU): the GLA part
at the `small` preset's head shapes against flash-linear-attention's naive PyTorch reference (the
parity code of the Triton comparison; the Triton kernel itself is skipped without CUDA, with its
reason), the training step of the `tiny` preset, decode of 2 sequences of `tiny` compiled with
torch.compile's `eager` backend (graph capture, no C++ toolchain). Dry-run headline values are
null: they are not 3B figures; each part's own figures are in `parts`. The dry run never writes
bench/results/device.json (default: a file in the temp directory).

JSON (bench/results/device.json, or --out):
    headline      the four keys above (null where not measured: skipped, failed, dry run)
    machine       bench.common.machine_info(); date (UTC), wall_s, dry_run, budgets_s
    environment   the env part's findings; skips: [{part, what, reason}] over all parts
    parts         {gla, train, decode}: status (ok | partial | skipped | error | timeout |
                  crashed), elapsed_s, their measurements, errors (with traceback tails)
    references    the write-up's figures the headlines stand beside (docs/design.md s6)

JAX: the project pins 0.10.0, the GPU machine has 0.11.2. This package uses only APIs present in
both: jax.jit / vjp / device_put / block_until_ready, jax.devices() and Device.memory_stats()
(None on CPU), jax.random.key, jax.tree.leaves, Array.is_deleted(),
`jit(...).lower(ShapeDtypeStruct with sharding).compile()` and Compiled.memory_analysis() (as
train/plan.py); an out-of-memory is recognised by its message (RESOURCE_EXHAUSTED / out of
memory), not by an exception class whose module moved between releases. The project code it
drives (laplace_jax.fsdp: jax.shard_map; laplace_jax.muon) is unchanged. Nothing here has run on
0.11.2 yet: a break there is recorded as the part's error and the other parts still run.
"""
