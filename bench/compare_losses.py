#!/usr/bin/env python
"""Two runs' losses side by side, from their summary.json, and the largest difference:

    python bench/compare_losses.py RUN_DIR_A RUN_DIR_B            # iteration by iteration
    python bench/compare_losses.py FULL RESUMED --tail 3          # B against A's last 3

Exit 1 when ``--tolerance`` is given and the largest |Δloss| is above it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "summary.json").read_text())["losses"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--tail", type=int, default=None, help="compare B with A's last N")
    parser.add_argument("--tolerance", type=float, default=None)
    args = parser.parse_args()
    a, b = losses(args.a), losses(args.b)
    if args.tail:
        a = a[-args.tail :]
    if len(a) != len(b):
        print(f"{args.a}: {len(a)} losses, {args.b}: {len(b)}: not the same iterations")
        return 1
    print(f"{args.a.name}: {a}\n{args.b.name}: {b}")
    delta = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"max |Δloss| {delta:.3e} over {len(a)} iterations")
    return int(args.tolerance is not None and delta > args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
