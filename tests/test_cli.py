"""The bbio command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bbio import __version__
from tests.conftest import run_mpi, run_python


def test_version():
    result = run_python("-m", "bbio", "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"bbio {__version__}"


def test_console_script_info_reports_stack_and_roots(tmp_path):
    bbio_cmd = Path(sys.executable).with_name("bbio")
    assert bbio_cmd.exists(), "the bbio console script is not installed"
    result = run_python(
        str(bbio_cmd),
        "info",
        env={"BBIO_PFS_ROOT": str(tmp_path), "BBIO_BB_ROOT": str(tmp_path / "bb{node}")},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "h5py with MPI     yes" in out
    assert "native extension  loaded" in out
    assert "CRC32C" in out
    assert f"{tmp_path}/bb0" in out
    assert "free" in out


def test_info_says_an_unset_pfs_root_is_not_set(monkeypatch):
    monkeypatch.delenv("BBIO_PFS_ROOT", raising=False)
    monkeypatch.delenv("BBIO_CONFIG", raising=False)
    result = run_python("-m", "bbio", "info")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "PFS root          not set (set BBIO_PFS_ROOT or pfs_root in the config file)" in lines
    assert "PFS path          not set" in lines
    assert "None" not in result.stdout


def test_bad_configuration_is_a_clear_error_not_a_traceback():
    result = run_python("-m", "bbio", "info", env={"BBIO_RANKS_PER_NODE": "many"})
    assert result.returncode == 1
    assert result.stderr.startswith("bbio: error: environment variable BBIO_RANKS_PER_NODE")
    assert "Traceback" not in result.stderr


def test_a_usage_error_under_mpirun_is_printed_once(tmp_path):
    result = run_mpi(4, "-m", "bbio", "pack", str(tmp_path), "out", "--shard-size", "1X")
    assert result.returncode != 0
    assert result.stderr.count("not a size: '1X'") == 1, result.stderr
    bare = run_mpi(2, "-m", "bbio")
    assert bare.returncode != 0
    assert bare.stdout.count("usage: bbio") == 1, bare.stdout


def test_info_reports_a_root_it_cannot_look_at_and_goes_on(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = run_python("-m", "bbio", "info", env={"BBIO_PFS_ROOT": str(not_a_dir / "pfs")})
    assert result.returncode == 0, result.stderr
    assert f"{not_a_dir}/pfs  (free: " in result.stdout
    assert "native extension" in result.stdout


def test_a_size_too_large_for_a_number_is_a_usage_error(tmp_path):
    result = run_python("-m", "bbio", "pack", str(tmp_path), "out", "--shard-size", "1e400")
    assert result.returncode != 0
    assert "not a size: '1e400'" in result.stderr and "Traceback" not in result.stderr


NO_DAC_OVERRIDE = "-dac_override,-dac_read_search"  # root then obeys the mode bits


def can_run_without_dac_override() -> bool:
    """Can this process run a program as root without overriding file permissions?"""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    drop = [f"--bounding-set={NO_DAC_OVERRIDE}", f"--inh-caps={NO_DAC_OVERRIDE}"]
    return subprocess.run(["setpriv", *drop, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(
    not can_run_without_dac_override(), reason="needs root and setpriv to drop CAP_DAC_OVERRIDE"
)
@pytest.mark.parametrize("command", [["ls"], ["drain", "--finish"]])
def test_an_unreadable_directory_is_a_one_line_error_naming_it(tmp_path, command):
    """Before, a traceback (PermissionError from listing the directory)."""
    unreadable = tmp_path / "bb" / "ckpt"
    (unreadable / "run").mkdir(parents=True)
    (tmp_path / "pfs").mkdir()
    unreadable.chmod(0)
    roots = ["--bb-root", str(tmp_path / "bb")]
    roots += ["--pfs-root", str(tmp_path / "pfs")] if command == ["ls"] else []
    drop = ["setpriv", f"--bounding-set={NO_DAC_OVERRIDE}", f"--inh-caps={NO_DAC_OVERRIDE}"]
    result = subprocess.run(
        [*drop, sys.executable, "-m", "bbio", "ckpt", *command, *roots],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"bbio: error: cannot finish bbio ckpt {command[0]}: Permission denied [{unreadable}]. "
        "Check that path (its permissions for this user, its file system), then run the "
        "command again"
    ]


def test_a_bug_s_traceback_is_not_hidden():
    """Only an OSError becomes a one-line error: any other exception keeps its traceback."""
    code = (
        "from bbio import cli, slurm\n"
        "def broken(*args):\n"
        "    raise KeyError('a bug')\n"
        "slurm.Job.from_env = broken\n"
        "raise SystemExit(cli.main())"
    )
    result = run_python("-c", code, "slurm", "prolog")
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "KeyError: 'a bug'" in result.stderr
