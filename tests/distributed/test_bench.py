"""``lm-resiliency bench --quick`` on real Gloo ranks: the CI smoke, and a crossed threshold.

The quick mode interleaves every scenario (baseline, GEMINI, SCOUT, GEMINI+SCOUT+MTGS)
on 2 ranks and stays within its generous ratio limits; results are appended as JSON
lines. With the test-only slowdown knob (``LM_RESILIENCY_BENCH_SLOWDOWN``: the GEMINI
scenario sleeps 9x the step time the ranks agreed on after each step) the GEMINI
step-time ratio crosses its limit and the command exits 1 naming the scenario.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_resiliency.cli.bench import THRESHOLDS, load_thresholds
from lm_resiliency.cli.main import main


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_quick_benchmark_runs_every_scenario_within_its_thresholds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "bench.jsonl"
    rc = main(["bench", "--quick", "--results", str(results), "--plot", str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert "THRESHOLD CROSSED" not in err, err
    lines = _lines(results)
    phases = [x for x in lines if x["kind"] == "phase"]
    assert {p["scenario"] for p in phases} == {"baseline", "gemini", "scout", "combined"}
    assert len(phases) == 8  # 2 rounds x 4 scenarios on the demo model
    (summary,) = [x for x in lines if x["kind"] == "summary"]
    assert summary["crossed"] == [] and summary["section"] == "quick"
    demo = summary["summary"]["demo"]
    assert demo["gemini"]["blocking_per_capture_s"] > 0 and demo["baseline"]["step_time_ratio"] == 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and "--plot needs matplotlib" in err
    else:
        assert rc == 0 and (tmp_path / "s.png").stat().st_size > 0


def test_a_slowed_scenario_crosses_its_threshold_and_the_command_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LM_RESILIENCY_BENCH_SLOWDOWN", "gemini:9")  # inherited by the ranks
    results = tmp_path / "bench.jsonl"
    argv = ["bench", "--quick", "--rounds", "1", "--steps", "6", "--results", str(results)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    limit = load_thresholds(THRESHOLDS, "quick")["gemini"]["max_step_time_ratio"]
    assert "THRESHOLD CROSSED: gemini on the demo model: step_time_ratio=" in err
    assert f"crosses max_step_time_ratio={limit:g}" in err
    assert "scout on" not in err and "combined on" not in err
    (summary,) = [x for x in _lines(results) if x["kind"] == "summary"]
    assert summary["slowdown"] == ["gemini", 9.0] and len(summary["crossed"]) >= 1


def test_a_thresholds_file_with_an_absolute_time_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"quick": {"gemini": {"max_step_s": 0.1}}}))
    with pytest.raises(ValueError, match=r"quick\.gemini\.max_step_s=0\.1; limits are ratios"):
        load_thresholds(bad, "quick")
