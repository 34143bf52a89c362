"""Serve an exported Laplace folder with the unmodified vLLM engine.

    # OpenAI-compatible server on 127.0.0.1 (stop it by its process id)
    python -m serve.vllm_adapter --model exported/ --port 8000
    # offline generation: one completion per --prompt
    python -m serve.vllm_adapter --model exported/ --prompt "Once upon" --max-tokens 32 --json

The model class is `serve/vllm_model.py`; it is registered by `serve/vllm_plugin.py` (the
`vllm.general_plugins` entry point, so any vLLM process finds it, `vllm serve` too; registered
here too). The export's platform-free settings are its `vllm_serve.yaml`
(laplace_spec/vllm_settings.py), which `vllm serve FOLDER --config FOLDER/vllm_serve.yaml` reads
as well; the rest are defaults per platform (vLLM's `current_platform`), each overridable by its
flag:

  --dtype           the export's (vllm_serve.yaml): a bf16 export is served with bf16 weights and
                    activations; the recurrent state pages stay fp32 either way (vLLM's own
                    --mamba-ssm-cache-dtype / --mamba-cache-dtype, through --vllm-arg, choose
                    others: serve/vllm_model.py `state_dtypes`).
  --compile/--eager on the CPU eager (exact, and no minute-long inductor compile at start); on a
                    GPU compiled, with CUDA graphs (vLLM's default).
  --max-num-seqs    on the CPU, as many sequences as the state page budget holds
                    (`default_max_num_seqs`): floor(VLLM_CPU_KVCACHE_SPACE GiB, or vLLM's
                    --kv-cache-memory-bytes given through --vllm-arg, / fp32 state bytes per
                    sequence) - 1, at most 2048 (half that with --enable-prefix-caching:
                    two pages per running sequence); on a GPU, vLLM's own (and its memory sizing,
                    `--gpu-memory-utilization` through --vllm-arg).
  environment       on the CPU, set only when unset: VLLM_CPU_KVCACHE_SPACE=1 (GiB of state
                    pages; not with --kv-cache-memory-bytes, which it would override),
                    VLLM_CPU_NUM_OF_RESERVED_CPU=0 (the model may use every core).

Prefix caching of the recurrent state (`--enable-prefix-caching`, off by default): vLLM's
`align` mode keeps the state at the last block boundary of each prompt (blocks of
`PREFIX_BLOCK_SIZE` tokens), so a request that extends an earlier prompt (a conversation's next
turn) starts from that state and prefills only the rest. The block size is passed explicitly:
left unset, vLLM 0.32's CPU platform makes it 128 in the engine process (platforms/cpu.py) after
the state blocks were sized 16, so prefills are split at 128-token boundaries while hits are
looked up at 16: the saved states rarely fall where later prompts look (no hits on most turns).

Replicas: N whole engines behind one server (vLLM's data parallel), on the CPU each on its own cores

    python -m serve.vllm_adapter --model exported/ --port 8000 --data-parallel-size 2
    # the cores of each replica given explicitly, '|'-separated (replica r takes the r-th list)
    python -m serve.vllm_adapter --model exported/ --port 8000 -dp 2 --bind "0-3|4-7"

This process runs one API server and vLLM starts N engine processes, among which vLLM's load
balancer spreads the requests by their queues. Each replica's worker threads are bound to its own
cores (`serve/replicas.py`): by default the cores this process may use, cut into N equal slices;
`--cpu-cores-per-replica K` takes K each, `--bind` gives them explicitly, and a
VLLM_CPU_OMP_THREADS_BIND already in the environment is used as --bind (`nobind`: no binding);
fewer cores than replicas is an error. Every replica holds its own weights, its own
VLLM_CPU_KVCACHE_SPACE GiB of state pages and its own --max-num-seqs: the defaults above are per
replica, so N replicas take N times that memory and run up to N x max-num-seqs sequences at once.
/metrics gives the per-replica counters with labels engine="0".."N-1". Server mode only.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

from laplace_spec.vllm_settings import DTYPES, PREFIX_BLOCK_SIZE, read_settings, served_block_size
from serve.parent_watch import watch_in_forked_children, watch_parent
from serve.replicas import BIND_ENV, resolve_replicas
from serve.state_store import offline, settings

if __name__ == "__mp_main__":  # this module, run again in a process the server spawned
    watch_parent(os.getppid())  # (vLLM's DP coordinator loads no plugin: serve/parent_watch.py)

ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # CPU only


def serving_platform() -> str:
    """vLLM's platform here (`current_platform.device_type`): "cpu", "cuda", ..."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def set_env_defaults(platform: str, pages_sized: bool = False) -> None:
    """The CPU's page budget and cores (vLLM's CPU backend reads them); nothing elsewhere. With
    `pages_sized` (vLLM's --kv-cache-memory-bytes given) no page budget: vLLM's CPU backend
    lets VLLM_CPU_KVCACHE_SPACE override that flag."""
    if platform == "cpu":
        for k, v in ENV_DEFAULTS.items():
            if not (pages_sized and k == KV_SPACE_ENV):
                os.environ.setdefault(k, v)


KV_BYTES_FLAG = "--kv-cache-memory-bytes"  # vLLM's own size of the state/KV pages
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU backend's, in GiB


def pages_bytes_asked(vllm_args) -> int | None:
    """vLLM's --kv-cache-memory-bytes given through --vllm-arg (None: not given). ValueError when
    VLLM_CPU_KVCACHE_SPACE is set too: vLLM's CPU backend would take that one silently."""
    for i, arg in enumerate(vllm_args):
        if arg == KV_BYTES_FLAG and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif arg.startswith(KV_BYTES_FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            continue
        if os.environ.get(KV_SPACE_ENV):
            raise ValueError(
                f"{KV_BYTES_FLAG} and {KV_SPACE_ENV} both size the state pages (vLLM's CPU "
                f"backend takes {KV_SPACE_ENV}): give one"
            )
        return settings.parse_bytes(value)
    return None


MAX_DEFAULT_SEQS = 2048


def _config(model) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def serving_dtype(model, dtype: str | None = None) -> str:
    """The dtype served, float32 or bfloat16: `dtype` if given, else the export's own (its
    vllm_serve.yaml, or config.json for an export written before that file)."""
    if dtype in (None, "auto"):
        conf = _config(model)
        dtype = read_settings(model).get("dtype")
        dtype = str(dtype or conf.get("torch_dtype") or conf.get("dtype") or "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: Laplace serves {sorted(set(DTYPES.values()))}")
    return DTYPES[dtype]


def state_budget_bytes() -> int:
    """vLLM's CPU state/KV page budget: VLLM_CPU_KVCACHE_SPACE GiB (this adapter's default 1)."""
    gib = os.environ.get(KV_SPACE_ENV) or ENV_DEFAULTS[KV_SPACE_ENV]
    return int(float(gib) * 2**30)


def default_max_num_seqs(model, budget_bytes: int | None = None) -> int:
    """The sequences whose state pages fit the budget, at most `MAX_DEFAULT_SEQS`:

        max_num_seqs = min(floor(budget / S) - 1, 2048)

    S: one sequence's state pages, all layers, fp32 (laplace_spec's `page_bytes_per_sequence`; vLLM
    gives each running sequence one page of S bytes, and keeps one page back as its null block).
    The cap bounds vLLM's per-request host buffers (max_model_len tokens each) and keeps
    max_num_seqs within vLLM's default max_num_batched_tokens on CPU (2048 for the server).
    """
    from serve.configuration_laplace import LaplaceHFConfig

    spec = LaplaceHFConfig.from_dict(_config(model)).laplace_config
    per_seq = spec.page_bytes_per_sequence()
    budget = state_budget_bytes() if budget_bytes is None else budget_bytes
    return max(1, min(budget // per_seq - 1, MAX_DEFAULT_SEQS))


def engine_kwargs(
    model: str,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    compile: bool | None = None,
    seed: int = 0,
    dtype: str | None = None,
    prefix_caching: bool | None = None,
    platform: str,
    pages_bytes: int | None = None,
) -> dict:
    """Engine arguments for a Laplace folder (fp32 state) on `platform`.

    The platform's defaults: on the CPU, eager (exact, and no minute-long inductor compile at
    start) and max_num_seqs from the state page budget (`default_max_num_seqs`, halved with
    prefix caching); elsewhere (CUDA, ...), vLLM's own: compiled with CUDA graphs, and its own
    max_num_seqs and memory sizing (`gpu_memory_utilization`). `compile` and `max_num_seqs`
    given override them. dtype None/"auto": the export's dtype. prefix_caching: vLLM's `align`
    mode with `PREFIX_BLOCK_SIZE` blocks; off: one state page per sequence; None: the export's
    vllm_serve.yaml (off). pages_bytes: vLLM's --kv-cache-memory-bytes when given (the CPU's
    max_num_seqs is sized from it instead of VLLM_CPU_KVCACHE_SPACE). A hybrid's KV blocks
    start from `PREFIX_BLOCK_SIZE` too.
    """
    if prefix_caching is None:
        prefix_caching = bool(read_settings(model).get("enable-prefix-caching", False))
    cpu = platform == "cpu"
    if cpu and not max_num_seqs:
        max_num_seqs = default_max_num_seqs(model, pages_bytes)
        if prefix_caching:  # align mode: up to 2 pages per running sequence
            max_num_seqs = max(1, max_num_seqs // 2)
    kw = dict(
        model=str(model),
        dtype=serving_dtype(model, dtype),
        enforce_eager=not (compile if compile is not None else not cpu),
        enable_prefix_caching=prefix_caching,
        seed=seed,
        skip_tokenizer_init=not (Path(model) / "tokenizer.json").is_file(),
    )
    if max_num_seqs:
        kw["max_num_seqs"] = max_num_seqs
    if prefix_caching:
        kw.update(mamba_cache_mode="align", block_size=PREFIX_BLOCK_SIZE)
    if _config(model).get("attention_every"):
        # a hybrid: vLLM raises the KV block from the size given until a block's keys and
        # values take at least one state page's bytes, and pads every state page to a block
        # (docs/design.md s13.4); from 32 tokens (not the CPU default of 128) the padding is
        # at most 32 tokens' keys and values a page (vllm_serve.yaml's block-size)
        kw["block_size"] = int(read_settings(model).get("block-size", PREFIX_BLOCK_SIZE))
    if max_model_len:
        kw["max_model_len"] = max_model_len
    return kw


def make_llm(model: str, **kwargs):
    """A `vllm.LLM` for an exported folder (kwargs: see `engine_kwargs`, or any LLM arg), with
    this platform's defaults."""
    platform = serving_platform()
    set_env_defaults(platform)
    from serve.vllm_plugin import register

    register()
    from vllm import LLM

    chosen = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_KEYS}
    ek = engine_kwargs(model, platform=platform, **chosen)
    return LLM(**{**ek, **kwargs})


_ENGINE_KEYS = ("max_model_len", "max_num_seqs", "compile", "seed", "dtype", "prefix_caching")


def state_store_config(
    model,
    state_dir,
    capacity: int | None,
    dtype: str | None,
    engine_args=(),
    max_num_seqs=None,
    pages_bytes=None,
    max_model_len=None,
) -> tuple[dict, int]:
    """The --kv-transfer-config of `--state-dir` (serve/state_store/), after its checks (a
    StateDirError names what is wrong: a folder that takes no file), and the block size its
    states are kept at (--prefix-cache-retention-interval)."""
    from serve.configuration_laplace import LaplaceHFConfig
    from serve.state_store.fingerprint import model_fingerprint

    spec = LaplaceHFConfig.from_dict(_config(model)).laplace_config
    root = settings.prepare_state_dir(state_dir)
    capacity = capacity or settings.default_capacity(root)
    served = serving_dtype(model, dtype)
    fp = model_fingerprint(model, served, engine_args)
    kind = "hybrid: attention blocks and states" if spec.attention_every else "states"
    print(
        f"serve.vllm_adapter: conversations ({kind}) stored under {root}/ (model {fp[:16]}; "
        f"capacity {capacity / 2**30:.2f} GiB, least recently used first out)",
        file=sys.stderr,
        flush=True,
    )
    # the CPU's sequences: the store runs on the CPU backend only (`settle`)
    seqs = engine_kwargs(
        model,
        max_num_seqs=max_num_seqs,
        prefix_caching=True,
        platform="cpu",
        pages_bytes=pages_bytes,
    )["max_num_seqs"]
    kv_bytes = 2 if served == "bfloat16" else 4  # keys and values in the served dtype
    block = served_block_size(spec, kv_bytes)
    length = max_model_len or _config(model)["max_position_embeddings"]
    primary = settings.primary_bytes(spec, seqs, length, block, kv_bytes)
    return settings.kv_transfer_config(root, fp, capacity, primary), block


def generate(
    llm,
    prompts,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = False,
):
    """prompts: strings or lists of token ids. Returns one dict per prompt. A completion stops
    at the end-of-text token unless `ignore_eos` (fixed lengths: tests, benchmarks)."""
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        ignore_eos=ignore_eos,
        detokenize=llm.llm_engine.tokenizer is not None,
    )
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
    outs = llm.generate(inputs, sp, use_tqdm=False)
    return [
        {
            "prompt": p if isinstance(p, str) else None,
            "prompt_token_ids": list(o.prompt_token_ids),
            "token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "cached_tokens": o.num_cached_tokens or 0,  # prompt tokens from a cache or store
        }
        for p, o in zip(prompts, outs, strict=True)
    ]


def server_argv(args, platform: str) -> list[str]:
    """The argument vector of vLLM's OpenAI server for the adapter's flags on `platform`
    (`engine_kwargs`' defaults: the CPU's are set here, elsewhere vLLM keeps its own)."""
    # vLLM's own flag passed through --vllm-arg means the same as ours (with our block size)
    asked = (
        args.enable_prefix_caching
        or "--enable-prefix-caching" in args.vllm_arg
        or args.state_store is not None
    )
    ek = engine_kwargs(
        args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        compile=args.compile,
        seed=args.seed,
        dtype=args.dtype,
        prefix_caching=True if asked else None,  # else the export's setting
        platform=platform,
        pages_bytes=args.pages_bytes,
    )
    argv = ["--model", ek["model"], "--host", args.host, "--port", str(args.port)]
    argv += ["--dtype", ek["dtype"], "--seed", str(ek["seed"])]
    argv += ["--served-model-name", args.served_model_name or Path(args.model).resolve().name]
    if "max_num_seqs" in ek:
        argv += ["--max-num-seqs", str(ek["max_num_seqs"])]
    if ek["enable_prefix_caching"]:
        argv += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    else:
        argv.append("--no-enable-prefix-caching")
    if "block_size" in ek:
        argv += ["--block-size", str(ek["block_size"])]
    if ek["enforce_eager"]:
        argv.append("--enforce-eager")
    if ek["skip_tokenizer_init"]:  # as offline: a folder without tokenizer.json takes token ids
        argv.append("--skip-tokenizer-init")
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.state_store is not None:  # serve/state_store/settings.py
        # every block boundary's state is offered to the store, a reply's too
        argv += ["--prefix-cache-retention-interval", str(args.state_block)]
        argv += ["--kv-transfer-config", json.dumps(args.state_store)]
        argv.append("--enable-prompt-tokens-details")
    if args.data_parallel_size > 1:  # one API server (this process), N engine processes
        argv += ["--data-parallel-size", str(args.data_parallel_size)]
    return [*argv, *args.vllm_arg]


def serve(args, platform: str) -> None:
    """vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`), in this process."""
    set_env_defaults(platform, pages_sized=args.pages_bytes is not None)
    from serve.vllm_plugin import register

    register()
    sys.argv = ["vllm.entrypoints.openai.api_server", *server_argv(args, platform)]
    # alter_sys=False: `__main__` stays this module, which the processes vLLM spawns run again
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.vllm_adapter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="exported model folder")
    ap.add_argument("--prompt", action="append", default=[], help="offline prompt (repeatable)")
    ap.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        help="offline prompt as comma-separated token ids (repeatable; after --prompt ones)",
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="engine seed (server and offline)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="weights/activations dtype (default: the export's); the state pages stay fp32",
    )
    ap.add_argument("--json", action="store_true", help="print JSON lines with token ids")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="default: the sequences whose state fits VLLM_CPU_KVCACHE_SPACE (at most 2048)",
    )
    ap.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="let vLLM compile the model (torch.compile; CUDA graphs on a GPU): the default on "
        "a GPU",
    )
    ap.add_argument(
        "--eager",
        dest="compile",
        action="store_false",
        help="run the model eagerly (exact, and no compile at start): the default on the CPU",
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="offline: generate --max-tokens tokens, past the end-of-text token",
    )
    ap.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the recurrent state of earlier prompts (vLLM's align mode: the state at "
        f"each prompt's last {PREFIX_BLOCK_SIZE}-token boundary is kept): a conversation's next "
        "turn prefills only what follows it",
    )
    ap.add_argument(
        "--state-dir",
        default=None,
        help="keep each conversation's recurrent state (a hybrid's: and its attention blocks) "
        "on disk under DIR/<model fingerprint>/ (turns on --enable-prefix-caching): a later "
        "turn resumes from it after a restart or on another replica sharing DIR "
        "(docs/serving.md)",
    )
    ap.add_argument(
        "--state-dir-bytes",
        default=None,
        help="the store's capacity on disk, e.g. 16G or 512M (default: 16 GiB, or half the free "
        "space when less); least recently used states go first",
    )
    ap.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="serve N engine replicas (vLLM's data parallel), each on its own cores "
        "(default 1); every replica holds its own weights, state pages and --max-num-seqs",
    )
    ap.add_argument(
        "--cpu-cores-per-replica",
        type=int,
        default=None,
        help="cores bound to each replica (default: the cores this process may use, divided "
        "evenly); replica r gets the r-th consecutive slice",
    )
    ap.add_argument(
        "--bind",
        default=None,
        help=f"explicit cores per replica, '|'-separated (e.g. '0|1' or '0-3|4-7'): sets "
        f"{BIND_ENV}",
    )
    ap.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra argument passed to vLLM's server (repeatable)",
    )
    return ap


