"""docs/trainium.md: the Neuron smoke script's CPU run (train.neuron_smoke)."""

from __future__ import annotations

import json

from bench.common import RESULTS

PAGE = "docs/trainium.md"


def smoke() -> str:
    d = json.loads((RESULTS / "neuron_smoke.json").read_text())
    muon = next(r for r in d["reports"] if r["check"] == "muon")
    return (
        f"Here (`{d['command']}`, {d['cores']} simulated CPU devices, {d['wall_s']:.0f} s; "
        f"`bench/results/neuron_smoke.json`): {d['passed']} of {d['checks']} checks pass; `a2a` "
        f"is within {muon['max_a2a_minus_gather']:.2g} of `gather` (fp32 Newton-Schulz, bound "
        f"{muon['bound']:g})."
    )


BLOCKS = {"smoke": smoke}
