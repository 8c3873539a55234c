"""The command's entry point (run_recipe.py, ``offload-runner``): the launcher's own import of
Megatron-Core and Transformer Engine warns (deprecations, at import) before any of our lines;
those warnings stay out of its terminal. The ranks import the same modules and keep the same
warnings in rank0.log (worker.setup_rank_logging); ``--verbose`` shows them everywhere."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

# where a library's own warnings come from (the module they are attributed to)
LIBRARIES = r"(megatron|transformer_engine|torch|torchao|apex)(\.|$)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" not in argv:
        warnings.filterwarnings("ignore", module=LIBRARIES)
    from offload_runner.cli import main as cli_main

    return cli_main(argv)
