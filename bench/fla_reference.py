"""flash-linear-attention's naive PyTorch Simple-GLA references, loaded without triton.

`fla/ops/simple_gla/naive.py` (package `fla-core`) needs only torch and einops; importing the `fla`
package itself would pull in its triton kernels, so the file is loaded by path.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path


@functools.cache
def load_fla_naive():
    """The module holding `naive_recurrent_simple_gla` and `naive_chunk_simple_gla`."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flash-linear-attention is not installed: pip install fla-core==0.6.0")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "simple_gla" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_simple_gla_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
