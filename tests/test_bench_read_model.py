"""The ``read-model`` suite: counts from the real planner, the time model, and the JSON layout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bbio.bench.__main__ import build_parser
from bbio.bench.read import WORKLOADS
from bbio.bench.read_model import (
    SYSTEMS,
    PfsModel,
    aggregated_counts,
    independent_counts,
    step_requests,
)
from bbio.config import load_config
from bbio.errors import UsageError
from bbio.read.sampler import epoch_batches, epoch_order
from tests.conftest import run_python

GiB = 1 << 30
RANKS_PER_NODE = 8
METRICS = {
    "requests": "requests",
    "clients": "clients",
    "bytes_read_over_needed": "ratio",
    "seconds_per_step": "s",
    "samples_per_s": "samples/s",
}


def _counts(
    name: str, ranks: int, file_size: int, aggregators_per_node: int = 1, min_saving: float = 0.0
):
    workload = WORKLOADS[name]
    config = load_config()
    order = epoch_order(file_size // workload.sample_bytes, 0, 0, True)
    requests = step_requests(order, ranks, workload.batch, 0)
    independent = independent_counts(requests, workload.sample_bytes)
    aggregated = aggregated_counts(
        requests,
        order.size,
        workload.sample_bytes,
        ranks_per_node=RANKS_PER_NODE,
        aggregators_per_node=aggregators_per_node,
        io_threads=config.io_threads,
        stripe=1 << 20,
        max_hole=config.read_max_hole,
        max_read=config.read_max_bytes,
        min_saving=min_saving,
        direct_bytes=0,  # plan every workload, large samples too
    )
    return independent, aggregated


def test_step_requests_are_the_samplers_batches():
    order = epoch_order(10_000, 7, 0, True)
    for step in (0, 3):
        expected = epoch_batches(10_000, 16, 8, 7, 0, True, True)[step]
        got = step_requests(order, 16, 8, step)
        assert len(got) == 16
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_array_equal(mine, theirs)
    with pytest.raises(UsageError, match="fewer than"):
        step_requests(epoch_order(100, 0, 0, True), 64, 2, 0)


@pytest.mark.parametrize("ranks", [64, 256])
def test_resnet50_aggregation_counts(ranks):
    batch = WORKLOADS["resnet50"].batch
    independent, aggregated = _counts("resnet50", ranks, 100 * GiB)
    assert (independent.requests, independent.clients) == (ranks * batch, ranks)
    assert independent.bytes_read_over_needed == 1.0
    assert aggregated.requests <= independent.requests
    assert aggregated.clients == ranks // RANKS_PER_NODE  # every aggregator reads
    assert aggregated.per_client == load_config().io_threads
    assert aggregated.bytes_needed == independent.bytes_needed
    assert 1.0 <= aggregated.bytes_read_over_needed <= 1.1


def test_dense_steps_merge_neighbours():
    # 4 GiB of resnet50 samples: one step at R=256 reads 44% of the file, so many touch
    independent, aggregated = _counts("resnet50", 256, 4 * GiB, aggregators_per_node=2)
    assert aggregated.requests < 0.8 * independent.requests
    assert aggregated.clients == 2 * 256 // RANKS_PER_NODE
    assert 1.0 <= aggregated.bytes_read_over_needed <= 1.1


def test_time_model_hand_computed():
    model = PfsModel(latency_s=1e-3, bandwidth_bytes_per_s=1e9, server_inflight=64)
    # 10 clients x 8 = 80 in flight, capped at 64: ceil(1000 / 64) = 16 waves of 1 ms
    assert model.seconds(1000, 1_000_000, clients=10, per_client=8) == pytest.approx(0.016)
    # 4 clients x 1: 25 waves
    assert model.seconds(100, 0, clients=4, per_client=1) == pytest.approx(0.025)
    # 2 GB at 1 GB/s outlasts one wave
    assert model.seconds(10, 2_000_000_000, clients=10, per_client=8) == pytest.approx(2.0)
    assert model.seconds(0, 0, clients=0, per_client=8) == 0.0
    # docs/reading.md's example: resnet50, R = 4096, independent, default parameters
    default = PfsModel(500e-6, 5000e9, 2000)
    nbytes = 262_144 * WORKLOADS["resnet50"].sample_bytes
    assert default.seconds(262_144, nbytes, clients=4096, per_client=1) == pytest.approx(0.066)


def test_options_parse():
    args = build_parser().parse_args(
        ["read-model", "--ranks", "64,128", "--latency-us", "250", "--server-inflight", "10"]
    )
    assert (args.ranks, args.latency_us, args.server_inflight) == ([64, 128], 250.0, 10)
    assert (args.ranks_per_node, args.aggregators_per_node, args.bandwidth_gbs) == (8, 1, 5000.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["read-model", "--ranks", "64,x"])


def test_suite_writes_documented_json_and_plot(tmp_path):
    out, png = tmp_path / "model.json", tmp_path / "model.png"
    result = run_python(
        "-m",
        "bbio.bench",
        "read-model",
        "--ranks",
        "64,128",
        "--file-size",
        "4GiB",
        "--json",
        str(out),
        "--plot",
        str(png),
        # always aggregate, large samples too: the clients are the aggregators
        env={"BBIO_READ_MIN_SAVING": "0", "BBIO_READ_DIRECT_BYTES": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert "MODEL, not a measurement" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["suite"] == "read-model"
    model = doc["machine"]["read_model"]
    assert model["model"] == "MODEL, not a measurement"
    assert (model["latency_us"], model["server_inflight"], model["ranks"]) == (
        500.0,
        2000,
        [64, 128],
    )
    seen = {(r["case"], r["system"], r["metric"]): r for r in doc["results"]}
    assert len(seen) == len(WORKLOADS) * 2 * len(SYSTEMS) * len(METRICS)
    for name, workload in WORKLOADS.items():
        for ranks in (64, 128):
            for system in SYSTEMS:
                for metric, unit in METRICS.items():
                    entry = seen[(f"{name}-R{ranks}", system, metric)]
                    assert entry["unit"] == unit
                    assert len(entry["values"]) == 1 and entry["median"] > 0
            case = f"{name}-R{ranks}"
            assert seen[(case, "independent-model", "requests")]["median"] == ranks * workload.batch
            assert seen[(case, "bbio-model", "clients")]["median"] == ranks // RANKS_PER_NODE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bbio_model_reads_directly_where_dataset_read_would():
    # 64 ranks over a large dataset merge almost nothing: below 10% saved, direct reads
    independent, bbio = _counts("resnet50", 64, 100 << 30, min_saving=0.1)
    assert bbio.direct and bbio.requests == independent.requests and bbio.clients == 64
    assert bbio.per_client == load_config().io_threads
    # always aggregating (min_saving 0) takes the aggregators' plan
    _, aggregated = _counts("resnet50", 64, 100 << 30, min_saving=0.0)
    assert not aggregated.direct and aggregated.clients == 64 // RANKS_PER_NODE


def test_bbio_model_reads_large_samples_alone_as_dataset_read_does():
    workload = WORKLOADS["cosmoflow"]  # 2.8 MiB samples: above read_direct_bytes
    order = epoch_order((100 << 30) // workload.sample_bytes, 0, 0, True)
    requests = step_requests(order, 64, workload.batch, 0)
    config = load_config()
    settings = dict(ranks_per_node=RANKS_PER_NODE, aggregators_per_node=1, io_threads=8)
    limits = dict(stripe=1 << 20, max_hole=config.read_max_hole, max_read=config.read_max_bytes)
    alone = aggregated_counts(
        requests,
        order.size,
        workload.sample_bytes,
        **settings,
        **limits,
        min_saving=0.0,
        direct_bytes=1 << 20,
    )
    assert alone.direct and alone.clients == 64 and alone.requests == 64 * workload.batch
    planned = aggregated_counts(
        requests,
        order.size,
        workload.sample_bytes,
        **settings,
        **limits,
        min_saving=0.0,
        direct_bytes=0,
    )
    assert not planned.direct and planned.clients == 64 // RANKS_PER_NODE
