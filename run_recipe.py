#!/usr/bin/env python
"""Train a Megatron-Core recipe with CPU offloading. `python run_recipe.py --help` lists the groups.

python run_recipe.py --recipe qwen3_30b_a3b_proxy offload/optimizer=cpu_50 --dry-run
"""

import sys

from offload_runner.entry import main

if __name__ == "__main__":
    sys.exit(main())
