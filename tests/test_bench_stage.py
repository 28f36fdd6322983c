"""The ``stage`` benchmark suite end to end on tiny trees: JSON layout and replicate reads."""

from __future__ import annotations

import json
import shutil

import pytest

from bbio.bench import byte_size
from bbio.bench.__main__ import build_parser
from tests.conftest import run_mpi

CASES = ("small-files", "large-files", "packed")
THROUGHPUT_SYSTEMS = ("bbio-2", "bbio-4", "cp", "rsync", "tar", "raw-read", "raw-write")
SMALL_FILES, SMALL_SIZE = 40, 16 << 10
LARGE_FILES, LARGE_SIZE = 2, 1 << 20


def test_byte_sizes_and_options_parse():
    assert byte_size("4096") == 4096
    assert byte_size("100KiB") == 100 << 10
    assert byte_size("64M") == 64 << 20
    assert byte_size("1GiB") == 1 << 30
    args = build_parser().parse_args(["stage", "--small-files", "3", "--large-size", "2MiB"])
    assert (args.small_files, args.large_size, args.drop_caches, args.bb) == (
        3,
        2 << 20,
        True,
        "/dev/shm",
    )


def test_stage_suite_tiny_writes_documented_json(tmp_path):
    out = tmp_path / "stage.json"
    pfs, bb = tmp_path / "pfs", tmp_path / "bb"
    result = run_mpi(
        4,
        "-m",
        "bbio.bench",
        "stage",
        "--json",
        str(out),
        "--pfs",
        str(pfs),
        "--bb",
        str(bb),
        "--small-files",
        str(SMALL_FILES),
        "--small-size",
        str(SMALL_SIZE),
        "--large-files",
        str(LARGE_FILES),
        "--large-size",
        str(LARGE_SIZE),
        "--shard-size",
        "64KiB",
        "--no-drop-caches",
        "--clean",
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["suite"], doc["ranks"], doc["quick"]) == ("stage", 4, False)
    assert doc["machine"]["caches_dropped"] is False
    info = doc["machine"]["stage"]
    assert info["sizes"]["small_files"] == SMALL_FILES
    assert info["trees"] == dict.fromkeys(CASES, "generated")

    # the suite skips a baseline whose tool is missing (scripts/setup-env.sh installs rsync)
    systems = [s for s in THROUGHPUT_SYSTEMS if s != "rsync" or shutil.which("rsync")]
    assert info["skipped_baselines"] == ([] if shutil.which("rsync") else ["rsync"])
    results = {(r["case"], r["system"], r["metric"]): r for r in doc["results"]}
    for case in CASES:
        for system in systems:
            entry = results.pop((case, system, "GB_per_s"))
            assert entry["unit"] == "GB/s"
            assert len(entry["values"]) == 1 and entry["median"] > 0
    dataset = {"small-files": SMALL_FILES * SMALL_SIZE, "large-files": LARGE_FILES * LARGE_SIZE}
    for case, nbytes in dataset.items():
        bbio = results.pop((case, "bbio-replicate", "pfs_bytes_read"))
        naive = results.pop((case, "naive-per-node", "pfs_bytes_read"))
        assert bbio["unit"] == naive["unit"] == "bytes"
        # rchar also counts a few KiB of other reads (MPI start-up, /proc/self/io)
        assert bbio["median"] == pytest.approx(nbytes, rel=0.05)
        assert naive["median"] == pytest.approx(2 * bbio["median"], rel=0.05)
        check = info["replicate_check"][case]
        assert check["source_bytes_read_bbio"] == nbytes
    assert not results, f"unexpected results: {sorted(results)}"

    # --clean removed the trees; the burst-buffer work directory is always removed
    assert list(pfs.iterdir()) == []
    assert list(bb.iterdir()) == []
