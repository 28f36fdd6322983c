"""The main job runs end to end: 4 ranks in 2 virtual nodes, killed mid-drain, restarted.

And the driver's own checks, each with real processes: a burst buffer elsewhere
and an epilog launcher, SIGTERM, a drain on another host, a failing training
phase, what counts as passed, and a restart that saves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bbio.checkpoint import drain
from bbio.demo.__main__ import (
    Places,
    kill_drain,
    parse_args,
    passed,
    processes_running,
    train_and_kill,
)
from tests.conftest import MPI_ENV, run_mpi, run_python

SMALL = ["--samples", "128", "--epochs", "3", "--batch-size", "8", "--model-mib", "16"]


@pytest.mark.timeout(900)  # its subprocess may take 600 s on a slow machine
def test_demo_stages_trains_survives_a_kill_and_restarts(tmp_path):
    root = tmp_path / "demo"
    result = run_python("-m", "bbio.demo", "--root", str(root), *SMALL, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "RESULT: all checks passed" in out
    assert "verified: yes" in out
    assert "job killed while step" in out
    assert "state identical to the training log: yes" in out
    prepare = json.loads((root / "results" / "prepare.json").read_text())
    assert prepare["stage"]["nodes"] == 2 and prepare["read"]["checked"]
    restart = json.loads((root / "results" / "restart.json").read_text())
    assert restart["restored"]["identical"]
    assert restart["final_committed"] is not False  # None: restored the last step, saved nothing
    assert restart["steps"] == 3 * 128 // (4 * 8)
    committed = sorted(
        p.name for p in (root / "pfs" / "ckpt" / "demo").glob("step-*/manifest.json")
    )
    assert committed, "no checkpoint was committed on the PFS"


@pytest.mark.timeout(900)
def test_demo_with_its_burst_buffer_elsewhere_and_an_epilog_launcher(tmp_path):
    """--bb-root outside --root: the driver still catches a drain, kills it, and runs the
    epilog's drain (and the removal of old checkpoints) through --epilog-launcher."""
    root, bb, calls = tmp_path / "demo", tmp_path / "node-local" / "bb-{user}", tmp_path / "calls"
    launcher = ["sh", "-c", f'echo "$*" >> {shlex.quote(str(calls))}; exec "$@"', "launcher"]
    result = run_python(
        "-m",
        "bbio.demo",
        "--root",
        str(root),
        "--ranks-per-node",
        "0",  # one node: a burst buffer without {node}, as on a cluster
        "--bb-root",
        str(bb),
        "--epilog-launcher",
        shlex.join(launcher),
        *SMALL,
        timeout=600,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "job killed while step" in out and "RESULT: all checks passed" in out
    expanded = next((tmp_path / "node-local").iterdir())
    assert (expanded / "ckpt" / "demo" / ".journal").is_dir()
    assert not (root / "bb").exists()
    ran = calls.read_text().splitlines()
    assert any(f"rm -rf {expanded}/ckpt/demo" in line for line in ran), ran
    assert any(f"ckpt drain --finish --bb-root {expanded} " in line for line in ran), ran


DETACHED_LAUNCHER = Path(__file__).with_name("detached_launcher.py")


def _demo_with_detached_ranks(root: Path, *launcher_options: str):
    """The demo run by a launcher whose ranks are not its children, as srun's; then
    whatever of it still runs is killed."""
    launcher = shlex.join([sys.executable, str(DETACHED_LAUNCHER), *launcher_options])
    try:
        return run_python(
            "-m", "bbio.demo", "--root", str(root), "--launcher", launcher, *SMALL, timeout=600
        )
    finally:
        for pid in processes_running(str(root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(900)
def test_the_kill_reaches_ranks_that_are_not_the_launchers_children(tmp_path):
    """srun's tasks are not its children: the driver kills them through the launcher."""
    root = tmp_path / "demo"
    result = _demo_with_detached_ranks(root)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "job killed while step" in out and "RESULT: all checks passed" in out
    assert not (root / "results" / "train.json").exists()  # the killed job never finished


@pytest.mark.timeout(900)
def test_a_launcher_that_does_not_pass_the_kill_on_fails_the_demo(tmp_path):
    result = _demo_with_detached_ranks(tmp_path / "demo", "--no-forward")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "still ran after the kill" in result.stderr, result.stderr
    assert "did not pass SIGUSR2" in result.stderr
    assert "all checks passed" not in result.stdout


def test_an_epilog_launcher_needs_a_burst_buffer_without_node(tmp_path):
    result = run_python(
        "-m", "bbio.demo", "--root", str(tmp_path), "--epilog-launcher", "srun", timeout=60
    )
    assert result.returncode == 1
    assert "--epilog-launcher" in result.stderr and "{node}" in result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])  # make's timeout, Ctrl-C
def test_a_signal_to_the_driver_kills_the_training_job(tmp_path, signum):
    root = tmp_path / "demo"
    driver = subprocess.Popen(
        [sys.executable, "-m", "bbio.demo", "--root", str(root), *SMALL],
        env={**os.environ, **MPI_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 400
        while not [p for p in processes_running(str(root)) if p in processes_running(" train ")]:
            assert driver.poll() is None, "the demo ended before training"
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.05)
        driver.send_signal(signum)
        status = driver.wait(timeout=60)
        deadline = time.monotonic() + 1  # reaped; left alone, the job ran on for seconds
        while processes_running(str(root)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_running(str(root)), "the training job outlived the driver"
        assert status == 128 + signum
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in processes_running(str(root)):  # what the old driver left running
            os.kill(pid, signal.SIGKILL)


def test_the_driver_kills_a_drain_only_on_its_own_host(tmp_path):
    journal = tmp_path / ".journal"
    journal.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        drain._write_status(journal, state="copying")
        assert drain.read_status(journal)["host"] == socket.gethostname()
        drain._write_status(journal, pid=sleeper.pid, host="another-host", state="copying")
        why = kill_drain(journal)
        assert why and "another-host" in why and "not killed" in why
        assert sleeper.poll() is None
        drain._write_status(journal, pid=sleeper.pid, state="copying")
        assert kill_drain(journal) is None
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_training_phase_that_fails_unkilled_stops_the_demo(tmp_path, capsys):
    args = parse_args(["--root", str(tmp_path), "--launcher", "sh -c 'echo boom; exit 3' sh"])
    places = Places(
        tmp_path / "pfs" / "ckpt" / "demo",
        [tmp_path / "bb" / "node0"],
        1,
        tmp_path / "pfs" / "train-log.jsonl",
    )
    (tmp_path / "results").mkdir()
    with pytest.raises(SystemExit, match="the train phase failed \\(exit status 3"):
        train_and_kill(args, places, tmp_path / "results" / "train.json")
    assert "boom" in capsys.readouterr().out


def test_passed_needs_a_kill_and_the_newest_committed_step_restored():
    prepare = {"stage": {"verified": True}, "read": {"checked": True}}
    killed, epilog = {"killed_at": 6}, {"committed": [2, 4, 6]}

    def restart(step: int = 6, final: bool | None = True) -> dict:
        return {"restored": {"step": step, "identical": True}, "final_committed": final}

    assert passed(prepare, killed, epilog, restart())
    assert passed(prepare, killed, epilog, restart(final=None))  # the restart saved nothing
    assert not passed(prepare, {"killed_at": None}, epilog, restart())
    assert not passed(prepare, killed, epilog, restart(step=4))
    assert not passed(prepare, killed, {"committed": []}, restart())
    assert not passed(prepare, killed, epilog, restart(final=False))


@pytest.mark.timeout(600)
def test_a_restart_that_saves_nothing_reports_its_last_step(tmp_path):
    """3 steps, a save at step 2: the restart restores 2 and trains step 3 unsaved."""
    options = [
        "--root",
        str(tmp_path),
        "--samples",
        "48",
        "--sample-size",
        "1024",
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--model-mib",
        "1",
        "--ranks-per-node",
        "1",
    ]
    for phase in ("prepare", "train", "restart"):
        out = tmp_path / f"{phase}.json"
        done = run_mpi(2, "-m", "bbio.demo.job", phase, *options, "--result", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
    train = json.loads((tmp_path / "train.json").read_text())
    assert train["steps"] == 3 and [s["step"] for s in train["saves"]] == [2]
    assert train["final_committed"] is True
    restart = json.loads((tmp_path / "restart.json").read_text())
    assert restart["restored"]["step"] == 2 and restart["restored"]["identical"]
    assert restart["steps"] == 3 and restart["saves"] == []
    assert restart["final_committed"] is None
