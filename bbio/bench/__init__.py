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
        "machine": machine_info(ctx.comm),
        "results": [m.to_json() for m in ctx.results],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1) + "\n")
