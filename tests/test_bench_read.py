"""The ``read`` benchmark suite end to end on tiny datasets: JSON layout and read counts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bbio.bench import IoCounters, byte_size
from bbio.bench.__main__ import build_parser
from bbio.bench.read import (
    ALL_SYSTEMS,
    KEEP_ENV,
    WORKLOADS,
    check_samples,
    child_env,
)
from tests.conftest import run_mpi

CASES = ("resnet50", "cosmoflow", "bert")
STEP_METRICS = {
    "samples_per_s": "samples/s",
    "GB_per_s": "GB/s",
    "pfs_requests": "requests",
    "bytes_read_over_needed": "ratio",
}
LOADERS = ("bbio-loader", "bbio-loader-noprefetch")
STEPS, RANKS = 2, 4
# tiny: samples a tenth of DLIO's, batches a quarter, 32 MiB per case, 1% of the compute
TINY = ["--file-size", "32MiB", "--steps", str(STEPS), "--sample-scale", "0.1"]
TINY += ["--batch-scale", "0.25", "--compute-scale", "0.01", "--no-drop-caches"]


def test_options_parse_and_sizes():
    assert byte_size("32MiB") == 32 << 20
    args = build_parser().parse_args(["read", *TINY, "--systems", "bbio,romio"])
    assert (args.file_size, args.steps, args.systems, args.drop_caches) == (
        32 << 20,
        STEPS,
        ["bbio", "romio"],
        False,
    )
    assert set(CASES) == set(WORKLOADS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["read", "--systems", "mystery"])
    args = build_parser().parse_args(["read", "--case-steps", "bert=3, cosmoflow=400"])
    assert args.case_steps == {"bert": 3, "cosmoflow": 400}
    for wrong in ("bert=0", "mystery=2", "bert", "bert=x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["read", "--case-steps", wrong])


def test_counters_check_and_child_env(tmp_path, monkeypatch):
    counters = IoCounters()
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    before = counters.snapshot()
    with open(path, "rb", buffering=0) as f:
        f.read(4096)
        f.read(4096)
    assert counters.delta(before, counters.snapshot()) == (2, 8192)
    counters.close()
    rows = np.zeros((3, 16), dtype=np.uint8)
    rows[:, :8] = np.array([5, 1, 9], dtype="<u8").view(np.uint8).reshape(3, 8)
    check_samples(rows, np.array([5, 1, 9]), "ok")
    with pytest.raises(AssertionError, match="row 1"):
        check_samples(rows, np.array([5, 2, 9]), "bad")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("PMIX_RANK", "3")
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "1")
    env = child_env("romio321", 2)
    assert env["OMPI_MCA_io"] == "romio321"
    assert "OMPI_COMM_WORLD_RANK" not in env and "PMIX_RANK" not in env
    assert all(
        k in KEEP_ENV or not k.startswith(("OMPI_", "PMIX_")) for k in env if k != "OMPI_MCA_io"
    )
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert child_env("ompio", 2)["OMPI_MCA_io_ompio_num_aggregators"] == "2"
    assert os.environ["OMPI_COMM_WORLD_RANK"] == "3"  # the parent's environment is untouched


def test_read_suite_tiny_writes_documented_json(tmp_path):
    out = tmp_path / "read.json"
    pfs = tmp_path / "pfs"
    result = run_mpi(
        RANKS,
        "-m",
        "bbio.bench",
        "read",
        "--json",
        str(out),
        "--pfs",
        str(pfs),
        *TINY,
        "--case-steps",
        "bert=3",
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["suite"], doc["ranks"], doc["nodes"], doc["quick"]) == (
        "read",
        RANKS,
        RANKS // 2,
        False,
    )
    info = doc["machine"]["read"]
    assert info["caches_dropped"] is False and info["steps"] == STEPS
    assert info["datasets"] == dict.fromkeys(CASES, "generated")
    assert info["io_components"]["romio"] == ["mca_io_romio321"]
    assert "mca_io_ompio" in info["io_components"]["ompio"]
    assert "mca_io_romio321" not in info["io_components"]["ompio"]

    results = {(r["case"], r["system"], r["metric"]): r for r in doc["results"]}
    for case in CASES:
        sizes = info["cases"][case]
        assert sizes["samples"] * sizes["sample_bytes"] > (32 << 20) - sizes["sample_bytes"]
        case_steps = 3 if case == "bert" else STEPS
        assert sizes["steps"] == case_steps
        for system in ALL_SYSTEMS:
            metrics = dict(STEP_METRICS, au="ratio") if system in LOADERS else STEP_METRICS
            for metric, unit in metrics.items():
                entry = results.pop((case, system, metric))
                assert entry["unit"] == unit
                steps = case_steps if system not in (*LOADERS, "seq-read") else 1
                assert len(entry["values"]) == steps, (case, system, metric)
                assert all(v > 0 for v in entry["values"]), (case, system, metric, entry)
        for system in LOADERS:
            assert doc_value(doc, case, system, "au") <= 1.0
        # each rank's batch is read with one pread per sample
        batch = info["cases"][case]["batch"]
        assert doc_value(doc, case, "independent", "pfs_requests") == RANKS * batch
        assert doc_value(doc, case, "independent", "bytes_read_over_needed") < 1.01
        assert doc_value(doc, case, "seq-read", "bytes_read_over_needed") < 1.01
        # bbio reads what its plan says: its own count is the kernel's
        own = info["bbio_requests"][case]["bbio"]
        assert own["stats_requests_per_step"] == own["syscr_per_step"]
        # ROMIO's two-phase reads whole file domains, holes included: bbio reads far less
        bbio = doc_value(doc, case, "bbio", "bytes_read_over_needed")
        assert bbio < doc_value(doc, case, "romio", "bytes_read_over_needed")
        if case != "bert":  # 250-byte samples: holes of up to 64 KiB are merged
            assert bbio < 2.0
    assert not results, f"unexpected results: {sorted(results)}"


def doc_value(doc: dict, case: str, system: str, metric: str) -> float:
    for r in doc["results"]:
        if (r["case"], r["system"], r["metric"]) == (case, system, metric):
            return r["median"]
    raise KeyError((case, system, metric))


def run_resnet50(tmp_path, *options: str):
    """The tiny read suite on the resnet50 case alone: (process, its JSON path)."""
    out = tmp_path / "read.json"
    args = ["-m", "bbio.bench", "read", "--pfs", str(tmp_path / "pfs"), *TINY]
    return run_mpi(RANKS, *args, "--cases", "resnet50", "--json", str(out), *options), out


def test_compute_ratio_sets_the_loader_compute_from_bbio_step_time(tmp_path):
    result, out = run_resnet50(tmp_path, "--systems", "bbio,bbio-loader", "--compute-ratio", "1.5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    info = json.loads(out.read_text())["machine"]["read"]
    assert info["compute_ratio"] == 1.5
    bbio_step = info["bbio_step_s"]["resnet50"]
    assert bbio_step > 0 and info["loader_compute_s"]["resnet50"] == 1.5 * bbio_step
    refused, _ = run_resnet50(tmp_path, "--systems", "bbio-loader", "--compute-ratio", "1.5")
    assert refused.returncode != 0
    assert "--compute-ratio needs the bbio system" in refused.stdout + refused.stderr


def test_passes_alternate_the_order_and_pool_the_steps(tmp_path):
    result, out = run_resnet50(tmp_path, "--systems", "independent,bbio", "--passes", "3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["read"]["passes"] == 3
    for system in ("independent", "bbio"):
        entry = next(
            r for r in doc["results"] if (r["system"], r["metric"]) == (system, "GB_per_s")
        )
        assert len(entry["values"]) == 3 * STEPS
    order = [
        line.split("resnet50 ")[1].split(":")[0]
        for line in result.stdout.splitlines()
        if "resnet50 independent:" in line or "resnet50 bbio:" in line
    ]
    assert order == ["independent", "bbio", "bbio", "independent", "independent", "bbio"]
