"""Suite ``read-model``: a scale MODEL of collective reads at 64 to 4,096 ranks, not a measurement.

``python -m bbio.bench read-model [--ranks 64,256,1024,4096] [--json FILE] [--plot PNG]``

A box with a few ranks cannot show what the count of requests and of clients
does to a shared parallel file system at thousands of ranks; this suite counts
them with the real planner and turns the counts into time with a stated model.
Only rank 0 computes (the planner is pure, no MPI); other ranks wait.

Counts, for each workload of the ``read`` suite (``WORKLOADS``: sample size and
batch per rank) and each rank count R: the dataset is one raw file of
``--file-size`` bytes of fixed-size samples; the step is step ``--step`` of
epoch 0 of the seeded global shuffle (``epoch_order`` and ``rank_indices``, the
functions ``epoch_batches`` is made of, with ``drop_last=True``, as the
``read`` suite uses).

* ``independent-model``: every rank reads its own samples one by one (a
  PyTorch map-style ``Dataset``): R x batch requests, R clients, one request in
  flight per client (``--independent-inflight``: DataLoader workers raise it),
  the needed bytes.
* ``bbio-model``: :func:`bbio.read.plan.make_plan`, called as ``Dataset.read``
  calls it: ``--ranks-per-node`` consecutive ranks per node, the lowest
  ``--aggregators-per-node`` of each node aggregate, only the PFS holds the
  file, ``read_max_hole`` and ``read_max_bytes`` from the configuration, stripe
  ``--stripe`` (Lustre's default 1 MiB).  Requests are the plan's reads,
  clients the aggregators that issue any, ``io_threads`` requests in flight per
  client (bbio's batched reader), bytes the plan's (holes included).  Where
  :func:`bbio.read.plan.reads_alone` says yes (samples of at least
  ``read_direct_bytes``) or :func:`bbio.read.plan.aggregation_pays` says no
  (``read_min_saving``), it models ``Dataset.read``'s direct path instead:
  every rank reads its own samples, ``io_threads`` in flight.  The extent
  table handed to the planner holds only the step's samples (it reads no other
  row), so a 43-million-sample dataset needs no 1 GB table.

Time model (per step; a roofline, so a lower bound on a real file system)::

    in_flight = min(server_inflight, clients * per_client_inflight)
    seconds   = max(bytes / bandwidth, ceil(requests / in_flight) * latency)

Each request costs one ``latency`` and at most ``in_flight`` are served at once
(waves); bytes move at the aggregate ``bandwidth``; whichever bound is longer
wins.  Defaults (``docs/reading.md`` cites the sources): latency 500 us (flash
Lustre is sub-millisecond per small request), bandwidth 5,000 GB/s and
server_inflight 2,000 (NERSC Perlmutter scratch: >5 TB/s, 4 million 4 KiB
random-read IOPS; 4e6 IOPS x 500 us = 2,000 requests in flight, Little's law).
Not modelled: per-client costs (opens, locks, connections), the exchange
between ranks, caches, other jobs, stragglers.

Metrics per case ``WORKLOAD-RN`` and system: ``requests``, ``clients``,
``bytes_read_over_needed``, ``seconds_per_step`` and ``samples_per_s``.  The
JSON's ``machine.read_model`` holds the parameters.  ``--plot PNG`` draws
samples/s and requests against R, log-log, per workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import bbio.bench as bench
from bbio.bench import BenchContext, GiB, MiB, at_least, byte_size, positive, suite
from bbio.bench.plot import pyplot
from bbio.bench.read import WORKLOADS, Workload
from bbio.config import load_config
from bbio.errors import UsageError
from bbio.read.plan import Extents, Holders, aggregation_pays, make_plan, reads_alone
from bbio.read.sampler import epoch_order, rank_indices, steps_per_epoch
from bbio.report import format_bytes, format_table

LABEL = "MODEL, not a measurement"
SYSTEMS = ("independent-model", "bbio-model")
DEFAULT_RANKS = (64, 256, 1024, 4096)
QUICK_RANKS = (64, 256)
FILE_SIZE = 100 * GiB  # per workload: ImageNet-like (936,457 resnet50 samples)
STRIPE = MiB  # Lustre's default stripe size
# Published figures, cited in docs/reading.md ("Scale model").
LATENCY_US = 500.0  # flash Lustre: sub-millisecond per small request
BANDWIDTH_GBS = 5000.0  # Perlmutter scratch: > 5 TB/s aggregate
SERVER_INFLIGHT = 2000  # Perlmutter scratch: 4e6 IOPS x 500 us (Little's law)
INDEPENDENT_INFLIGHT = 1  # a map-style Dataset reads one sample at a time per rank
TABLE = ("workload", "R", "system", "requests", "clients", "read/needed", "ms/step")
TABLE += ("samples/s", "bound", "bbio path")
METRICS = {
    "requests": "requests",
    "clients": "clients",
    "bytes_read_over_needed": "ratio",
    "seconds_per_step": "s",
    "samples_per_s": "samples/s",
}


@dataclasses.dataclass(frozen=True)
class PfsModel:
    """The stated PFS model: per-request latency, aggregate bandwidth, requests in flight."""

    latency_s: float
    bandwidth_bytes_per_s: float
    server_inflight: int

    def seconds(self, requests: int, nbytes: int, clients: int, per_client: int) -> float:
        """``max(nbytes / bandwidth, ceil(requests / in_flight) * latency)``, where
        ``in_flight = min(server_inflight, clients * per_client)``."""
        transfer = nbytes / self.bandwidth_bytes_per_s
        if requests == 0:
            return transfer
        in_flight = min(self.server_inflight, clients * per_client)
        return max(transfer, math.ceil(requests / in_flight) * self.latency_s)


@dataclasses.dataclass(frozen=True)
class Counts:
    """One system's reads for one step: what reaches the file system."""

    requests: int
    clients: int
    per_client: int  # requests each client keeps in flight
    bytes_read: int
    bytes_needed: int
    direct: bool = False  # bbio: each rank read its own samples (aggregating did not pay)

    @property
    def bytes_read_over_needed(self) -> float:
        """Bytes read (holes included) over bytes the ranks asked for."""
        return self.bytes_read / self.bytes_needed


