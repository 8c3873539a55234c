"""bench/capacity.py: the largest runs beside their no-offload lines and against their plans."""

from __future__ import annotations

import sys

from conftest import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
import capacity  # noqa: E402

RESULTS = PROJECT_ROOT / "bench/results"
FILES = sorted(
    p
    for pattern in ("results-capacity-*.json", "results-whole-model.json", "results-two-gpu-full-*")
    for p in RESULTS.glob(pattern)
)


def test_a_row_reads_its_plan_from_autos_line_and_its_host_above_idle() -> None:
    row = capacity.Row(
        "r",
        "s",
        1,
        48,
        "ok",
        {
            "auto": "full recompute, offload/optimizer=states (peak 116.9 GB + 2.0 GB kept free "
            "fits 139.0 GB; host 118.3 of 125 GB per node; predicted 11.39 s a step)",
            "host_used_gb_max_per_node": [121.6],
            "host_used_gb_before_per_node": [3.1],
        },
        "",
    )
    assert row.planned == (116.9, 118.3) and abs(row.host_gb - 118.5) < 1e-9
    assert row.chose == "full recompute, offload/optimizer=states"


def test_every_largest_run_is_within_10_percent_of_its_plan_and_each_no_offload_line_ran_out():
    rows = capacity.load(FILES)
    assert {r.layers for r in rows if r.status == "ok"} >= {37, 48}
    assert capacity.worst_error(rows) < 0.10
    assert all(r.status == "OOM" for r in rows if "no offload" in r.name)
    text = capacity.render(FILES, plot=None)
    assert all(f"| {r.name} (`{r.suite}`) |" in text for r in rows)
    assert "| whole model auto (`whole-model`) | 1 | 48 | ok |" in text
