"""Shared fixtures.  MPI tests run as ``mpirun -n N python -m pytest --with-mpi -m mpi``.

Under MPI, a test that fails on some ranks while others wait in a collective
must not hang the run: each MPI test gets its own communicator, a failure is
printed at once with its rank, and at teardown a rank that waits longer than
``PEER_WAIT`` seconds for the others aborts the whole job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PEER_WAIT = 60.0

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "true",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def _with_mpi(config: pytest.Config) -> bool:
    return bool(config.getoption("--with-mpi", default=False))


def pytest_configure(config: pytest.Config) -> None:
    if _with_mpi(config):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() > 0:
            config.option.verbose = -1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _with_mpi(item.config):
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        print(
            f"\n[rank {rank}] {item.nodeid} FAILED in {report.when}:\n{report.longreprtext}\n",
            file=sys.stderr,
            flush=True,
        )


@pytest.fixture
def comm(request):
    """A private duplicate of COMM_WORLD for one MPI test, checked for stragglers at teardown."""
    from mpi4py import MPI

    from bbio.errors import BBIOTimeoutError
    from bbio.mpi import wait_all_ranks

    dup = MPI.COMM_WORLD.Dup()
    yield dup
    try:
        wait_all_ranks(dup, PEER_WAIT, f"teardown of {request.node.nodeid}")
    except BBIOTimeoutError as exc:
        print(f"[rank {dup.Get_rank()}] {exc}; aborting the MPI job", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
    dup.Free()


@pytest.fixture
def shared_tmp(comm, tmp_path_factory):
    """A temporary directory chosen by rank 0 and shared by every rank of ``comm``."""
    path = str(tmp_path_factory.mktemp("mpi")) if comm.Get_rank() == 0 else None
    return Path(comm.bcast(path, root=0))


def run_python(*args: str, env: dict | None = None, timeout: float = 120, cwd=None):
    """Run ``python args...`` in a subprocess of this interpreter; return the CompletedProcess."""
    full_env = {**os.environ, **MPI_ENV, **(env or {})}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )


def run_mpi(n: int, *args: str, env: dict | None = None, timeout: float = 300, cwd=None):
    """Run ``mpirun -n n python args...``; return the CompletedProcess."""
    full_env = {**os.environ, **MPI_ENV, **(env or {})}
    return subprocess.run(
        ["mpirun", "-n", str(n), sys.executable, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )
