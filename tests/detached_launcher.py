"""A launcher like ``srun`` for the demo's tests: the MPI job it starts is not its child.

``python tests/detached_launcher.py [--no-forward] PROGRAM [ARGS...]`` runs
``mpirun -n 4 PROGRAM ARGS...`` in a session of its own, left to init (as
``srun``'s tasks are children of ``slurmstepd``, not of ``srun``), passes
SIGUSR2 on to it (with ``--no-forward`` SIGUSR2 ends this launcher alone, as
its default action does) and exits with the job's status once it ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DETACHED = (  # the shell's pid and mpirun's, then mpirun's exit status
    'mpirun -n 4 "$@" & echo $$ $! > "$JOB_PID.part" && mv "$JOB_PID.part" "$JOB_PID"; '
    'wait $!; echo $? > "$JOB_STATUS.part" && mv "$JOB_STATUS.part" "$JOB_STATUS"'
)


def _running(pid: int) -> bool:
    """Is ``pid`` a live process (not gone, not a zombie, whose command line is empty)?"""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def main(argv: list[str]) -> int:
    forward = argv[:1] != ["--no-forward"]
    command = argv if forward else argv[1:]
    state = Path(tempfile.mkdtemp(prefix="detached-launcher-"))
    pid_file, status_file = state / "pid", state / "status"
    try:
        subprocess.run(  # setsid -f forks: the shell's parent exits, init adopts it
            ["setsid", "-f", "sh", "-c", DETACHED, "sh", *command],
            env={**os.environ, "JOB_PID": str(pid_file), "JOB_STATUS": str(status_file)},
            check=True,
        )
        while not pid_file.exists():
            time.sleep(0.01)
        shell, job = (int(pid) for pid in pid_file.read_text().split())
        if forward:
            signal.signal(signal.SIGUSR2, lambda *_: os.kill(job, signal.SIGUSR2))
        while not status_file.exists():
            time.sleep(0.02)
        while _running(shell):
            time.sleep(0.01)
        return int(status_file.read_text())
    finally:
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
