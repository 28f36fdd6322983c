"""The benchmark harness: ``mpirun -n N python -m bbio.bench SUITE [--quick] [--json FILE]``.

A suite is a function registered with :func:`suite`; it receives a
:class:`BenchContext` and records every system it measures (bbio and its
baselines, side by side in one run) into ``ctx.results``.  Suites live in the
modules of this package and register themselves on import.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bbio._version import __version__
from bbio.report import format_table


@dataclasses.dataclass
class Measurement:
    """All values of one (case, system, metric) triple."""

    case: str
    system: str
    metric: str
    unit: str
    values: list[float]

    @property
    def median(self) -> float:
        """The median of the values."""
        return statistics.median(self.values)

    def to_json(self) -> dict[str, Any]:
        """The JSON form, median included."""
        return {**dataclasses.asdict(self), "median": self.median}


class Results:
    """Measurements of one suite run, kept in the order they were first recorded."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, str, str], Measurement] = {}

    def add(self, case: str, system: str, metric: str, unit: str, value: float) -> None:
        """Append one value to the (case, system, metric) measurement."""
        key = (case, system, metric)
        if key not in self._items:
            self._items[key] = Measurement(case, system, metric, unit, [])
        self._items[key].values.append(float(value))

    def __iter__(self):
        return iter(self._items.values())

    def get(self, case: str, system: str, metric: str) -> Measurement:
        """The measurement for a triple (KeyError if never recorded)."""
        return self._items[(case, system, metric)]

    def table(self) -> str:
        """A readable table of medians."""
        rows = [
            (m.case, m.system, m.metric, m.median, m.unit, len(m.values))
            for m in self._items.values()
        ]
        return format_table(["case", "system", "metric", "median", "unit", "n"], rows)


@dataclasses.dataclass
class BenchContext:
    """What a suite gets: the communicator, the options and the results to fill."""

    comm: Any
    args: argparse.Namespace
    results: Results
    #: what the suite adds to the JSON's ``machine`` block (rank 0 fills it)
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the (virtual) node count the suite ran on, when it sets its own; else the configured one
    nodes: int | None = None

    @property
    def quick(self) -> bool:
        """True under ``--quick`` (whole suite in under a minute on 2 cores)."""
        return bool(self.args.quick)

    @property
    def rank(self) -> int:
        """This process's rank in ``comm``."""
        return self.comm.Get_rank()

    def log(self, message: str) -> None:
        """Print a progress line on rank 0, with a timestamp."""
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclasses.dataclass(frozen=True)
class Suite:
    """A registered benchmark suite."""

    name: str
    help: str
    run: Callable[[BenchContext], None]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None


SUITES: dict[str, Suite] = {}


def suite(
    name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
):
    """Decorator: register ``fn(ctx)`` as the suite ``name``."""

    def register(fn: Callable[[BenchContext], None]) -> Callable[[BenchContext], None]:
        SUITES[name] = Suite(name, help, fn, add_arguments)
        return fn

    return register


def gb_per_s(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10**9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def timed(fn: Callable[[], Any]) -> float:
    """Seconds taken by one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info(comm) -> dict[str, Any]:
    """Where the numbers were measured: host, CPU, memory, software versions."""
    from mpi4py import MPI

    from bbio import _native

    return {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "memory_bytes": _memory_bytes(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "mpi": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
        "bbio": __version__,
        "crc32c_hardware": _native.available() and _native.hw_crc32c(),
        "ranks": comm.Get_size(),
    }


def write_json(path: str | os.PathLike, suite_name: str, ctx: BenchContext, nodes: int) -> None:
    """Write the results in the documented JSON layout (rank 0 only)."""
    document = {
        "suite": suite_name,
        "ranks": ctx.comm.Get_size(),
        "nodes": nodes,
        "quick": ctx.quick,
        "argv": ctx.args.argv,
        "machine": {**machine_info(ctx.comm), **ctx.machine},
        "results": [m.to_json() for m in ctx.results],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


# ------------------------------------------------------------ shared by the suites

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {"": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}


def byte_size(text: str) -> int:
    """Option parser: '4096', '100KiB', '64M', '1GiB' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg](?:ib)?)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4096, 100KiB, 1GiB)")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def at_least(minimum: float, kind: type = int) -> Callable[[str], Any]:
    """Option parser: a number of type ``kind`` no smaller than ``minimum``."""

    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    return parse


def positive(text: str) -> float:
    """Option parser: a number above 0."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Option parser: a non-empty comma list of names out of ``allowed``."""

    def parse(text: str) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip()]
        wrong = [n for n in chosen if n not in allowed]
        if wrong or not chosen:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(allowed)} (got {text!r})")
        return chosen

    return parse


def idle_barrier(comm) -> None:
    """Collective over ``comm``: a barrier that sleeps while it waits, leaving the CPUs
    to the ranks that work."""
    from bbio.mpi import wait_quietly

    wait_quietly(comm.Ibarrier(), poll=0.002, yield_for=0.0)


def drop_caches(enabled: bool) -> bool:
    """Sync, then drop the page cache (``echo 1``, needs root); True if it was dropped."""
    if not enabled:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, file system type) of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best, kind
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            mount = fields[1].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return best, kind


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path``."""
    return mount_of(path)[1]


def record_machine(
    ctx: BenchContext,
    name: str,
    info: dict[str, Any],
    drops: list[bool] | None = None,
    drop_requested: bool = False,
) -> None:
    """Put a suite's settings ``info`` in the JSON's ``machine`` block under ``name``.

    ``drops`` are the outcomes of the suite's :func:`drop_caches` calls: whether
    every one worked goes into ``info`` and the block (``caches_dropped``), with
    whether they were asked for, and a drop that failed is said in the log.
    """
    if drops is not None:
        dropped = bool(drops) and all(drops)
        if drop_requested and not all(drops):
            ctx.log("could not drop the page cache (needs root): the numbers may be warm")
        info = {"caches_dropped": dropped, "drop_caches_requested": drop_requested, **info}
        ctx.machine["caches_dropped"] = dropped
    ctx.machine[name] = info


def parse_io(text: str) -> dict[str, int]:
    """The counters of a ``/proc/PID/io`` text: {name: value}."""
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().isdigit():
            values[key.strip()] = int(value)
    return values


class IoCounters:
    """This process's ``syscr`` and ``rchar`` (all threads), minus the counters' own reads.

    The file stays open; each snapshot is one ``pread``, which the kernel
    counts (one syscall, its bytes) in the next snapshot: :meth:`delta`
    subtracts it.
    """

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/io", os.O_RDONLY)

    def snapshot(self) -> tuple[int, int, int]:
        """(syscr, rchar, bytes of this very read)."""
        raw = os.pread(self.fd, 4096, 0)
        values = parse_io(raw.decode())
        return values["syscr"], values["rchar"], len(raw)

    @staticmethod
    def delta(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[int, int]:
        """(read syscalls, bytes) between two snapshots, the first snapshot's read excluded."""
        return after[0] - before[0] - 1, after[1] - before[1] - before[2]

    def close(self) -> None:
        os.close(self.fd)
