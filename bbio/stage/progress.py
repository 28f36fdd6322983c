"""Progress of a collective transfer: one line on rank 0's terminal, quiet off a terminal.

The ranks add up their counters with non-blocking allreduces, started in the
same order on every rank but whenever each rank is ready, so nobody waits for
the report.  They run on a duplicate of the communicator, so a transfer may run
other collectives (rounds, agreements) while a report is in flight.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import numpy as np

from bbio.report import format_bytes

BYTES, FILES, DONE = 0, 1, 2


def _parent_writes_to_terminal() -> bool:
    """Whether our parent process's stdout is a terminal (Linux /proc).

    Open MPI gives every rank a pseudo-terminal as stdout, whether or not
    ``mpirun`` itself writes to a terminal; its parent is ``mpirun``.
    """
    try:
        target = os.readlink(f"/proc/{os.getppid()}/fd/1")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty"))


def terminal_stream(setting: str = "auto") -> TextIO | None:
    """Where progress goes: a terminal, or None to stay quiet.

    ``setting`` is "auto" (only when the user's terminal is reached), "always"
    (stderr), or "never".
    """
    if setting == "never":
        return None
    if setting == "always" or sys.stderr.isatty():
        return sys.stderr
    if sys.stdout.isatty() and _parent_writes_to_terminal():
        return sys.stdout
    return None


class Progress:
    """Collective over ``comm``: every rank calls :meth:`update` often and :meth:`finish` once."""

    def __init__(
        self,
        comm,
        label: str,
        total_bytes: int,
        total_files: int,
        setting: str = "auto",
        interval: float = 0.5,
    ) -> None:
        self.comm = comm.Dup()
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.interval = interval
        self.stream = terminal_stream(setting) if comm.Get_rank() == 0 else None
        self.start = time.monotonic()
        self._local = np.zeros(3, dtype=np.int64)
        self._send = np.zeros(3, dtype=np.int64)
        self._recv = np.zeros(3, dtype=np.int64)
        self._request = None
        self._last_post = 0.0
        self._all_done = False

    def add(self, nbytes: int, files: int = 0) -> None:
        """Count work done by this rank."""
        self._local[BYTES] += nbytes
        self._local[FILES] += files

    def update(self, done: bool = False) -> bool:
        """Advance the exchange; returns True once every rank has said it is done."""
        from mpi4py import MPI

        if self._request is not None and self._request.Test():
            self._request = None
            self._show(self._recv)
            if self._recv[DONE] == self.comm.Get_size():
                self._all_done = True
        if self._request is None and not self._all_done:
            now = time.monotonic()
            if done or now - self._last_post >= self.interval:
                self._send[:] = self._local
                self._send[DONE] = int(done)
                self._request = self.comm.Iallreduce(self._send, self._recv, op=MPI.SUM)
                self._last_post = now
        return self._all_done

    def finish(self) -> None:
        """Say this rank is done and wait until every rank is; clears the line."""
        while not self.update(done=True):
            if self._request is not None:
                self._request.Wait()
        self.comm.Free()
        if self.stream:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _show(self, totals: np.ndarray) -> None:
        if not self.stream:
            return
        elapsed = max(time.monotonic() - self.start, 1e-9)
        moved = int(totals[BYTES])
        rate = moved / elapsed
        left = max(self.total_bytes - moved, 0)
        eta = f"{left / rate:.0f} s" if rate > 0 else "?"
        self.stream.write(
            f"\r\033[K{self.label}: {format_bytes(moved)} / {format_bytes(self.total_bytes)}, "
            f"{int(totals[FILES])} / {self.total_files} files, {rate / 1e9:.2f} GB/s, ETA {eta}"
        )
        self.stream.flush()
