"""bench/convergence.py: each row's validation loss against the reference's, held to its bar."""

from __future__ import annotations

import json
import sys

from conftest import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "bench"))
import convergence  # noqa: E402


def _row(loss: float) -> dict:
    return {"final_validation_loss": loss, "validation_losses": [[1, loss]], "losses": [loss]}


def test_rows_are_held_to_the_bar_of_their_kind() -> None:
    rows = {
        "reference": _row(5.0),
        "states": _row(5.02),  # +0.4%: inside exact's 0.5%
        "cpu_adam": _row(5.03),  # +0.6%: outside
        "bf16 moments": _row(5.045),  # +0.9%: inside bf16's 1%
        "cpu_adam_delayed": _row(5.2),  # +4%: outside delayed's 2%
    }
    assert convergence.verdicts(rows) == {
        "states": True,
        "cpu_adam": False,
        "bf16 moments": True,
        "cpu_adam_delayed": False,
    }
    assert abs(convergence.gap(rows, "cpu_adam_delayed") - 0.04) < 1e-12


def test_a_row_on_other_gpus_is_held_to_its_own_reference() -> None:
    rows = {
        "reference": _row(5.0),
        "reference EP2": {**_row(5.5), "baseline": "reference"},
        "cpu_adam_delayed_experts EP2": {**_row(5.555), "baseline": "reference EP2"},
    }
    assert abs(convergence.gap(rows, "cpu_adam_delayed_experts EP2") - 0.01) < 1e-12
    assert abs(convergence.gap(rows, "reference EP2") - 0.1) < 1e-12
    assert convergence.verdicts(rows) == {"cpu_adam_delayed_experts EP2": True}
    assert convergence.table(rows)[2][2] == "+1.00% (vs reference EP2)"


def test_the_recorded_suite_renders_with_every_row() -> None:
    files = sorted((PROJECT_ROOT / "bench/results").glob("results-convergence-*.json"))
    rows, _ = convergence.load(files)
    assert set(convergence.BARS) | {"reference", "reference seed 2", "reference EP2"} == set(rows)
    text = convergence.render(files, plot=None)
    assert all(f"| {name} |" in text for name in rows)
    assert "[corpus/prose]" in text and "/work/" not in text


def test_a_long_suites_segments_are_not_this_reports_rows(tmp_path) -> None:
    """Suite convergence-long (results-convergence-long-*.json, rows named as these) runs in
    segments: they leave the 500-iteration report as it is."""
    files = sorted((PROJECT_ROOT / "bench/results").glob("results-convergence-*.json"))
    segment = json.loads(files[-1].read_text())
    for r in segment["results"]:
        r["segment"] = [0, 500]
        r["summary"] = {**r["summary"], "final_validation_loss": 99.0}
    extra = tmp_path / "results-convergence-long-r1.json"
    extra.write_text(json.dumps(segment))
    assert convergence.load([extra, *files])[0] == convergence.load(files)[0]


def test_auto_cites_what_the_suite_measured_for_each_precision_tier() -> None:
    from offload_runner.auto import MEASURED_LOSS_COST, PRECISION_TIERS

    rows, _ = convergence.load(sorted((PROJECT_ROOT / "bench/results").glob("*convergence*")))
    assert set(MEASURED_LOSS_COST) == {name for name, _ in PRECISION_TIERS[1:]}
    for tier, cost in MEASURED_LOSS_COST.items():
        assert abs(convergence.gap(rows, tier) - cost) < 5e-5, tier


def _segments(path, finals: dict[str, float], iters: int = 2000, every: int = 1000) -> None:
    """A results file of suite convergence-long: each row in two segments, its final
    validation loss ``finals[name]`` at the end."""
    results = []
    for name, final in finals.items():
        for first in range(0, iters, every):
            last = first + every
            loss = final + (iters - last) / iters
            summary = {"final_validation_loss": loss, "validation_losses": [[last, loss]]}
            results.append(
                {
                    "case": {"name": name, "baseline": "reference"},
                    "command": ["python", "run_recipe.py", f"--{name}"],
                    "status": "ok",
                    "segment": [first, last],
                    "summary": {**summary, "losses": [loss] * 3},
                }
            )
    data = {"suite": "convergence-long", "iters": iters, "environment": {}, "results": results}
    path.write_text(json.dumps(data))


def test_long_runs_join_their_segments_and_meet_the_two_seed_bar(tmp_path) -> None:
    """Segments joined in order; a variant within 1% on the two seeds' mean and each seed
    within the reference's own seed gap is within; one seed 3% off is outside."""
    names = ("reference", "reference seed 2", "columns", "columns seed 2", "late", "late seed 2")
    finals = (4.0, 4.04, 4.02, 4.06, 4.0, 4.16)
    _segments(tmp_path / "a.json", dict(zip(names, finals, strict=True)))
    rows = convergence.load_long([tmp_path / "a.json"])
    assert rows["columns"]["validation_losses"] == [[1000, 4.52], [2000, 4.02]]
    assert len(rows["columns"]["losses"]) == 6
    verdicts = convergence.long_verdicts(rows)
    assert verdicts["columns"][1] and not verdicts["late"][1]
    assert abs(verdicts["columns"][0] - (4.04 / 4.02 - 1)) < 1e-12
    text = "\n".join(convergence.long_section(rows, None))
    assert "## 2,000 iterations" in text and "| columns seed 2 | 4.0600 | +0.50% |" in text
    _segments(tmp_path / "b.json", {"reference": 4.0}, iters=2000, every=500)
    short = json.loads((tmp_path / "b.json").read_text())
    short["results"] = short["results"][:2]  # 0-1000 of 2,000: not finished
    (tmp_path / "b.json").write_text(json.dumps(short))
    assert convergence.load_long([tmp_path / "b.json"]) == {}