def settle(args, platform: str) -> argparse.Namespace:
    """The parsed flags made whole for `platform`: `prompts`, the replicas and their cores, the
    state store's connector settings. ValueError names the flag at fault."""
    args.prompts = list(args.prompt)
    args.prompts += [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
    resolve_replicas(args, bind_cores=platform == "cpu")
    args.pages_bytes = pages_bytes_asked(args.vllm_arg)
    if args.prompts and args.data_parallel_size > 1:
        raise ValueError(
            "--data-parallel-size serves replicas in server mode only (vLLM 0.32 runs offline "
            "data parallel for MoE models only): drop --prompt/--prompt-ids"
        )
    args.state_store, args.state_block = None, None
    if args.state_dir is not None and platform != "cpu":
        raise ValueError(
            f"--state-dir runs on vLLM's CPU backend, whose state pages are host memory that the "
            f"store copies (serve/state_store/worker.py); on {platform} serve with "
            f"--enable-prefix-caching"
        )
    if args.state_dir is not None:
        capacity = args.state_dir_bytes and settings.parse_bytes(args.state_dir_bytes)
        args.state_store, args.state_block = state_store_config(
            args.model,
            args.state_dir,
            capacity,
            args.dtype,
            args.vllm_arg,
            args.max_num_seqs,
            args.pages_bytes,
            args.max_model_len,
        )
    elif args.state_dir_bytes is not None:
        raise ValueError("--state-dir-bytes sizes the store of --state-dir: give --state-dir too")
    return args


def main(argv=None) -> int:
    """Parse the flags, settle them for this platform, then serve or generate offline."""
    ap = parser()
    platform = serving_platform()
    try:
        args = settle(ap.parse_args(argv), platform)
    except (ValueError, settings.StateDirError) as e:
        ap.error(str(e))
    if args.replica_bind is not None:
        os.environ[BIND_ENV] = args.replica_bind
        print(
            f"serve.vllm_adapter: {args.data_parallel_size} replica(s), "
            f"{BIND_ENV}={args.replica_bind!r}",
            file=sys.stderr,
            flush=True,
        )
    watch_in_forked_children()  # the engines end with this process (serve/parent_watch.py)
    if not args.prompts:
        serve(args, platform)
        return 0
    return generate_offline(args)


def generate_offline(args) -> int:
    """`--prompt`/`--prompt-ids`: one completion each, printed (`--json`: with token ids)."""
    store_args = {}
    if args.state_store is not None:  # serve/state_store/offline.py: the engine in this process
        offline.in_process()
        store_args = offline.engine_args(args.state_store, args.state_block)
    llm = make_llm(
        args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        compile=args.compile,
        seed=args.seed,
        dtype=args.dtype,
        # asked for, or the export's setting
        prefix_caching=True if args.enable_prefix_caching or args.state_store else None,
        **store_args,
    )
    results = generate(
        llm, args.prompts, args.max_tokens, args.temperature, args.seed, ignore_eos=args.ignore_eos
    )
    for r in results:
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(r["text"] if r["text"] else " ".join(map(str, r["token_ids"])), flush=True)
    if args.state_store is not None:
        offline.finish(llm)  # the requests' last states on disk before this process exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
