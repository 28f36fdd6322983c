"""The ``checkpoint`` benchmark suite end to end on tiny states: options and JSON layout."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import numpy as np
import pytest

from bbio.bench.__main__ import build_parser
from bbio.bench.checkpoint import make_state, write_bytes
from tests.conftest import run_mpi

SIZES = {"1MiB": 1 << 20, "2MiB": 2 << 20}
BASE_SYSTEMS = (
    "memcpy",
    "bb-write",
    "bb-rewrite",
    "bb-write-fpp",
    "bbio",
    "bbio-committed",
    "bbio-fresh",
    "bbio-stream",
    "h5py-bb",
    "h5py-sync",
    "pfs-write",
    "pfs-write-node",
    "pfs-commit",
    "pfs-commit-bb",
)
DCP_SYSTEMS = ("dcp-async", "dcp-async-committed")
RATES = (
    "bbio-drain",
    "bbio-drain-stream",
    "pfs-write",
    "pfs-write-node",
    "pfs-commit",
    "pfs-commit-bb",
)


def torch_importable() -> bool:
    return importlib.util.find_spec("torch") is not None


def test_options_parse():
    args = build_parser().parse_args(
        ["checkpoint", "--sizes", "1MiB,2MiB", "--repeats", "2", "--systems", "bbio,memcpy"]
    )
    assert (args.sizes, args.repeats, args.systems, args.bb, args.drop_caches) == (
        [1 << 20, 2 << 20],
        2,
        ["bbio", "memcpy"],
        "/dev/shm",
        True,
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["checkpoint", "--systems", "bbio,nope"])


def test_state_sums_to_the_size_and_raw_writes_fill_exactly(tmp_path):
    state = make_state(3, 1 << 20, 4)
    assert len(state) == 4 and sum(a.nbytes for a in state.values()) == 1 << 20
    assert all(a.dtype == np.float32 and a.ndim == 2 for a in state.values())
    odd = make_state(0, 4 * 1001, 4)
    assert sum(a.nbytes for a in odd.values()) == 4 * 1001
    path = tmp_path / "node.bin"
    with open(path, "wb") as f:
        write_bytes(f.fileno(), list(odd.values()), 3 * 4 * 1001 + 5)
    assert path.stat().st_size == 3 * 4 * 1001 + 5


def test_checkpoint_suite_tiny_writes_documented_json(tmp_path):
    out, pfs, bb = tmp_path / "checkpoint.json", tmp_path / "pfs", tmp_path / "bb"
    try:
        result = run_mpi(
            4,
            "-m",
            "bbio.bench",
            "checkpoint",
            "--sizes",
            ",".join(SIZES),
            "--repeats",
            "1",
            "--json",
            str(out),
            "--pfs",
            str(pfs),
            "--bb",
            str(bb),
            "--no-drop-caches",
            timeout=120,
        )
    finally:
        leftovers = subprocess.run(
            ["pgrep", "-af", f"bbio.checkpoint.drainer --journal {bb}"],
            capture_output=True,
            text=True,
        ).stdout
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not leftovers, f"drain processes left running: {leftovers}"
    doc = json.loads(out.read_text())
    assert (doc["suite"], doc["ranks"], doc["nodes"], doc["quick"]) == ("checkpoint", 4, 2, False)
    info = doc["machine"]["checkpoint"]
    assert info["sizes_per_rank"] == list(SIZES.values())
    assert info["caches_dropped"] is False and info["repeats"] == 1
    assert info["stream_saves"] == 4

    systems = BASE_SYSTEMS + (DCP_SYSTEMS if torch_importable() else ())
    if torch_importable():
        assert info["torch"] and info["dcp_skipped"] is None
    else:
        assert info["dcp_skipped"] and "dcp-async" in result.stdout
    results = {(r["case"], r["system"], r["metric"]): r for r in doc["results"]}
    for case in SIZES:
        seconds = {}
        for system in systems:
            entry = results.pop((case, system, "seconds"))
            assert entry["unit"] == "s"
            assert len(entry["values"]) == 1 and entry["values"][0] > 0
            seconds[system] = entry["median"]
        assert seconds["bbio-committed"] > seconds["bbio"]
        for system in RATES:
            entry = results.pop((case, system, "GB_per_s"))
            assert entry["unit"] == "GB/s" and entry["median"] > 0
    assert not results, f"unexpected results: {sorted(results)}"
    assert not any(pfs.iterdir()), "the suite left files on the PFS"
    assert not any(bb.iterdir()), "the suite left files in the burst buffer"
