"""What `bench.serve` observes inside the engine: the Laplace model's own forward time
(`MODEL_TIME`, accumulated by `instrument_laplace`) and what vLLM's scheduler scheduled in each
engine step (`SchedulerTap`, on the in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

from __future__ import annotations

import time

MODEL_TIME = {"seconds": 0.0}


def instrument_laplace() -> None:
    """Accumulate the wall time of the Laplace vLLM model's forward + logits in MODEL_TIME."""
    from serve import vllm_model

    cls = vllm_model.LaplaceVLLMForCausalLM
    for name in ("forward", "compute_logits"):
        f = getattr(cls, name)

        def timed(*a, _f=f, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                MODEL_TIME["seconds"] += time.perf_counter() - t0

        setattr(cls, name, timed)


class SchedulerTap:
    """What vLLM's scheduler scheduled in the latest engine step (`last`, a SchedulerOutput),
    read by wrapping the in-process engine core's `scheduler.schedule`."""

    def __init__(self, llm):
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        self.last = None

        def tapped(*a, **k):
            self.last = schedule(*a, **k)
            return self.last

        scheduler.schedule = tapped

    @staticmethod
    def of(llm) -> SchedulerTap:
        if getattr(llm, "_bench_tap", None) is None:
            llm._bench_tap = SchedulerTap(llm)
        return llm._bench_tap
