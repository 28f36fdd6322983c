"""``bbio slurm prolog|epilog``: the job's burst-buffer directory, created and drained away."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bbio.checkpoint import drain
from tests.conftest import run_python

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root (chown)")


def hook_env(tmp_path: Path) -> dict:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_USER": "nobody",
        "SLURM_JOB_UID": "65534",
        "SLURM_JOB_GID": "65534",
        "BBIO_BB_ROOT": str(tmp_path / "local" / "bbio-{job}"),
        "BBIO_PFS_ROOT": str(tmp_path / "pfs"),
    }


def test_prolog_creates_the_job_directory_for_the_user_and_epilog_removes_it(tmp_path):
    env = hook_env(tmp_path)
    created = run_python("-m", "bbio", "slurm", "prolog", env=env)
    assert created.returncode == 0, created.stderr
    job_dir = tmp_path / "local" / "bbio-4242"
    st = job_dir.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (65534, 65534, 0o700)
    (job_dir / "some-output").write_bytes(b"x")
    removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "10", env=env)
    assert removed.returncode == 0, removed.stderr
    assert not job_dir.exists()


def test_epilog_keeps_what_it_cannot_drain_and_fails(tmp_path):
    env = hook_env(tmp_path)
    job_dir = tmp_path / "local" / "bbio-4242"
    journal = drain.journal_dir(job_dir / "ckpt" / "run")
    journal.mkdir(parents=True)
    drain.add_task(
        journal,
        drain.Task(
            "run",
            5,
            0,
            1,
            str(job_dir / "ckpt/run/step-00000005"),
            str(tmp_path / "pfs/ckpt/run/step-00000005"),
            3,
        ),
    )  # its node file is missing: the copy cannot succeed
    result = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "2", env=env)
    assert result.returncode == 1
    assert "could not drain" in result.stderr and "is kept" in result.stderr
    assert job_dir.exists() and drain.pending(journal)
    assert "No such file" in drain.read_status(journal)["error"]


def test_hooks_outside_slurm_say_so():
    result = run_python("-m", "bbio", "slurm", "prolog", env={"SLURM_JOB_ID": ""})
    assert result.returncode == 1
    assert "not run by Slurm" in result.stderr
