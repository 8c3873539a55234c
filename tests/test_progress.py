"""Long start-up phases are said on rank 0 with their size, then their time and rate."""

from __future__ import annotations

from offload_runner.progress import timed_line


def test_a_long_phase_is_said_on_rank_0_only(monkeypatch, capsys) -> None:
    doing = "page-locking {size} of host memory for offload/optimizer=states"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    timed_line(doing, "page-locked", 2 * 10**9, least_gb=1)()
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    timed_line(doing, "page-locked", 2 * 10**9, least_gb=1)()
    first, second = capsys.readouterr().out.splitlines()
    assert first == "page-locking 2.0 GB of host memory for offload/optimizer=states ..."
    assert second.startswith("  ... page-locked in ") and second.endswith("GB/s)")
    timed_line(doing, "page-locked", 10**8, least_gb=1)()  # below least_gb: nothing
    assert capsys.readouterr().out == ""
