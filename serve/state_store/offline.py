"""The state store under vLLM's offline engine (the adapter's `--prompt` mode with `--state-dir`).

`LLM.generate` returns when its requests' outputs are final, and the engine then stops stepping;
but the connector hears that a request's last states reached the host tier only in a later step,
and only then is the request finished for the store (`tier.StateFileTier.on_request_finished`).
So the offline engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by
`in_process`), and `finish` steps it until its scheduler holds nothing (no request, finished or
waiting on the connector, and no transfer in flight), then shuts it down: the store's writer
finishes its files before the process exits.
"""

from __future__ import annotations

import os

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def in_process() -> None:
    """The engine core in this process (before vLLM is imported: vLLM caches its environment)."""
    os.environ[IN_PROCESS_ENV] = "0"


def engine_args(state_store: dict, retention_tokens: int) -> dict:
    """The LLM(...) arguments of the store (the server's are its flags)."""
    from vllm.config import KVTransferConfig

    return {
        "kv_transfer_config": KVTransferConfig(**state_store),
        "prefix_cache_retention_interval": retention_tokens,
    }


def finish(llm) -> None:
    """Step the in-process engine until the store has taken every finished request, then shut
    it down (the writer thread's files complete)."""
    client = llm.llm_engine.engine_core  # vLLM's InprocClient
    while client.engine_core.scheduler.has_requests():
        client.get_output()
    client.shutdown()
