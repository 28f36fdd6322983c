"""The main job runs end to end on 4 ranks in 2 virtual nodes."""

from __future__ import annotations

from tests.conftest import run_mpi


def test_demo_copies_and_verifies_into_every_node(tmp_path):
    root = tmp_path / "demo"
    result = run_mpi(4, "-m", "bbio.demo", "--root", str(root), "--files", "12")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "4 ranks in 2 virtual nodes" in out
    assert "RESULT: every copy verified by CRC32C" in out
    for node in (0, 1):
        copies = sorted(p.name for p in (root / "bb" / f"node{node}" / "dataset").iterdir())
        assert len(copies) == 12
        for name in copies:
            src = root / "pfs" / "dataset" / name
            assert (root / "bb" / f"node{node}" / "dataset" / name).read_bytes() == src.read_bytes()
