"""Suite ``read``: random-access training reads of DLIO-like workloads, bbio against MPI-IO.

``mpirun -n 4 --bind-to none python -m bbio.bench read [--quick] [--json FILE]
[--pfs DIR] [sizes...]``

Run on 4 ranks in 2 virtual nodes (``ranks_per_node=2``: one bbio aggregator
per node).  Cases, one dataset file each (DLIO's record lengths and
computation times, scaled to the batch):

* ``resnet50``: 114,660-byte samples (~112 KiB), batch 64 per rank, 69.6 ms of
  compute per step (DLIO resnet50_a100: 0.435 s per batch of 400);
* ``cosmoflow``: 2,828,486-byte samples (~2.7 MiB), batch 1, 5.51 ms per step
  (DLIO cosmoflow_a100);
* ``bert``: 2,500-byte samples, batch 48, 0.968 s per step (DLIO bert_v100).

Each dataset is a raw file of fixed-size samples plus the same bytes as an
HDF5 file (one contiguous 2-D uint8 dataset ``samples``, shape (N,
sample_bytes)); the first 8 bytes of sample i hold i (little-endian), so every
system's bytes are checked (untimed) after every step.  N is
``--file-size`` / sample bytes (full: 2 GiB, ``--quick``: 128 MiB), at least
what the run reads.  The files live in ``PFS/bbio-bench-read/`` (``--pfs``;
default a temporary directory on local disk, removed at the end), with a
marker file per case: a later run with the same sizes reuses them.

Every system reads exactly the same ids: at step s, rank r reads
``epoch_batches(N, ranks, batch, seed, 0, shuffle=True, drop_last=True)[s][r]``
(a global shuffle), for ``--steps`` steps (full 20, ``--quick`` 4; a case named
in ``--case-steps``, such as ``cosmoflow=400``, takes its own count).  Before
its steps, each system reads one sample per rank of the epoch's last step,
untimed (first calls load code lazily: bbio's first read imports
``numpy.ma``, 0.4 MB of ``.pyc`` per rank).  Systems:

* ``independent``: each rank preads its samples one by one (a PyTorch
  map-style ``Dataset``);
* ``romio``, ``ompio``: ``MPI_File_read_at_all`` with a file view made of an
  hindexed datatype of the rank's samples (sorted offsets) and an hindexed
  memory type that puts each sample where the rank asked for it.  Open MPI
  picks its io component at ``MPI_Init``, so rank 0 runs each as a child job
  (``mpirun -n RANKS python -m bbio.bench._read_mpiio``, ``OMPI_MCA_io`` set,
  the parent job's ``OMPI_*``/``PMIX_*`` variables removed) over all cases,
  after the in-process systems; the other ranks sleep in a polled barrier.
  ``--mpiio-aggregators`` (default 2, as bbio: ROMIO hints ``cb_nodes`` and
  ``cb_config_list``, OMPIO ``io_ompio_num_aggregators``; 0: the libraries'
  defaults);
* ``h5py-collective``: h5py with the ``mpio`` driver, each rank reading its
  sorted ids as a fancy selection inside ``dset.collective``, then putting
  them in its order (Open MPI's default io component below HDF5);
* ``bbio``: ``Dataset.read`` (aggregated collective reads);
* ``bbio-loader`` / ``bbio-loader-noprefetch``: ``bbio.Loader`` (prefetch
  ``--prefetch``, default 2; or 0) with a ``time.sleep`` of the case's
  compute time per step, or with ``--compute-ratio R`` of R times the median
  step time ``bbio`` measured just before on the same case (the issue's AU
  target: R = 1.5);
* ``seq-read``: rank 0 reads the whole raw file in 1 MiB reads, one stream
  (the physical limit).

Metrics, per step for the step systems (a value per step; the table shows
medians), per run for the loaders and ``seq-read``: ``samples_per_s`` and
``GB_per_s`` (needed bytes over the slowest rank's time from a common barrier;
for the loaders the whole loop, compute included, so their upper bound is
batch / compute time), ``pfs_requests`` (read system calls of all ranks during
the step, ``syscr`` of ``/proc/self/io``, the counters' own reads subtracted;
loaders: per step fetched; ``seq-read``: scaled to one step's needed bytes)
and ``bytes_read_over_needed`` (``rchar`` over needed bytes).  The loaders
also report ``au``: DLIO's accelerator utilisation, compute time over the
loop's wall time per rank, averaged over ranks (DLIO's bar: 0.90).

Caches: before every system of every case rank 0 runs ``sync`` and ``echo 1
> /proc/sys/vm/drop_caches`` (needs root; ``--no-drop-caches`` skips it);
with ``--cold-steps`` also before every step of the step systems (untimed):
without it, what a system read in excess at one step (ROMIO's whole file
domains, the kernel's readahead past a buffered read) may be served from the
page cache at a later one, which a dataset much larger than memory would not
allow (the documented runs use it).

Passes: ``--passes N`` measures every system N times, each pass in the
reverse order of the one before (cases and systems, the MPI-IO jobs last
going forward and first going back), and pools the steps of all passes, so a
drift of the file system during the run (its daemons' caches, the host's load)
weighs on every system alike.  The loaders' ``--compute-ratio`` uses bbio's
median step time over the passes run so far.
The JSON's ``machine.read`` holds the sizes, paths, cache drops, bbio's own
request counts against ``syscr`` (and how many calls each rank read directly,
aggregating not paying), the io components the MPI-IO jobs loaded,
and, when GlusterFS brick processes (``glusterfsd``) run on this machine, their
``/proc/PID/io`` deltas per case and system (what reached the PFS servers).
When the PFS is a mount of its own, rank 0 looks for other processes with
files open in it before and after every system (``foreign_users``, and a
warning in the log): another benchmark on the same volume spoils the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import bbio.bench as bench
from bbio.bench import (
    BenchContext,
    GiB,
    IoCounters,
    MiB,
    at_least,
    byte_size,
    drop_caches,
    fs_type,
    idle_barrier,
    mount_of,
    names,
    parse_io,
    positive,
    suite,
)
from bbio.config import Config, load_config
from bbio.errors import UsageError
from bbio.read.datasets import open_dataset
from bbio.read.loader import Loader
from bbio.read.sampler import epoch_batches
from bbio.report import format_bytes

DATA_FORMAT = "bbio-bench-read/1"
DATA_DIR = "bbio-bench-read"
RANKS_PER_NODE = 2
SEQ_READ = MiB
STAMP = 8  # bytes of each sample holding its id


@dataclasses.dataclass(frozen=True)
class Workload:
    """One DLIO-like case: sample size, batch per rank and compute time per step."""

    sample_bytes: int
    batch: int
    compute_s: float
    source: str


WORKLOADS = {
    "resnet50": Workload(114_660, 64, 0.435 / 400 * 64, "DLIO resnet50_a100: 0.435 s / 400"),
    "cosmoflow": Workload(2_828_486, 1, 0.00551, "DLIO cosmoflow_a100: 5.51 ms / 1"),
    "bert": Workload(2_500, 48, 0.968, "DLIO bert_v100: 0.968 s / 48"),
}
IN_PROCESS = (
    "independent",
    "h5py-collective",
    "bbio",
    "bbio-loader",
    "bbio-loader-noprefetch",
    "seq-read",
)
MPIIO = {"romio": "romio321", "ompio": "ompio"}
ALL_SYSTEMS = (*IN_PROCESS, *MPIIO)
FULL = {"file_size": 2 * GiB, "steps": 20}
QUICK = {"file_size": 128 * MiB, "steps": 4}
# Environment variables of the parent job a child mpirun may keep.
KEEP_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
    "OMPI_MCA_rmaps_base_oversubscribe",
    "OMPI_MCA_mpi_yield_when_idle",
}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pfs", metavar="DIR", help="where the datasets live (default: a local temp directory)"
    )
    parser.add_argument(
        "--file-size",
        type=byte_size,
        metavar="BYTES",
        help="bytes of each case's dataset (full: 2GiB, --quick: 128MiB)",
    )
    parser.add_argument("--steps", type=at_least(1), help="steps per system (full 20, quick 4)")
    parser.add_argument(
        "--case-steps",
        type=_case_steps,
        default={},
        metavar="CASE=N,...",
        help="steps per system of the named cases instead (cheap steps, such as "
        "cosmoflow's, need many to average the file system's swings out)",
    )
    parser.add_argument(
        "--passes",
        type=at_least(1),
        default=1,
        help="measure every system this many times, in reverse order every other pass "
        "(A B, B A, ...); the steps of all passes are pooled (default 1)",
    )
    parser.add_argument(
        "--sample-scale",
        type=positive,
        default=1.0,
        help="multiply every case's sample size by this (tests; at least 16 bytes)",
    )
    parser.add_argument(
        "--batch-scale",
        type=positive,
        default=1.0,
        help="multiply every case's batch by this (tests; at least 1)",
    )
    parser.add_argument(
        "--compute-scale",
        type=at_least(0, float),
        default=1.0,
        help="multiply every case's compute time per step by this (default 1: DLIO's)",
    )
    parser.add_argument(
        "--compute-ratio",
        type=positive,
        help="instead: the loaders' compute per step is this times bbio's median step time "
        "measured just before in the same run (the AU target uses 1.5; needs system bbio)",
    )
    parser.add_argument(
        "--cases", type=names(tuple(WORKLOADS)), default=list(WORKLOADS), help="comma list"
    )
    parser.add_argument(
        "--systems", type=names(ALL_SYSTEMS), default=list(ALL_SYSTEMS), help="comma list"
    )
    parser.add_argument("--seed", type=int, default=0, help="the global shuffle's seed")
    parser.add_argument("--prefetch", type=at_least(1), default=2, help="bbio-loader prefetch")
    parser.add_argument(
        "--io-threads", type=at_least(1), help="bbio's reader threads (default: config, 8)"
    )
    parser.add_argument(
        "--mpiio-aggregators",
        type=int,
        default=2,
        metavar="N",
        help="ROMIO/OMPIO aggregators (default 2, one per virtual node as bbio; 0: defaults)",
    )
    parser.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="do not drop the page cache before each system (default: drop it, as root)",
    )
    parser.add_argument(
        "--cold-steps",
        action="store_true",
        help="also drop the page cache before every step (untimed) of the step systems",
    )
    parser.add_argument(
        "--clean", action="store_true", help="remove the datasets at the end, even in --pfs"
    )


def _case_steps(text: str) -> dict[str, int]:
    """Option parser: ``CASE=N,...`` with known cases and N >= 1."""
    chosen = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, _, count = item.partition("=")
        if name not in WORKLOADS or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(
                f"expected CASE=N with CASE among {', '.join(WORKLOADS)} and N >= 1 (got {item!r})"
            )
        chosen[name] = int(count)
    return chosen


# ------------------------------------------------------------------ helpers shared with the worker


def server_pids() -> list[int]:
    """PIDs of GlusterFS brick daemons on this machine (empty when none, or not readable)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == "glusterfsd":
                    pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


def server_counters(pids: list[int]) -> dict[str, int] | None:
    """``syscr``, ``rchar`` and ``read_bytes`` summed over ``pids`` (None if unreadable)."""
    if not pids:
        return None
    total = {"syscr": 0, "rchar": 0, "read_bytes": 0}
    try:
        for pid in pids:
            values = parse_io(Path(f"/proc/{pid}/io").read_text())
            for key in total:
                total[key] += values[key]
    except (OSError, KeyError):
        return None
    return total


def server_delta(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """``after - before`` per counter (None when either is missing)."""
    if before is None or after is None:
        return None
    return {key: after[key] - before[key] for key in before}


def check_samples(data: np.ndarray, ids: np.ndarray, what: str) -> None:
    """Every row of ``data`` starts with its sample id (else AssertionError)."""
    got = np.ascontiguousarray(data.reshape(len(ids), -1)[:, :STAMP]).view("<u8").reshape(-1)
    if not np.array_equal(got, np.asarray(ids, dtype=np.uint64)):
        bad = int(np.flatnonzero(got != np.asarray(ids, dtype=np.uint64))[0])
        raise AssertionError(f"{what}: row {bad} holds sample {got[bad]}, expected {ids[bad]}")


# ------------------------------------------------------------------ the datasets


@dataclasses.dataclass(frozen=True)
class Case:
    """A case with its sizes for this run."""

    name: str
    sample_bytes: int
    batch: int
    compute_s: float
    samples: int
    source: str
    steps: int

    @property
    def file_bytes(self) -> int:
        return self.samples * self.sample_bytes

    def spec(self) -> dict[str, Any]:
        return {"format": DATA_FORMAT, "sample_bytes": self.sample_bytes, "samples": self.samples}


def make_cases(args: argparse.Namespace, ranks: int, file_size: int, steps: int) -> list[Case]:
    """The chosen cases, scaled, with their steps (``steps`` unless ``--case-steps`` names
    the case); each file holds at least what the run reads."""
    cases = []
    for name in args.cases:
        w = WORKLOADS[name]
        sample = max(2 * STAMP, round(w.sample_bytes * args.sample_scale))
        batch = max(1, round(w.batch * args.batch_scale))
        case_steps = args.case_steps.get(name, steps)
        # at least the measured steps and one more (its first samples warm each system up)
        samples = max(file_size // sample, (case_steps + 1) * ranks * batch)
        compute = w.compute_s * args.compute_scale
        cases.append(Case(name, sample, batch, compute, samples, w.source, case_steps))
    return cases


def _pool() -> np.ndarray:
    return np.random.default_rng(4242).integers(0, 256, 32 * MiB, dtype=np.uint8)


def _rows(pool: np.ndarray, first: int, count: int, sample: int) -> np.ndarray:
    """Samples ``first .. first + count - 1``: pool bytes, each stamped with its id."""
    nbytes = count * sample
    start = (first * 40_961) % max(1, pool.size - nbytes)
    flat = pool[start : start + nbytes].copy() if nbytes <= pool.size else np.resize(pool, nbytes)
    rows = flat.reshape(count, sample)
    rows[:, :STAMP] = np.arange(first, first + count, dtype="<u8").view(np.uint8).reshape(-1, 8)
    return rows


def _create_hdf5(path: Path, samples: int, sample: int) -> int:
    """An HDF5 file with a contiguous uint8 dataset ``samples`` allocated, unwritten: its offset."""
    import h5py

    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        space = h5py.h5s.create_simple((samples, sample))
        dset = h5py.h5d.create(f.id, b"samples", h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl)
        return int(dset.get_offset())


class Datasets:
    """The cases' files in the PFS: generated in parallel once, reused when the marker matches."""

    def __init__(self, ctx: BenchContext, root: Path) -> None:
        self.ctx, self.root = ctx, root
        self.status: dict[str, str] = {}

    def raw(self, case: Case) -> Path:
        return self.root / f"{case.name}.raw"

    def hdf5(self, case: Case) -> Path:
        return self.root / f"{case.name}.h5"

    def _marker(self, case: Case) -> Path:
        return self.root / f".{case.name}.json"

    def _reusable(self, case: Case) -> bool:
        try:
            old = json.loads(self._marker(case).read_text())
        except (OSError, ValueError):
            return False
        return (
            old.get("spec") == case.spec()
            and self.raw(case).is_file()
            and self.raw(case).stat().st_size == case.file_bytes
            and self.hdf5(case).is_file()
            and self.hdf5(case).stat().st_size >= case.file_bytes
        )

    def generate(self, case: Case) -> None:
        """Collective: make (or reuse) the raw and HDF5 files of ``case``."""
        comm, rank, size = self.ctx.comm, self.ctx.rank, self.ctx.comm.Get_size()
        base = None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if not self._reusable(case):
                self._marker(case).unlink(missing_ok=True)
                with open(self.raw(case), "wb") as f:
                    f.truncate(case.file_bytes)
                base = _create_hdf5(self.hdf5(case), case.samples, case.sample_bytes)
        base = comm.bcast(base, root=0)
        if base is None:
            self.status[case.name] = "reused"
            self.ctx.log(f"{case.name}: reusing {self.raw(case)} and .h5 (marker matches)")
            return
        self.status[case.name] = "generated"
        self.ctx.log(
            f"{case.name}: generating {case.samples} samples of {case.sample_bytes} bytes "
            f"({format_bytes(case.file_bytes)}) as {self.raw(case)} and .h5"
        )
        started = time.monotonic()
        pool = _pool()
        per_chunk = max(1, (16 * MiB) // case.sample_bytes)
        share = -(-case.samples // size)
        raw_fd = os.open(self.raw(case), os.O_WRONLY)
        h5_fd = os.open(self.hdf5(case), os.O_WRONLY)
        try:
            for first in range(rank * share, min(case.samples, (rank + 1) * share), per_chunk):
                count = min(per_chunk, case.samples - first, (rank + 1) * share - first)
                rows = memoryview(_rows(pool, first, count, case.sample_bytes).reshape(-1))
                for fd, offset in ((raw_fd, 0), (h5_fd, base)):
                    done = 0
                    while done < rows.nbytes:
                        done += os.pwrite(
                            fd, rows[done:], offset + first * case.sample_bytes + done
                        )
            os.fsync(raw_fd)
            os.fsync(h5_fd)
        finally:
            os.close(raw_fd)
            os.close(h5_fd)
        idle_barrier(comm)
        if rank == 0:
            marker = {
                "spec": case.spec(),
                "hdf5_data_offset": base,
                "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.monotonic() - started, 2),
            }
            self._marker(case).write_text(json.dumps(marker, indent=1) + "\n")
            self.ctx.log(f"{case.name}: generated in {marker['seconds']:.1f} s")
        comm.Barrier()


# ------------------------------------------------------------------ the run


def foreign_users(mount: str, mine: set[int]) -> list[str]:
    """Processes outside this job (not ``mine`` nor their descendants) using files under ``mount``.

    Other benchmarks on a shared PFS make the numbers meaningless; this is
    how a run notices them (a snapshot: short-lived users may be missed).
    """
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue

    def ours(pid: int) -> bool:
        for _ in range(64):
            if pid in mine:
                return True
            if pid <= 1 or pid not in parents:
                return False
            pid = parents[pid]
        return False

    prefix = mount.rstrip("/") + "/"
    found = []
    for pid in parents:
        if ours(pid):
            continue
        base = f"/proc/{pid}"
        try:
            links = [os.readlink(f"{base}/cwd")]
            links += [os.readlink(f"{base}/fd/{fd}") for fd in os.listdir(f"{base}/fd")]
        except OSError:
            continue
        if any(link == mount or link.startswith(prefix) for link in links):
            try:
                comm = Path(f"{base}/comm").read_text().strip()
            except OSError:
                comm = "?"
            found.append(f"{pid} {comm}")
    return found


def child_env(component: str, aggregators: int) -> dict[str, str]:
    """The environment of a child MPI job: no trace of this job, ``OMPI_MCA_io`` set."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_")) or k in KEEP_ENV
    }
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMPI_MCA_io"] = component
    if aggregators > 0 and component == "ompio":
        env["OMPI_MCA_io_ompio_num_aggregators"] = str(aggregators)
    # the child must import this very bbio, wherever the parent found it
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class ReadBench:
    """State of one suite run (the same object on every rank)."""

    def __init__(self, ctx: BenchContext, cases: list[Case], data: Datasets, work: Path):
        self.ctx, self.cases, self.data, self.work = ctx, cases, data, work
        self.comm = ctx.comm
        self.rank, self.size = ctx.rank, ctx.comm.Get_size()
        self.args = ctx.args
        self.counters = IoCounters()
        self.servers = server_pids() if self.rank == 0 else []
        self.drops: list[bool] = []
        self.mine = set(self.comm.allgather(os.getpid()))
        mount, _ = mount_of(self.data.root)
        self.watch = mount if mount not in ("", "/") else None  # a separate PFS mount
        self.foreign: dict[str, list[str]] = {}
        self.server: dict[str, dict[str, Any]] = {}
        self.bbio_requests: dict[str, dict[str, float]] = {}
        self.step_times: dict[tuple[str, str], list[float]] = {}  # per (case, system), pooled
        self.compute: dict[str, float] = {}  # the loaders' compute per step, per case
        self.io_components: dict[str, Any] = {}
        self.io_threads = self.args.io_threads or load_config().io_threads
        self.ids: dict[str, np.ndarray] = {}
        self.warm: dict[str, np.ndarray] = {}
        for case in cases:
            batches = epoch_batches(
                case.samples, self.size, case.batch, self.args.seed, 0, True, True
            )
            self.ids[case.name] = np.asarray(batches[: case.steps], dtype=np.int64)
            # warm-up (untimed, before each system): one sample per rank of the epoch's last
            # step, never a measured one; it loads what a first call loads lazily
            self.warm[case.name] = np.asarray(batches[-1], dtype=np.int64)[:, :1]

    def config(self) -> Config:
        return Config(
            ranks_per_node=RANKS_PER_NODE,
            progress="never",
            bb_root=str(self.work / "bb-{node}"),
            aggregators_per_node=1,
            io_threads=self.io_threads,
        )

    # -- bookkeeping

    def step_seconds(self) -> dict[tuple[str, str], float]:
        """The median step time of each (case, system) measured step by step, all passes."""
        return {key: float(np.median(times)) for key, times in self.step_times.items()}

    def prepare(self) -> None:
        """Collective: drop caches, then start together."""
        if self.rank == 0:
            self.drops.append(drop_caches(self.args.drop_caches))
        idle_barrier(self.comm)

    def look_around(self, what: str) -> None:
        """Rank 0: note other processes using the PFS mount, and the load average."""
        if self.rank != 0 or self.watch is None:
            return
        users = foreign_users(self.watch, self.mine)
        if users:
            load = Path("/proc/loadavg").read_text().split()[0]
            seen = self.foreign.setdefault(what, [])
            seen.extend(u for u in users if u not in seen)
            self.ctx.log(f"WARNING: {what}: others use {self.watch} (load {load}): {users[:5]}")

    def _server_begin(self) -> dict | None:
        return server_counters(self.servers) if self.rank == 0 else None

    def _server_end(self, case: Case, system: str, before: dict | None, needed: int) -> None:
        if self.rank != 0 or before is None:
            return
        delta = server_delta(before, server_counters(self.servers))
        if delta is not None:
            self._add_server(case, system, {**delta, "needed_bytes": needed})

    def _add_server(self, case: Case, system: str, delta: dict[str, int]) -> None:
        """Add one measurement's server counters to the system's (summed over passes)."""
        total = self.server.setdefault(case.name, {}).setdefault(system, {})
        for key, value in delta.items():
            total[key] = total.get(key, 0) + value

    def record(self, case: Case, system: str, seconds: float, syscr: float, rchar: float, needed):
        """Rank 0: one value of every metric (``syscr`` already per step)."""
        if self.rank != 0:
            return
        results = self.ctx.results
        results.add(
            case.name, system, "samples_per_s", "samples/s", needed / case.sample_bytes / seconds
        )
        results.add(case.name, system, "GB_per_s", "GB/s", needed / seconds / 1e9)
        results.add(case.name, system, "pfs_requests", "requests", syscr)
        results.add(case.name, system, "bytes_read_over_needed", "ratio", rchar / needed)

    def step_needed(self, case: Case) -> int:
        return self.size * case.batch * case.sample_bytes

    def steps_of(
        self, case: Case, system: str, read: Callable[[np.ndarray], np.ndarray], stats=None
    ) -> None:
        """Collective: ``read`` this rank's ids step by step, timed from a common barrier."""
        from mpi4py import MPI

        needed = self.step_needed(case)
        check_samples(read(self.warm[case.name][self.rank]), self.warm[case.name][self.rank], "")
        server = self._server_begin()
        own, step_seconds = [], []
        for step in range(case.steps):
            ids = self.ids[case.name][step][self.rank]
            requests_before = stats.requests if stats is not None else 0
            if self.args.cold_steps and self.rank == 0:
                self.drops.append(drop_caches(self.args.drop_caches))
            self.comm.Barrier()
            before = self.counters.snapshot()
            start = time.perf_counter()
            data = read(ids)
            seconds = time.perf_counter() - start
            syscr, rchar = self.counters.delta(before, self.counters.snapshot())
            check_samples(data, ids, f"{case.name} {system} step {step}")
            seconds = self.comm.allreduce(seconds, op=MPI.MAX)
            step_seconds.append(seconds)
            syscr, rchar = (int(v) for v in self.comm.allreduce(np.array([syscr, rchar])))
            self.record(case, system, seconds, syscr, rchar, needed)
            if stats is not None:
                own.append((stats.requests - requests_before, syscr))
        self._server_end(case, system, server, needed * case.steps)
        self.step_times.setdefault((case.name, system), []).extend(step_seconds)
        if own:
            self.bbio_requests.setdefault(case.name, {})[system] = {
                "stats_requests_per_step": float(np.median([o[0] for o in own])),
                "syscr_per_step": float(np.median([o[1] for o in own])),
                "direct_calls": stats.direct_calls,  # read by each rank: aggregating did not pay
                "calls": stats.calls,
            }
        self.ctx.log(f"{case.name} {system}: {self._summary(case, system)}")

    def _summary(self, case: Case, system: str) -> str:
        if self.rank != 0:
            return ""
        parts = []
        for metric, fmt in (
            ("samples_per_s", "{:.0f} samples/s"),
            ("GB_per_s", "{:.3f} GB/s"),
            ("pfs_requests", "{:.0f} requests"),
            ("bytes_read_over_needed", "x{:.2f} bytes"),
            ("au", "AU {:.2f}"),
        ):
            try:
                parts.append(fmt.format(self.ctx.results.get(case.name, system, metric).median))
            except KeyError:
                continue
        return ", ".join(parts)

    # -- the systems

    def independent(self, case: Case) -> None:
        fd = os.open(self.data.raw(case), os.O_RDONLY)
        sample = case.sample_bytes

        def read(ids: np.ndarray) -> np.ndarray:
            out = np.empty((ids.size, sample), dtype=np.uint8)
            for i, sid in enumerate(ids.tolist()):
                view, offset = memoryview(out[i]), sid * sample
                while view.nbytes:
                    n = os.preadv(fd, [view], offset)
                    if n <= 0:
                        raise OSError(f"short read of sample {sid} in {self.data.raw(case)}")
                    view, offset = view[n:], offset + n
            return out

        try:
            self.steps_of(case, "independent", read)
        finally:
            os.close(fd)

    def h5py_collective(self, case: Case) -> None:
        import h5py

        comm = self.comm.Dup()
        try:
            with h5py.File(self.data.hdf5(case), "r", driver="mpio", comm=comm) as f:
                dset = f["samples"]

                def read(ids: np.ndarray) -> np.ndarray:
                    order = np.argsort(ids, kind="stable")
                    with dset.collective:
                        rows = dset[ids[order]]
                    out = np.empty_like(rows)
                    out[order] = rows
                    return out

                self.steps_of(case, "h5py-collective", read)
        finally:
            comm.Free()
        if self.rank == 0:
            self.io_components["h5py-collective"] = loaded_io_components()

    def bbio(self, case: Case) -> None:
        shape = (case.sample_bytes,)
        with open_dataset(
            self.comm, self.data.raw(case), sample_shape=shape, dtype="u1", config=self.config()
        ) as ds:
            self.steps_of(case, "bbio", ds.read, stats=ds.stats)

    def compute_seconds(self, case: Case) -> float:
        """The loaders' simulated compute per step: the case's, or ``--compute-ratio`` times
        bbio's median step time of this run."""
        ratio = self.args.compute_ratio  # run() checked that bbio runs (before the loaders)
        bbio_step = self.step_seconds().get((case.name, "bbio"), 0.0)
        seconds = case.compute_s if ratio is None else ratio * bbio_step
        self.compute[case.name] = seconds
        return seconds

    def loader(self, case: Case, system: str, prefetch: int) -> None:
        """Collective: ``steps`` steps of a Loader with ``compute_s`` of sleep per step."""
        from mpi4py import MPI

        shape = (case.sample_bytes,)
        compute_s = self.compute_seconds(case)
        with open_dataset(
            self.comm, self.data.raw(case), sample_shape=shape, dtype="u1", config=self.config()
        ) as ds:
            ds.read(self.warm[case.name][self.rank])
            server = self._server_begin()
            loader = Loader(
                self.comm,
                ds,
                case.batch,
                self.args.seed,
                epochs=1,
                shuffle=True,
                drop_last=True,
                prefetch=prefetch,
            )
            self.comm.Barrier()
            before = self.counters.snapshot()
            calls, requests = ds.stats.calls, ds.stats.requests
            compute = 0.0
            start = time.perf_counter()
            try:
                batches = iter(loader)
                for step in range(case.steps):
                    data = next(batches)
                    expected = self.ids[case.name][step][self.rank]
                    if not np.array_equal(loader.indices, expected):
                        raise AssertionError(f"{case.name} {system}: step {step} ids differ")
                    check_samples(data, expected, f"{case.name} {system} step {step}")
                    began = time.perf_counter()
                    time.sleep(compute_s)
                    compute += time.perf_counter() - began
                seconds = time.perf_counter() - start
            finally:
                loader.close()  # joins the prefetching thread: its reads are counted below
            syscr, rchar = self.counters.delta(before, self.counters.snapshot())
            fetched = ds.stats.calls - calls
            own = ds.stats.requests - requests
        au = self.comm.allreduce(compute / seconds) / self.size
        wall = self.comm.allreduce(seconds, op=MPI.MAX)
        syscr, rchar = (int(v) for v in self.comm.allreduce(np.array([syscr, rchar])))
        needed = self.step_needed(case)
        self._server_end(case, system, server, needed * fetched)
        if self.rank == 0:
            results = self.ctx.results
            total = needed * case.steps
            results.add(
                case.name, system, "samples_per_s", "samples/s", total / case.sample_bytes / wall
            )
            results.add(case.name, system, "GB_per_s", "GB/s", total / wall / 1e9)
            results.add(case.name, system, "pfs_requests", "requests", syscr / fetched)
            results.add(
                case.name, system, "bytes_read_over_needed", "ratio", rchar / (needed * fetched)
            )
            results.add(case.name, system, "au", "ratio", au)
            self.bbio_requests.setdefault(case.name, {})[system] = {
                "stats_requests_per_step": own / fetched,
                "syscr_per_step": syscr / fetched,
                "steps_fetched": fetched,
                "direct_calls": ds.stats.direct_calls,
                "calls": ds.stats.calls,
            }
        self.ctx.log(f"{case.name} {system}: {self._summary(case, system)}")

    def seq_read(self, case: Case) -> None:
        """Rank 0 reads the whole raw file, 1 MiB at a time; the others sleep."""
        server = self._server_begin()
        if self.rank == 0:
            buffer = memoryview(bytearray(SEQ_READ))
            fd = os.open(self.data.raw(case), os.O_RDONLY)
            try:
                before = self.counters.snapshot()
                start = time.perf_counter()
                total = 0
                while n := os.readv(fd, [buffer]):
                    total += n
                seconds = time.perf_counter() - start
                syscr, rchar = self.counters.delta(before, self.counters.snapshot())
            finally:
                os.close(fd)
            if total != case.file_bytes:
                raise AssertionError(f"seq-read read {total} bytes of {case.file_bytes}")
            scale = self.step_needed(case) / total  # requests for one step's bytes
            self.record(case, "seq-read", seconds, syscr * scale, rchar, total)
        self._server_end(case, "seq-read", server, case.file_bytes)
        idle_barrier(self.comm)
        self.ctx.log(f"{case.name} seq-read: {self._summary(case, 'seq-read')}")

    def mpiio(self, system: str) -> None:
        """Collective: rank 0 runs ``system`` as a child MPI job over all cases."""
        component = MPIIO[system]
        failure = None
        if self.rank == 0:
            try:
                self.look_around(system)
                self._child_job(system, component)
                self.look_around(system)
            except Exception as exc:  # every rank must leave the barrier below
                failure = f"{type(exc).__name__}: {exc}"
        idle_barrier(self.comm)
        failure = self.comm.bcast(failure, root=0)
        if failure:
            raise RuntimeError(f"the {system} child job failed: {failure}")

    def _child_job(self, system: str, component: str) -> None:
        spec = {
            "system": system,
            "component": component,
            "drop_caches": bool(self.args.drop_caches),
            "cold_steps": bool(self.args.cold_steps),
            "aggregators": self.args.mpiio_aggregators,
            "server_pids": self.servers,
            "cases": [],
        }
        for case in self.cases:
            ids_file = self.work / f"ids-{case.name}.npy"
            if not ids_file.exists():
                np.save(ids_file, self.ids[case.name])
            spec["cases"].append(
                {
                    "name": case.name,
                    "path": str(self.data.raw(case)),
                    "sample_bytes": case.sample_bytes,
                    "ids": str(ids_file),
                    "warm": self.warm[case.name].tolist(),
                }
            )
        spec_file = self.work / f"{system}-spec.json"
        out_file = self.work / f"{system}-out.json"
        spec_file.write_text(json.dumps(spec))
        command = [
            "mpirun",
            "-n",
            str(self.size),
            "--bind-to",
            "none",
            sys.executable,
            "-m",
            "bbio.bench._read_mpiio",
            str(spec_file),
            str(out_file),
        ]
        self.ctx.log(f"{system}: child job OMPI_MCA_io={component}: {' '.join(command[:5])} ...")
        proc = subprocess.run(
            command,
            env=child_env(component, self.args.mpiio_aggregators),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not out_file.exists():
            raise RuntimeError(
                f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            )
        result = json.loads(out_file.read_text())
        self.io_components[system] = result["components"]
        self.drops.extend(result["drops"])
        for case in self.cases:
            got = result["cases"][case.name]
            needed = self.step_needed(case)
            for seconds, syscr, rchar in zip(
                got["seconds"], got["syscr"], got["rchar"], strict=True
            ):
                self.record(case, system, seconds, syscr, rchar, needed)
            if got.get("server") is not None:
                needed_bytes = needed * len(got["seconds"])
                self._add_server(case, system, {**got["server"], "needed_bytes": needed_bytes})
            self.ctx.log(f"{case.name} {system}: {self._summary(case, system)}")

    def run_case(self, case: Case, backwards: bool) -> None:
        """Collective: the in-process systems on one case (in reverse order if
        ``backwards``), caches dropped before each."""
        chosen = self.args.systems
        systems: list[tuple[str, Callable[[], None]]] = [
            ("independent", lambda: self.independent(case)),
            ("h5py-collective", lambda: self.h5py_collective(case)),
            ("bbio", lambda: self.bbio(case)),
            ("bbio-loader", lambda: self.loader(case, "bbio-loader", self.args.prefetch)),
            ("bbio-loader-noprefetch", lambda: self.loader(case, "bbio-loader-noprefetch", 0)),
            ("seq-read", lambda: self.seq_read(case)),
        ]
        for name, measure in reversed(systems) if backwards else systems:
            if name in chosen:
                self.prepare()
                self.look_around(f"{case.name} {name}")
                measure()
                self.look_around(f"{case.name} {name}")


def loaded_io_components() -> list[str]:
    """Open MPI's io, fs and fcoll components mapped into this process (which one reads)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit("/", 1)[-1].strip()
                if name.startswith(("mca_io_", "mca_fs_", "mca_fcoll_")):
                    found.add(name.removesuffix(".so"))
    except OSError:
        pass
    return sorted(found)


@suite("read", "random-access DLIO-like reads: bbio vs pread, ROMIO, OMPIO, h5py", _arguments)
def run(ctx: BenchContext) -> None:
    """Generate (or reuse) the datasets, then measure every case and system."""
    comm, args = ctx.comm, ctx.args
    if args.compute_ratio is not None and "bbio" not in args.systems:
        raise UsageError("--compute-ratio needs the bbio system in --systems")
    sizes = dict(QUICK if ctx.quick else FULL)
    sizes["file_size"] = args.file_size or sizes["file_size"]
    sizes["steps"] = args.steps or sizes["steps"]
    temporary_pfs = args.pfs is None
    paths = None
    if ctx.rank == 0:
        pfs = Path(tempfile.mkdtemp(prefix="bbio-bench-read-pfs-")) if temporary_pfs else None
        pfs = pfs or Path(args.pfs)
        work = Path(tempfile.mkdtemp(prefix="bbio-bench-read-"))
        paths = (str(pfs), str(work))
    pfs_text, work_text = comm.bcast(paths, root=0)
    pfs, work = Path(pfs_text), Path(work_text)
    cases = make_cases(args, comm.Get_size(), sizes["file_size"], sizes["steps"])
    data = Datasets(ctx, pfs / DATA_DIR)
    try:
        ctx.log(
            f"read suite: {comm.Get_size()} ranks, {RANKS_PER_NODE} per virtual node; "
            f"PFS {pfs} ({fs_type(pfs)}); "
            + "; ".join(
                f"{c.name}: {c.steps} steps, {c.samples} x {c.sample_bytes} B "
                f"({format_bytes(c.file_bytes)}), "
                f"batch {c.batch}, compute {c.compute_s * 1000:.1f} ms"
                for c in cases
            )
        )
        for case in cases:
            data.generate(case)
        bench_run = ReadBench(ctx, cases, data, work)
        ctx.nodes = -(-bench_run.size // RANKS_PER_NODE)
        if ctx.rank == 0 and bench_run.servers:
            ctx.log(f"GlusterFS bricks found (PIDs {bench_run.servers}): their reads are recorded")
        mpiio = [system for system in MPIIO if system in args.systems]
        for number in range(args.passes):
            if args.passes > 1:
                ctx.log(f"pass {number + 1} of {args.passes}")
            backwards = number % 2 == 1  # A B, then B A: drift during the run hits both
            measures: list[Callable[[], None]] = [
                functools.partial(bench_run.run_case, case, backwards) for case in cases
            ] + [functools.partial(bench_run.mpiio, system) for system in mpiio]
            for measure in reversed(measures) if backwards else measures:
                measure()
        if ctx.rank == 0:
            bench.record_machine(
                ctx,
                "read",
                {
                    "cold_steps": bool(args.cold_steps),
                    "pfs": str(pfs),
                    "pfs_fstype": fs_type(pfs),
                    "ranks_per_node": RANKS_PER_NODE,
                    "steps": sizes["steps"],
                    "passes": args.passes,
                    "file_size": sizes["file_size"],
                    "seed": args.seed,
                    "prefetch": args.prefetch,
                    "io_threads": bench_run.io_threads,
                    "mpiio_aggregators": args.mpiio_aggregators,
                    "cases": {
                        c.name: {**dataclasses.asdict(c), "file_bytes": c.file_bytes} for c in cases
                    },
                    "datasets": data.status,
                    "bbio_requests": bench_run.bbio_requests,
                    "compute_ratio": args.compute_ratio,
                    "loader_compute_s": bench_run.compute,
                    "bbio_step_s": {
                        case: seconds
                        for (case, system), seconds in bench_run.step_seconds().items()
                        if system == "bbio"
                    },
                    "io_components": bench_run.io_components,
                    "foreign_users": bench_run.foreign,
                    "server_pids": bench_run.servers,
                    "server_io": bench_run.server,
                },
                drops=bench_run.drops,
                drop_requested=bool(args.drop_caches),
            )
        bench_run.counters.close()
        comm.Barrier()
    finally:
        if ctx.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            if temporary_pfs:
                shutil.rmtree(pfs, ignore_errors=True)
            elif args.clean:
                shutil.rmtree(data.root, ignore_errors=True)
