"""docs/index.md: the model's accounting, from its shapes (`python -m laplace_jax.info`)."""

from __future__ import annotations

import contextlib
import io

PAGE = "docs/index.md"


def info() -> str:
    from laplace_jax import info as info_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        info_cli.main(["--config", "laplace-3b"])
    return "```\n" + out.getvalue() + "```"


BLOCKS = {"info": info}