def step_requests(order: np.ndarray, ranks: int, batch: int, step: int) -> list[np.ndarray]:
    """Every rank's sample ids at ``step``: ``epoch_batches(...)[step]`` with ``drop_last=True``,
    for the epoch ``order``."""
    if step >= steps_per_epoch(order.size, ranks, batch, drop_last=True):
        raise UsageError(
            f"{order.size} samples give fewer than {step + 1} steps of batch {batch} "
            f"on {ranks} ranks",
            hint="pass a larger --file-size or a smaller --ranks",
        )
    return [
        rank_indices(order, ranks, rank, True)[step * batch : (step + 1) * batch]
        for rank in range(ranks)
    ]


def independent_counts(
    requests: Sequence[np.ndarray], sample_bytes: int, per_client: int = INDEPENDENT_INFLIGHT
) -> Counts:
    """Each rank reads each of its samples with one request, ``per_client`` at a time."""
    samples = sum(ids.size for ids in requests)
    clients = sum(1 for ids in requests if ids.size)
    needed = samples * sample_bytes
    return Counts(samples, clients, per_client, needed, needed)


def aggregated_counts(
    requests: Sequence[np.ndarray],
    samples: int,
    sample_bytes: int,
    ranks_per_node: int,
    aggregators_per_node: int,
    io_threads: int,
    stripe: int,
    max_hole: int,
    max_read: int,
    min_saving: float,
    direct_bytes: int,
) -> Counts:
    """What ``Dataset.read`` does for ``requests`` on a raw file of ``samples`` records:
    the aggregators' plan, or direct reads when the samples are large or aggregating
    would not pay."""
    ranks = len(requests)
    counts = [ids.size for ids in requests]
    ids = np.concatenate(requests).astype(np.int64)
    rank_node = [rank // ranks_per_node for rank in range(ranks)]
    aggregators = [r for r in range(ranks) if r % ranks_per_node < aggregators_per_node]
    # Only the step's rows: make_plan reads the extent table at the requested ids alone.
    extents = Extents(
        np.zeros(ids.size, dtype=np.int32),
        ids * sample_bytes,
        np.full(ids.size, sample_bytes, dtype=np.int64),
    )
    needed = int(np.unique(ids).size) * sample_bytes
    holders = Holders.none(rank_node[-1] + 1, 1)
    readers = sum(1 for c in counts if c)
    # Dataset.read's direct path: each rank reads its own samples, io_threads in flight
    direct = Counts(ids.size, readers, io_threads, ids.size * sample_bytes, needed, direct=True)
    if reads_alone(extents, holders, direct_bytes):  # not even the requests are exchanged
        return direct
    plan = make_plan(
        np.repeat(np.arange(ranks), counts),
        np.concatenate([np.arange(c) for c in counts]),
        np.arange(ids.size),
        extents,
        rank_node,
        aggregators,
        holders,
        [samples * sample_bytes],
        stripe,
        max_hole,
        max_read,
    )
    req_rank = np.repeat(np.arange(ranks), counts)
    if not aggregation_pays(
        plan, req_rank, np.arange(ids.size), extents, rank_node, holders, min_saving
    ):
        return direct
    clients = int(np.unique(plan.read_agg).size)
    return Counts(plan.requests_issued, clients, io_threads, plan.bytes_read, needed)


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) <= 0:
        raise argparse.ArgumentTypeError(f"a comma list of positive rank counts, got {text!r}")
    return ranks


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        type=_rank_list,
        help="rank counts R (default 64,256,1024,4096; --quick: 64,256)",
    )
    parser.add_argument(
        "--ranks-per-node", type=at_least(1), default=8, help="ranks per node (default 8)"
    )
    parser.add_argument(
        "--aggregators-per-node",
        type=at_least(1),
        default=1,
        help="bbio aggregators per node (default 1, bbio's default)",
    )
    parser.add_argument(
        "--file-size",
        type=byte_size,
        default=FILE_SIZE,
        metavar="BYTES",
        help="bytes of each workload's dataset (default 100GiB)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the global shuffle's seed")
    parser.add_argument(
        "--step", type=at_least(0), default=0, help="which step of epoch 0 (default 0)"
    )
    parser.add_argument(
        "--stripe", type=byte_size, default=STRIPE, help="stripe size (default 1MiB, Lustre's)"
    )
    parser.add_argument(
        "--io-threads",
        type=at_least(1),
        help="requests in flight per bbio aggregator (default: bbio's io_threads, 8)",
    )
    parser.add_argument(
        "--independent-inflight",
        type=at_least(1),
        default=INDEPENDENT_INFLIGHT,
        help="requests in flight per rank reading independently (default 1: a map-style "
        "Dataset; DataLoader workers raise it)",
    )
    parser.add_argument(
        "--latency-us",
        type=positive,
        default=LATENCY_US,
        help=f"per-request latency in microseconds (default {LATENCY_US:g})",
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=positive,
        default=BANDWIDTH_GBS,
        help=f"aggregate PFS bandwidth in GB/s (default {BANDWIDTH_GBS:g})",
    )
    parser.add_argument(
        "--server-inflight",
        type=at_least(1),
        default=SERVER_INFLIGHT,
        help=f"requests the servers work on at once (default {SERVER_INFLIGHT})",
    )
    parser.add_argument("--plot", metavar="PNG", type=Path, help="draw the curves into PNG")


def plot_model(results: Sequence[dict[str, Any]], output: Path) -> None:
    """Draw samples/s and requests per step against R, log-log, one column per workload.

    ``results`` are the JSON ``results`` entries of a ``read-model`` run.
    """
    plt = pyplot()
    from matplotlib.ticker import NullLocator

    curves: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in results:
        workload, ranks = r["case"].rsplit("-R", 1)
        curves.setdefault((workload, r["system"], r["metric"]), []).append(
            (int(ranks), r["median"])
        )
    workloads = list(dict.fromkeys(key[0] for key in curves))
    rows = (("samples_per_s", "samples/s (model)"), ("requests", "requests per step"))
    fig, axes = plt.subplots(
        len(rows), len(workloads), figsize=(4.2 * len(workloads), 7), squeeze=False
    )
    for column, workload in enumerate(workloads):
        for row, (metric, label) in enumerate(rows):
            ax = axes[row, column]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            for i, system in enumerate(SYSTEMS):
                points = sorted(curves.get((workload, system, metric), []))
                if points:
                    xs, ys = zip(*points, strict=True)
                    style = {"marker": "os"[i], "linestyle": "-:"[i], "color": f"C{i}"}
                    ax.plot(xs, ys, label=system, **style)
                    ax.set_xticks(xs, [str(x) for x in xs])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("ranks R")
            ax.set_ylabel(label)
            ax.set_title(workload if row == 0 else "")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize="small")
    fig.suptitle(f"Collective reads at scale: {LABEL}")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)


