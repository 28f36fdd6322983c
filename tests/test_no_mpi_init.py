"""Importing bbio and running ``bbio info`` must not initialise MPI (Slurm hooks have no mpirun)."""

from __future__ import annotations

from tests.conftest import run_python

CHECK_UNINITIALISED = (
    "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
    "assert not MPI.Is_initialized(), 'MPI was initialised'; print('uninitialised')"
)


def test_import_bbio_does_not_load_or_initialise_mpi():
    code = (
        "import sys, bbio, bbio.cli, bbio.info, bbio.mpi, bbio.config, bbio._native\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'bbio imported mpi4py.MPI'\n" + CHECK_UNINITIALISED
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert "uninitialised" in result.stdout


def test_bbio_info_does_not_initialise_mpi(tmp_path):
    code = (
        "from bbio.cli import main\n"
        "assert main(['info']) == 0\n"
        "from mpi4py import MPI\n"
        "assert not MPI.Is_initialized(), 'bbio info initialised MPI'\n"
        "print('uninitialised')\n"
    )
    result = run_python("-c", code, env={"BBIO_PFS_ROOT": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "uninitialised" in result.stdout
    assert "Open MPI" in result.stdout or "MPICH" in result.stdout
