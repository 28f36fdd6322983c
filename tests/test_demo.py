"""The main job runs end to end on 4 ranks in 2 virtual nodes."""

from __future__ import annotations

import h5py

from bbio.stage.pack import read_index
from tests.conftest import run_mpi


def test_demo_packs_stages_and_verifies_into_every_node(tmp_path):
    root = tmp_path / "demo"
    result = run_mpi(4, "-m", "bbio.demo", "--root", str(root), "--samples", "40")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "4 ranks in 2 nodes" in out
    assert "verified: yes" in out
    assert "bbio stage-in (replicate)" in out
    samples = sorted((root / "pfs" / "samples").iterdir())
    assert len(samples) == 40
    for node in (0, 1):
        staged = root / "bb" / f"node{node}" / "packed"
        shards = read_index(staged)
        assert sum(s.samples for s in shards) == 40
        with h5py.File(staged / shards[0].file, "r") as f:
            first = bytes(f["data"][: int(f["sizes"][0])])
        assert first == samples[0].read_bytes()