def _model_case(
    ctx: BenchContext,
    model: PfsModel,
    name: str,
    workload: Workload,
    order: np.ndarray,
    ranks: int,
    settings: dict[str, Any],
) -> list[tuple[object, ...]]:
    """Count and time one workload at ``ranks``; record it and return its table rows."""
    requests = step_requests(order, ranks, workload.batch, ctx.args.step)
    systems = {
        "independent-model": independent_counts(
            requests, workload.sample_bytes, ctx.args.independent_inflight
        ),
        "bbio-model": aggregated_counts(requests, order.size, workload.sample_bytes, **settings),
    }
    samples = sum(ids.size for ids in requests)
    case, rows = f"{name}-R{ranks}", []
    for system, c in systems.items():
        seconds = model.seconds(c.requests, c.bytes_read, c.clients, c.per_client)
        values = {
            "requests": c.requests,
            "clients": c.clients,
            "bytes_read_over_needed": c.bytes_read_over_needed,
            "seconds_per_step": seconds,
            "samples_per_s": samples / seconds,
        }
        for metric, value in values.items():
            ctx.results.add(case, system, metric, METRICS[metric], value)
        bound = "bandwidth" if c.bytes_read / model.bandwidth_bytes_per_s >= seconds else "requests"
        rows.append(
            (
                name,
                ranks,
                system,
                c.requests,
                c.clients,
                round(c.bytes_read_over_needed, 3),
                f"{seconds * 1000:.2f}",
                f"{samples / seconds:.4g}",
                bound,
                "" if system != "bbio-model" else ("direct" if c.direct else "aggregated"),
            )
        )
    return rows


@suite("read-model", f"scale model of collective reads at 64-4096 ranks ({LABEL})", _arguments)
def run(ctx: BenchContext) -> None:
    """Count and model on rank 0; the other ranks wait at the harness's barrier."""
    if ctx.rank != 0:
        return
    args, config = ctx.args, load_config()
    ranks_list = args.ranks or list(QUICK_RANKS if ctx.quick else DEFAULT_RANKS)
    if args.aggregators_per_node > args.ranks_per_node:
        raise UsageError("--aggregators-per-node cannot exceed --ranks-per-node")
    model = PfsModel(args.latency_us * 1e-6, args.bandwidth_gbs * 1e9, args.server_inflight)
    settings = {
        "ranks_per_node": args.ranks_per_node,
        "aggregators_per_node": args.aggregators_per_node,
        "io_threads": args.io_threads or config.io_threads,
        "stripe": args.stripe,
        "max_hole": config.read_max_hole,
        "max_read": config.read_max_bytes,
        "min_saving": config.read_min_saving / 100,
        "direct_bytes": config.read_direct_bytes,
    }
    ctx.log(
        f"{LABEL}: latency {args.latency_us:g} us, bandwidth {args.bandwidth_gbs:g} GB/s, "
        f"{args.server_inflight} requests in flight at the servers; R = {ranks_list}, "
        f"{args.ranks_per_node} ranks per node; dataset {format_bytes(args.file_size)} "
        f"per workload; " + ", ".join(f"{k} {v}" for k, v in settings.items())
    )
    rows: list[tuple[object, ...]] = []
    for name, workload in WORKLOADS.items():
        order = epoch_order(args.file_size // workload.sample_bytes, args.seed, 0, True)
        for ranks in ranks_list:
            rows += _model_case(ctx, model, name, workload, order, ranks, settings)
        ctx.log(
            f"{name}: {order.size} samples of {workload.sample_bytes} B, batch "
            f"{workload.batch}: counted"
        )
    print(f"{LABEL}\n{format_table(TABLE, rows)}", flush=True)
    bench.record_machine(
        ctx,
        "read_model",
        {
            "model": LABEL,
            "formula": "max(bytes / bandwidth, ceil(requests / min(server_inflight, "
            "clients * per_client_inflight)) * latency)",
            "latency_us": args.latency_us,
            "bandwidth_gbs": args.bandwidth_gbs,
            "server_inflight": args.server_inflight,
            "per_client_inflight": {
                "independent-model": args.independent_inflight,
                "bbio-model": settings["io_threads"],
            },
            "ranks": ranks_list,
            "file_size": args.file_size,
            "seed": args.seed,
            "step": args.step,
            **settings,
        },
    )
    if args.plot:
        plot_model([m.to_json() for m in ctx.results], args.plot)
        ctx.log(f"wrote {args.plot} ({LABEL})")
