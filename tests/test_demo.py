"""The main job runs end to end: 4 ranks in 2 virtual nodes, killed mid-drain, restarted."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python


@pytest.mark.timeout(900)  # its subprocess may take 600 s on a slow machine
def test_demo_stages_trains_survives_a_kill_and_restarts(tmp_path):
    root = tmp_path / "demo"
    result = run_python(
        "-m",
        "bbio.demo",
        "--root",
        str(root),
        "--samples",
        "128",
        "--epochs",
        "3",
        "--batch-size",
        "8",
        "--model-mib",
        "16",
        timeout=600,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "RESULT: all checks passed" in out
    assert "verified: yes" in out
    assert "state identical to the training log: yes" in out
    prepare = json.loads((root / "results" / "prepare.json").read_text())
    assert prepare["stage"]["nodes"] == 2 and prepare["read"]["checked"]
    restart = json.loads((root / "results" / "restart.json").read_text())
    assert restart["restored"]["identical"] and restart["final_committed"]
    assert restart["steps"] == 3 * 128 // (4 * 8)
    committed = sorted(
        p.name for p in (root / "pfs" / "ckpt" / "demo").glob("step-*/manifest.json")
    )
    assert committed, "no checkpoint was committed on the PFS"
