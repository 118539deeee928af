"""The developer scripts under scripts/ that the GPU tier runs, smoke-run on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.inductor
def test_gpu_probe_runs_on_cpu_and_reports_ratios(tmp_path):
    """scripts/gpu_probe.py with --device cpu: every strategy asked for steps with the same
    first loss (same seed, same batch), and the ratios come per round."""
    probe = _load("gpu_probe")
    out = tmp_path / "probe.json"
    rc = probe.main(
        [
            "--device",
            "cpu",
            "--configs",
            "gpt:32:2",
            "--modes",
            "default,reduce-overhead",
            "--strategies",
            "eager,aotdist",
            "--rounds",
            "2",
            "--steps",
            "2",
            "--batch",
            "2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and len(report["results"]) == 1  # no CUDA graphs on CPU
    entry = report["results"][0]
    assert entry["errors"] == {} and set(entry["step_ms"]) == {"eager", "aotdist"}
    assert entry["first_loss"]["eager"] == pytest.approx(entry["first_loss"]["aotdist"], rel=1e-5)
    assert len(entry["rounds_s"]["aotdist"]) == 2
    median, low, high = entry["aotdist_over_eager"]
    assert 0 < low <= median <= high


def test_gpu_probe_records_a_failing_strategy_and_goes_on(tmp_path):
    probe = _load("gpu_probe")
    out = tmp_path / "probe.json"
    rc = probe.main(
        [
            "--device",
            "cpu",
            "--configs",
            "gpt:32:2",
            "--modes",
            "default",
            "--strategies",
            "eager,nonsense",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--out",
            str(out),
        ]
    )
    entry = json.loads(out.read_text())["results"][0]
    assert rc == 1 and "unknown strategy 'nonsense'" in entry["errors"]["nonsense"]
    assert set(entry["step_ms"]) == {"eager"}
