"""``Checkpointer``: save to the burst buffer, drain to the PFS in the background, restore.

A save blocks only while the ranks of each node write their node's HDF5 file
(parallel HDF5) into the node's burst buffer and fsync it.  A drain process per
node then copies it to the PFS, verifies it and, once every node's file is
there, commits the checkpoint by writing its manifest last.  A restore takes
the newest complete checkpoint, from the burst buffers when every node has a
valid copy, from the PFS otherwise, and skips copies that fail verification.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import numbers
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bbio._version import __version__
from bbio.arguments import integer_argument, path_argument, seconds_argument
from bbio.checkpoint import drain, layout
from bbio.checkpoint import restore as reader
from bbio.checkpoint.globalview import describe_node_file
from bbio.checkpoint.mapped import NodeFileMappings, release_deleted
from bbio.checkpoint.writer import describe, file_attrs, global_shapes, write_node_file
from bbio.config import Config
from bbio.errors import (
    BBIOError,
    BBIOTimeoutError,
    IntegrityError,
    NoSpaceError,
    NotFoundError,
    UsageError,
)
from bbio.mpi import (
    agreed,
    agreed_allgather,
    agreed_config,
    agreed_error,
    check_same_arguments,
    fingerprints,
    same_arguments,
    topology,
)
from bbio.report import format_bytes
from bbio.transfer import files

log = logging.getLogger("bbio")
# the open checkpointers of this process, by directory (PFS and burst buffer)
_OPEN: weakref.WeakValueDictionary[str, Checkpointer] = weakref.WeakValueDictionary()

FILE_OVERHEAD_BYTES = 1 << 20  # HDF5 metadata, per node file, generously ...
DATASET_OVERHEAD_BYTES = 4 << 10  # ... and per dataset (about 1.4 KiB each when new) ...
GROUP_OVERHEAD_BYTES = 2 << 10  # ... and per group of its key's path (about 1.1 KiB) ...
KEY_BYTES_PER_BYTE = 8  # ... and per byte of its key (links, heaps, the CRC attribute)
MAX_WAIT_POLL_SECONDS = 0.01  # the BB journal is asked: cheap; the PFS only with no drain running
RESTORE_LISTINGS = 3  # a restore lists again when every copy failed: one may have been retired
TOLD_WAIT_POLL_SECONDS = 0.1  # the drain tells of each new status: asked anyway this often


@dataclasses.dataclass
class SaveHandle:
    """The state of one save, like an MPI request: ``done()`` and ``wait()``.

    Neither is collective: each rank may ask.  ``skipped`` is True when the
    save was skipped by the ``skip`` backpressure policy.
    """

    name: str
    step: int
    pfs_step_dir: Path
    journal: Path
    nodes: int
    skipped: bool = False
    direct: bool = False  # written straight to the PFS (the burst buffer was full)
    save_time: float | None = None  # which save of the step: its "time" attribute

    def done(self) -> bool:
        """True once the checkpoint is committed on the PFS (or was skipped).

        Asks this node's journal (on the BB), where the node's drain reports
        commits: one process per node polls the PFS, not every waiting rank.
        Reads the PFS manifest only when no drain is running to tell.
        """
        return self._done(self._drain_knows())

    def _drain_knows(self) -> bool | None:
        """What this node's drain says of the commit (:func:`drain.step_committed`); None
        when it cannot tell, or the save is not the drain's (skipped, or direct)."""
        if self.skipped or self.direct:
            return None
        return drain.step_committed(self.journal, self.step, self.save_time)

    def _done(self, known: bool | None) -> bool:
        """:meth:`done`, given what the drain knows (``known``)."""
        if self.skipped:
            return True
        if known is not None:
            return known
        return drain.was_committed(self.pfs_step_dir, self.step)  # also if retention removed it

    def _raise_if_set_aside(self, known: bool | None) -> None:
        """Raise if a node's drain set this save aside (this node's, or another's seen on
        the PFS by this node's drain); not for a later save of the step.  ``known``: what
        the drain knows of the commit (None: only the PFS can tell)."""
        if self.skipped or self.direct or self.save_time is None:
            return
        entry = drain.read_status(self.journal).get("damaged", {}).get(str(self.step))
        if not (isinstance(entry, dict) and entry.get("time") == self.save_time):
            entry = None  # of another save of the step, or none
            if known is None:  # no drain to tell
                entry = drain.damaged_save(self.pfs_step_dir, self.save_time)
        if entry is None:
            return
        what = "drain task file" if entry.get(drain.TASK_DAMAGED) else "file"
        raise IntegrityError(
            f"checkpoint {self.name} step {self.step} will not be committed: node "
            f"{entry.get('node')}'s {what} is damaged: {entry.get('why')}",
            path=self.pfs_step_dir,
            hint="save again (a later step, or this one)",
        )

    def wait(self, timeout: float | None = None) -> None:
        """Block until :meth:`done`; at ``timeout`` seconds raise :class:`BBIOTimeoutError`.

        The error says which nodes' files are not on the PFS yet and what this
        node's drain last reported.  Raises :class:`IntegrityError` at once when
        any node's drain has set the save aside (that node's burst-buffer file
        is damaged: it will never be committed).  Sleeps until the node's drain
        writes a new status (:class:`~bbio.checkpoint.drain.StatusWaiter`), or
        polls where no FIFO can be made.
        """
        timeout = seconds_argument("wait: timeout", timeout)
        if self.done():  # skipped, or committed already: no FIFO to make
            return
        with contextlib.closing(drain.StatusWaiter(self.journal)) as waiter:
            self._wait(timeout, waiter)

    def _wait(self, timeout: float | None, waiter: drain.StatusWaiter) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005  # then longer, up to MAX_WAIT_POLL_SECONDS
        while not self._done(known := self._drain_knows()):
            self._raise_if_set_aside(known)
            if deadline is not None and time.monotonic() > deadline:
                missing = [
                    n
                    for n in range(self.nodes)
                    if not (self.pfs_step_dir / layout.node_record_name(n)).exists()
                ]
                status = drain.read_status(self.journal)
                problem = status.get("error") or "no error reported"
                if drain.is_draining(self.journal):
                    told = f"reports: {problem} ({status.get('retries', 0)} retries)"
                    hint = "check that the PFS is writable; 'bbio ckpt drain --finish' completes it"
                else:
                    told = (
                        "is not running (not started yet, or it stopped or died; it last "
                        f"reported: {problem})"
                    )
                    hint = "a save or close starts a drain; so does 'bbio ckpt drain --finish'"
                raise BBIOTimeoutError(
                    f"checkpoint {self.name} step {self.step} is not committed on the PFS after "
                    f"{timeout:g} s: node(s) {missing} not drained yet; this node's drain {told}",
                    path=self.pfs_step_dir,
                    hint=hint,
                )
            if waiter.notified and known is not None:  # else only the PFS can say: polled
                left = TOLD_WAIT_POLL_SECONDS if deadline is None else deadline - time.monotonic()
                waiter.pause(min(max(left, 0.0), TOLD_WAIT_POLL_SECONDS))
            else:
                time.sleep(pause)
                pause = min(pause * 1.5, MAX_WAIT_POLL_SECONDS)


class _SaveCheck(NamedTuple):
    """What a rank's check of a save tells every rank (gathered in one collective)."""

    layout: str  # of its arrays: "global" or "per-rank"
    spec: dict[str, dict]  # its arrays (:func:`describe`)
    time: float  # the save's time (rank 0's is the save's)
    node: int
    free: int | None  # bytes free in the node's burst buffer, spares counted (leaders)
    old_copy: bool  # the node's burst buffer holds an earlier save of the step (leaders)
    old_save: float | None  # the save time of the node's complete copy of the step (leaders)
    user_attrs: str  # as JSON
    arguments: dict[str, str]  # the call's arguments (:func:`fingerprints`)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step of a checkpointer, as :meth:`Checkpointer.list` sees it."""

    step: int
    bb: str  # "all nodes", "nodes [0, 2]", "nodes [0, 1], of different saves (...)" or "-"
    pfs: str  # "committed", "draining", "damaged manifest",
    # "damaged node N", "damaged task N" or "-"


def dataset_bytes(key: str, nbytes: int) -> int:
    """What a rank's array of ``key`` and ``nbytes`` bytes takes in a node file, HDF5's
    metadata for it included, generously.  Not collective."""
    groups = key.count("/") + 1  # the key's path, the last part a group of the ranks' arrays
    return (
        nbytes
        + DATASET_OVERHEAD_BYTES
        + GROUP_OVERHEAD_BYTES * groups
        + KEY_BYTES_PER_BYTE * len(key.encode())
    )


class Checkpointer:
    """Checkpoints of one run, named ``name``.

    Collective over ``comm`` (the constructor, :meth:`save`, :meth:`restore`,
    :meth:`list` and :meth:`close`).  ``bb_root`` and ``pfs_root`` default to the
    configuration's; ``keep_bb`` and ``keep_pfs`` checkpoints are kept in each
    tier; ``backpressure`` ("queue", "block" or "skip") defaults to
    ``ckpt_backpressure``.  Once closed, :meth:`save`, :meth:`restore` and
    :meth:`list` raise :class:`UsageError` on every rank; closing again does nothing.
    """

    def __init__(
        self,
        comm,
        name: str,
        bb_root: str | os.PathLike | None = None,
        pfs_root: str | os.PathLike | None = None,
        keep_bb: int = 2,
        keep_pfs: int = 5,
        backpressure: str | None = None,
        config: Config | None = None,
    ) -> None:
        config = agreed_config(comm, "Checkpointer", config)
        arguments = {"name": name, "bb_root": bb_root, "pfs_root": pfs_root, "keep_bb": keep_bb}
        arguments |= {"keep_pfs": keep_pfs, "backpressure": backpressure, "config": config}
        same_arguments(comm, "Checkpointer", arguments)
        plain = layout.is_text_name(name) and "/" not in name and not name.startswith(".")
        if not plain or not name or len(name.encode()) > layout.NAME_MAX:
            raise UsageError(
                f"invalid checkpoint name {name!r}",
                hint="use a plain name like 'run1' (a directory name: no '/' or NUL, not "
                f"starting with '.', at most {layout.NAME_MAX} bytes in UTF-8)",
            )
        keep_bb = integer_argument("keep_bb", keep_bb, 1)
        keep_pfs = integer_argument("keep_pfs", keep_pfs, 1)
        for root, what in ((bb_root, "bb_root"), (pfs_root, "pfs_root")):
            if root is not None:
                path_argument(f"Checkpointer: {what}", root)
        policy = backpressure or config.ckpt_backpressure
        if policy not in ("queue", "block", "skip"):
            raise UsageError(f"backpressure must be queue, block or skip, got {policy!r}")
        self.name, self.keep_bb, self.keep_pfs, self.backpressure = name, keep_bb, keep_pfs, policy
        self.verify = config.ckpt_verify
        self.recycle = config.ckpt_recycle == "on"
        self._mappings = NodeFileMappings(limit=keep_bb + 2)  # the files taking turns, and more
        self.comm = comm.Dup()
        self.topo = topology(self.comm, config.ranks_per_node)
        try:  # the same error on every rank (a ConfigError, or agreed): nothing to leak
            self._prepare(config, name, bb_root, pfs_root, keep_pfs)
        except BBIOError:
            self.topo.free()
            self.comm.Free()
            raise

    def _prepare(
        self,
        config: Config,
        name: str,
        bb_root: str | os.PathLike | None,
        pfs_root: str | os.PathLike | None,
        keep_pfs: int,
    ) -> None:
        """Collective: the constructor's paths, journal and view of the steps saved."""
        bb_node_dir = config.node_dir(
            bb_root or config.bb_root, self.topo.node, self.topo.nodes_on_host
        )
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.node, self.nodes = self.topo.node, self.topo.nodes
        self.node_ranks = self.topo.node_comm.allgather(self.rank)
        self.bb_dir = bb_node_dir / layout.CKPT_DIR / name
        self.pfs_dir = (
            (config.expand(pfs_root) if pfs_root else config.pfs_dir()) / layout.CKPT_DIR / name
        )
        self.journal = drain.journal_dir(self.bb_dir)
        self._drain: subprocess.Popen | None = None
        self._said_direct = False
        self._closed = False
        self.last_restore_tier: str | None = None  # "bb" or "pfs", after restore()
        pfs_steps: tuple[list[int], list[int]] = ([], [])
        queued: list[int] = []
        with agreed(self.comm, f"checkpointer {name}: preparing the burst buffer"):
            self._refuse_if_open_twice()
            if self.topo.is_leader:
                self.journal.mkdir(parents=True, exist_ok=True)
                (self.journal / drain.STOP).unlink(missing_ok=True)
                drain.set_target(self.journal, self.pfs_dir, self.nodes, keep_pfs)
                left, damaged = drain.read_queue(self.journal)
                queued = [t.step for t in left if t.source.exists()]
                if left or damaged:  # an earlier job's queue: drained (or set aside) first
                    self._start_drain()
            if self.rank == 0:
                pfs_steps = drain.steps_in(self.pfs_dir), drain.committed_steps(self.pfs_dir)
        present, committed = self.comm.bcast(pfs_steps, root=0)
        # steps with anything on the PFS: a save of one of them uncommits it first
        self._pfs_steps: set[int] = set(present)
        # steps a save must not go below: committed ones, those an earlier job left
        # queued here (its drain may still commit them), and those saved since
        self._ordered_steps: set[int] = set(committed).union(*self.comm.allgather(queued))
        for directory in self._directories():
            _OPEN[directory] = self

    def _directories(self) -> tuple[str, str]:
        """The checkpointer's directories on the PFS and in this node's burst buffer.  Not
        collective."""
        return os.path.abspath(self.pfs_dir), os.path.abspath(self.bb_dir)

    def _refuse_if_open_twice(self) -> None:
        """Raise :class:`UsageError` if an open checkpointer of this process has the same
        directory on the PFS or in the burst buffer: each would check the order of its own
        saves only, and both drive one drain.  Not collective."""
        for directory in self._directories():
            other = _OPEN.get(directory)
            if other is not None and not other._closed:
                raise UsageError(
                    f"checkpointer {other.name} is already open in this process, with the "
                    f"directory {directory}",
                    path=directory,
                    hint="save through the open one, or close() it before creating another "
                    "(a with block closes it)",
                )

    # ---------------------------------------------------------------- save

    def save(
        self,
        step: int,
        arrays: Mapping[str, Any],
        attrs: Mapping[str, Any] | None = None,
        replace: bool = False,
    ):
        """Collective: save ``arrays`` as checkpoint ``step``; returns a :class:`SaveHandle`.

        ``arrays`` maps state keys to this rank's arrays, or all to
        :class:`bbio.Shard` slices of global arrays.  Returns once the node's
        file is closed and fsynced in the burst buffer (or, if that is full,
        once the checkpoint is committed on the PFS).  ``attrs`` must be JSON.
        ``step`` is a non-negative integer (NumPy's too), not below a step of
        this checkpointer committed on the PFS, queued for a drain, or saved
        since: restore and retention order checkpoints by step.  A step that
        has a complete copy (committed on the PFS, or in every node's burst
        buffer) is saved again only with ``replace`` (the same on every rank),
        which drops that copy before the new one is written.
        """
        self._check_open()
        release_deleted()  # files deleted since (by a drain): their room
        comm = self.comm
        integral = isinstance(step, numbers.Integral) and not isinstance(step, bool)
        step = int(step) if integral else step
        replace = bool(replace) if isinstance(replace, (bool, np.bool_)) else replace
        made_step_dir = False

        def check() -> _SaveCheck:
            nonlocal made_step_dir
            if not integral:
                raise UsageError(f"checkpoint steps are integers, not {step!r}")
            if not isinstance(replace, bool):
                raise UsageError(f"save: replace must be True or False, not {replace!r}")
            layout.step_dirname(step)
            user_attrs = attrs_json(step, attrs)
            try:
                spec = describe(arrays)
            except UsageError as exc:  # the call's name, the same on every rank, has no step
                exc.message = f"step {step}: {exc.message}"
                raise
            free, old_copy, old_save = None, False, None
            if self.topo.is_leader:  # a spare is claimed or deleted before the node writes
                free = self._bb_room()
                old_copy = self._has_bb_copy(step)
                old_save = self._complete_bb_save(step) if old_copy else None
                (self.bb_dir / layout.step_dirname(step)).mkdir(parents=True, exist_ok=True)
                made_step_dir = True
            return _SaveCheck(
                layout.layout_of(arrays),
                spec,
                time.time(),
                self.node,
                free,
                old_copy,
                old_save,
                user_attrs,
                arguments,
            )

        call = f"checkpoint {self.name}: save"
        arguments = fingerprints({"step": step, "replace": replace})
        try:  # the arguments are compared with what the save gathers: one collective
            checked = agreed_allgather(comm, call, check)
            check_same_arguments(call, [theirs.arguments for theirs in checked])
        except BBIOError:  # a rank's check failed: no node writes, no directory stays
            if made_step_dir:
                self._drop_unused_bb_step_dir(step)
            raise
        kinds = {theirs.layout for theirs in checked}
        if len(kinds) != 1:
            self._drop_unused_bb_step_dir(step)
            raise UsageError(f"ranks disagree on the layout of checkpoint {step}: {sorted(kinds)}")
        if len({theirs.user_attrs for theirs in checked}) != 1:
            self._drop_unused_bb_step_dir(step)
            raise UsageError(
                f"ranks disagree on the attrs of checkpoint {step}",
                hint="pass the same attrs on every rank (they are the checkpoint's, not a rank's)",
            )
        kind, when = checked[0].layout, checked[0].time
        all_specs = [theirs.spec for theirs in checked]
        try:
            self._check_newest(step)
            shapes = global_shapes(all_specs, kind)
        except UsageError:
            self._drop_unused_bb_step_dir(step)
            raise
        handle = SaveHandle(
            self.name,
            step,
            self.pfs_dir / layout.step_dirname(step),
            self.journal,
            self.nodes,
            save_time=when,
        )
        saved_before = step in self._pfs_steps or any(theirs.old_copy for theirs in checked)
        if saved_before and not replace:  # refused before a skip or a wait, and after them
            self._refuse_if_complete(step, checked)
        if self._wait_for_room(handle):
            self._drop_unused_bb_step_dir(step)
            return dataclasses.replace(handle, skipped=True)
        need = [FILE_OVERHEAD_BYTES + len(checked[0].user_attrs)] * self.nodes  # attrs: once
        free: dict[int, int] = {}
        for theirs in checked:
            need[theirs.node] += sum(
                dataset_bytes(key, entry["bytes"]) for key, entry in theirs.spec.items()
            )
            if theirs.free is not None:
                free[theirs.node] = theirs.free
        if saved_before:
            self._replace(step, checked, replace)  # its old copies go before any node writes
        first_of_step = step not in self._ordered_steps
        self._pfs_steps.add(step)
        self._ordered_steps.add(step)
        direct = not self._room_in_every_bb(need, free)
        root_attrs = file_attrs(
            step, when, self.size, self.nodes, self.node, self.node_ranks, kind, shapes, attrs
        )
        while True:
            step_dir = (self.pfs_dir if direct else self.bb_dir) / layout.step_dirname(step)
            try:
                self._write(
                    step, when, step_dir, direct, arrays, all_specs, need[self.node], root_attrs
                )
                break
            except BBIOError as exc:
                if direct or not isinstance(exc, NoSpaceError):
                    self._undo_save(step, step_dir, first_of_step)
                    raise
                self._withdraw(step, step_dir)  # a BB filled since the check, or shares a device
                self._say_direct(f"a burst buffer could not reserve its file's room ({exc})")
                direct = True
        if self.topo.is_leader and not direct:  # now: a copying drain takes CPU from the ranks
            drain.wake(self.journal)
        if direct:
            with agreed(comm, f"checkpoint {self.name} step {step}: committing on the PFS"):
                if self.rank == 0:
                    if not drain.try_commit(step_dir, self.nodes):
                        raise BBIOTimeoutError(
                            f"checkpoint {self.name} step {step} was written to the PFS but "
                            f"not committed: another process held its commit lock for "
                            f"{drain.COMMIT_PATIENCE_SECONDS:.0f} s",
                            path=step_dir / drain.COMMIT_LOCK,
                            hint="see which host and process the lock names ('readlink' "
                            "it); once that one is gone, save the step again",
                        )
                    drain.apply_pfs_retention(step_dir.parent, self.keep_pfs)
            return dataclasses.replace(handle, direct=True)
        return handle

    def _write(
        self,
        step: int,
        when: float,
        step_dir: Path,
        direct: bool,
        arrays: Mapping[str, Any],
        all_specs: list,
        need: int,
        root_attrs: Mapping[str, Any],
    ) -> None:
        """Collective: write and record this save's node files in ``step_dir`` (the PFS's
        when ``direct``, else the burst buffers', their room of ``need`` bytes reserved
        first); on a failure every rank raises, each leader's temporary file removed."""
        comm = self.comm
        if direct:
            with agreed(comm, f"checkpoint {self.name} step {step}: writing to the PFS"):
                if self.topo.is_leader:
                    step_dir.mkdir(parents=True, exist_ok=True)
                self._drop_unused_bb_step_dir(step)
        node_specs = [(r, all_specs[r]) for r in self.node_ranks]
        key = layout.layout_key(node_specs, __version__) if self.recycle and not direct else None
        node_file = step_dir / layout.node_filename(self.node)
        temp = files.temp_path(node_file)
        if direct:  # not the drain's temporary name there: a drain of an old save may copy
            mine = files.unique_temp_path(node_file) if self.topo.is_leader else None
            temp = self.topo.node_comm.bcast(mine, root=0)
        try:
            with agreed(comm, f"checkpoint {self.name} step {step}: writing"):
                recycled = False
                if self.topo.is_leader and not direct:
                    recycled = self._claim_spare(key, temp)
                written = write_node_file(
                    self.topo.node_comm,
                    node_file,
                    self.rank,
                    arrays,
                    node_specs,
                    root_attrs,
                    recycled,
                    temp,
                    reserve=0 if direct else need,
                    mappings=None if key is None else self._mappings,
                )
            with agreed(comm, f"checkpoint {self.name} step {step}: recording"):
                if self.topo.is_leader:
                    assert written is not None, "the node's file is written once all agree"
                    self._record(step_dir, step, when, written, direct, key, need)
                    if not direct:
                        self._start_drain()
        except BBIOError:
            if self.topo.is_leader:
                temp.unlink(missing_ok=True)
            raise

    def _undo_save(self, step: int, step_dir: Path, first_of_step: bool) -> None:
        """Collective: the save of ``step`` into ``step_dir`` failed: as if never made."""
        self._withdraw(step, step_dir)
        if first_of_step:  # as if never saved: no reason to refuse the steps below it
            self._ordered_steps.discard(step)

    def _say_direct(self, why: str) -> None:
        """Rank 0 says, once per checkpointer, that saves go straight to the PFS, and why."""
        if self.rank == 0 and not self._said_direct:
            log.warning(
                "checkpoint %s: %s: writing checkpoints straight to the PFS", self.name, why
            )
        self._said_direct = True

    def _check_open(self) -> None:
        """Raise UsageError once :meth:`close` was called (on every rank: it is collective),
        before the freed communicator is touched."""
        if self._closed:
            raise UsageError(
                f"checkpointer {self.name} is closed",
                path=self.pfs_dir,
                hint=f"create a new Checkpointer(comm, {self.name!r}) to save, restore or list",
            )

    def _drop_unused_bb_step_dir(self, step: int) -> None:
        """A node leader: remove the BB step directory ``save`` made, if it stayed empty."""
        if self.topo.is_leader:
            with contextlib.suppress(OSError):
                (self.bb_dir / layout.step_dirname(step)).rmdir()

    def _has_bb_copy(self, step: int) -> bool:
        """A node leader: does this node's burst buffer hold anything of ``step``?"""
        name = layout.step_dirname(step)
        return drain.task_path(self.journal, step).exists() or any(
            (self.bb_dir / name / stale).exists() for stale in layout.node_copy_names(self.node)
        )

    def _complete_bb_save(self, step: int) -> float | None:
        """A node leader: the save time of this node's complete burst-buffer copy of
        ``step`` (as :meth:`restore` would take it), or None."""
        try:
            return reader.bb_copies(self.bb_dir, self.node).get(step, {}).get("time")
        except IntegrityError:  # a damaged record: no complete copy
            return None

    def _replace(self, step: int, checked: Sequence[_SaveCheck], replace: bool) -> None:
        """Collective: before ``step`` is written again, drop its older copies everywhere,
        once the older save is known to be incomplete or ``replace`` is given (else every
        rank raises the same :class:`UsageError`).

        Each node leader drops its node's BB copy and queued task, then rank 0
        uncommits the step on the PFS (:func:`drain.uncommit`).
        """
        call = f"checkpoint {self.name} step {step}"
        if not replace:
            self._refuse_if_complete(step, checked)
        bb_step = self.bb_dir / layout.step_dirname(step)
        self._drop_copies(step, bb_step, f"{call}: replacing the old copy")
        if self.topo.is_leader:
            bb_step.mkdir(parents=True, exist_ok=True)  # if trimmed meanwhile

    def _refuse_if_complete(self, step: int, checked: Sequence[_SaveCheck]) -> None:
        """Collective: raise the same :class:`UsageError` on every rank if ``step`` has a
        complete copy (in every node's burst buffer, of one save, or committed on the
        PFS), which a save of it without ``replace`` must not drop."""
        call = f"checkpoint {self.name} step {step}"
        saves = {theirs.node: theirs.old_save for theirs in checked if theirs.old_save is not None}
        on_every_node = len(saves) == self.nodes and len(set(saves.values())) == 1
        where = "in every node's burst buffer" if on_every_node else None
        if where is None and step in self._pfs_steps:
            committed = False
            with agreed(self.comm, f"{call}: looking for its committed copy"):
                if self.rank == 0:
                    committed = drain.committed_save(self.pfs_dir / layout.step_dirname(step))
            where = "committed on the PFS" if self.comm.bcast(committed, root=0) else None
        if where is not None:
            self._drop_unused_bb_step_dir(step)
            raise UsageError(
                f"{call} is already saved ({where}): saving it again would drop that "
                "copy before the new one is durable",
                path=self.pfs_dir / layout.step_dirname(step),
                hint="save a later step, or pass replace=True to replace it (a save "
                "killed midway then leaves no copy of this step)",
            )

    def _withdraw(self, step: int, step_dir: Path) -> None:
        """Collective: undo a save of ``step`` that failed on some rank while the nodes
        wrote into ``step_dir`` or recorded their files: the step is as if never saved."""
        self._drop_copies(step, step_dir, f"checkpoint {self.name} step {step}: withdrawing")
        if self.topo.is_leader:
            with contextlib.suppress(OSError):
                step_dir.rmdir()

    def _drop_copies(self, step: int, step_dir: Path, call: str) -> None:
        """Collective: each node leader drops its node's record (first: a task without one
        is never drained, and its drain publishes no record of it after), its queued
        task, and its file and temporary file in ``step_dir``; then rank 0 uncommits
        ``step`` on the PFS (:func:`drain.uncommit`: manifest, a damaged save's marker,
        every node's record, under the step's commit lock)."""
        with agreed(self.comm, f"{call}: dropping the burst-buffer copies"):
            if self.topo.is_leader:
                with drain.records_locked(self.journal):  # not while a drain records this step
                    record, node_file = (
                        step_dir / name for name in layout.node_copy_names(self.node)
                    )
                    task = drain.task_path(self.journal, step)  # after the record: see _record
                    for path in (record, task, node_file, files.temp_path(node_file)):
                        path.unlink(missing_ok=True)
        with agreed(self.comm, f"{call}: uncommitting it on the PFS"):
            if self.rank == 0:
                drain.uncommit(self.pfs_dir / layout.step_dirname(step), self.nodes)
        release_deleted()  # the node file (a rank may map it) is gone: so is its memory

    def _claim_spare(self, key: str | None, target: Path) -> bool:
        """A node leader: move the node's spare of layout ``key`` to ``target`` (True), or
        delete its spares (without a ``key``, or none of it) so the new file has their room.

        Never raises: the node's other ranks wait for its answer, and a save
        without a spare just writes a new file.
        """
        try:
            if key is not None and drain.claim_spare(self.bb_dir, self.node, key, target):
                return True
            drain.drop_spares(self.bb_dir, self.node)
        except Exception as exc:  # recycling only saves time: it never fails a save
            log.warning("checkpoint %s: node %d writes a new file: %s", self.name, self.node, exc)
        return False

    def _record(
        self,
        step_dir: Path,
        step: int,
        when: float,
        written: tuple[int, int],
        direct: bool,
        key: str | None,
        room: int,
    ) -> None:
        """The node leader's bookkeeping once its node file (of the save at ``when``) is
        durable, ``written`` (size, CRC32C).  With a layout ``key``, retention keeps the
        file as a spare while it stays within the ``room`` a save of it is given."""
        record_path = step_dir / layout.node_record_name(self.node)
        size, file_crc = written
        if direct:  # on the PFS already: record its CRC32C and contents for the commit
            node_file = step_dir / layout.node_filename(self.node)
            size, crc = files.checksum_file(node_file)
            if (size, crc) != written:
                raise IntegrityError(
                    f"the node file reads back as {size} bytes, CRC32C {crc:08x}; "
                    f"{written[0]} bytes, {file_crc:08x} were written",
                    path=node_file,
                    hint="the PFS may be failing: save again",
                )
            files.write_json_atomic(
                record_path,
                {
                    "size": size,
                    "crc32c": crc,
                    "node": self.node,
                    "time": when,
                    "contents": describe_node_file(node_file, self.node),
                },
            )
            return
        record = {
            "size": size,
            "crc32c": None,  # set by the drain: the PFS copy's
            "file_crc32c": file_crc,
            "node": self.node,
            "time": when,
            "complete": True,
            "layout": self._rank_layout(),
        }
        if key is not None:
            record["spare"] = {"layout_key": key, "max_bytes": room}
        task = drain.Task(
            self.name,
            step,
            self.node,
            self.nodes,
            str(step_dir),
            str(self.pfs_dir / layout.step_dirname(step)),
            self.keep_pfs,
            self.keep_bb,
            self.verify,
            when,
        )
        with drain.records_locked(self.journal):  # not while a drain records this step
            drain.add_task(self.journal, task)  # first: killed in between, the save leaves
            files.write_json_atomic(record_path, record)  # no record, so nothing takes it

    def _rank_layout(self) -> dict[str, Any]:
        """This job's layout of ranks as a node's record holds it: a restore reads the
        node's burst-buffer copy only in the same layout."""
        return {"ranks": self.size, "nodes": self.nodes, "node_ranks": self.node_ranks}

    def _busy(self) -> bool:
        """Collective: does any node still have checkpoints to drain?  A node leader whose
        queue holds tasks that no drain holds starts one (the last one died): else a
        blocking or skipping save, or ``close``, would wait for ever."""
        queued = np.zeros(1, np.int64)  # nodes with tasks, summed by the agreement
        with agreed(self.comm, f"checkpoint {self.name}: looking at the drains' queues", queued):
            mine = self.topo.is_leader and any(drain.read_queue(self.journal))
            own_alive = self._drain is not None and self._drain.poll() is None
            if mine and not own_alive and not drain.is_draining(self.journal):
                try:
                    self._start_drain()
                except OSError as exc:  # the next look tries again; no rank is left waiting
                    log.warning("checkpoint %s: cannot start a drain: %s", self.name, exc)
            queued[0] = int(mine)
        return bool(queued[0])

    def _check_newest(self, step: int) -> None:
        """Raise :class:`UsageError` if a later step than ``step`` is committed on the PFS,
        still queued for a drain, or saved by this checkpointer: retention would trim
        ``step`` as soon as it is committed, and a restart restore the later one.  A later
        step left uncommitted and unqueued (its job died while draining it, and no node
        holds it any more) is no reason.  Not collective (every rank knows the same
        steps)."""
        later = sorted(s for s in self._ordered_steps if s > step)
        if later:
            raise UsageError(
                f"checkpoint {self.name} already has step {later[-1]}, later than step {step}: "
                "restore and retention order checkpoints by step, so step "
                f"{step} would be trimmed once committed and a restart would restore step "
                f"{later[-1]}",
                path=self.pfs_dir / layout.step_dirname(later[-1]),
                hint=f"save steps after {later[-1]}; to go back to step {step} for good, "
                f"remove the later steps' directories ({len(later)}) on the PFS and in the "
                "burst buffers (and their task-<step>.json in the burst buffers' "
                "ckpt/<name>/.journal) first, or use another checkpoint name",
            )

    def _wait_for_room(self, handle: SaveHandle) -> bool:
        """Collective: apply the backpressure policy; True if this save is to be skipped."""
        if self.backpressure == "queue" or not self._busy():
            return False
        if self.backpressure == "skip":
            if self.rank == 0:
                log.warning(
                    "checkpoint %s step %d skipped: earlier checkpoints are still draining",
                    self.name,
                    handle.step,
                )
            return True
        while self._busy():
            time.sleep(0.05)
        return False

    def _room_in_every_bb(self, need: list[int], free: dict[int, int]) -> bool:
        """Collective: can every node's burst buffer hold its file (``need[node]`` bytes)?

        ``free`` is each node's free space, as its leader saw it (where short, seen
        again once no rank maps a deleted file: :mod:`bbio.checkpoint.mapped`).  The
        drain trims drained BB copies beyond ``keep_bb`` in the background; a node short of
        room trims them here first, and then, while still short, one more, oldest
        first (:func:`drain.trim_bb`: drained, and not newer than the newest
        committed step), so a burst buffer that holds fewer than ``keep_bb``
        checkpoints keeps the newest it can.  If a node still lacks room, every
        node writes straight to the PFS (said once).
        """
        short = [(node, free[node]) for node in range(self.nodes) if need[node] > free[node]]
        if short:
            # a deleted file's pages are freed once no rank maps it: none does from here on
            self._mappings.close()
            release_deleted()
            self.topo.node_comm.Barrier()

            def trim() -> tuple[int, int] | None:
                if not self.topo.is_leader or need[self.node] <= free[self.node]:
                    return None
                left = self._bb_room()
                if need[self.node] <= left:  # the room of files other ranks still mapped
                    return self.node, left
                drain.drop_spares(self.bb_dir, self.node)
                for keep in range(self.keep_bb - 1, -1, -1):  # then one more, oldest first
                    drain.trim_bb(
                        self.bb_dir, self.node, keep, self.pfs_dir, self.journal, recycle=False
                    )
                    left = files.free_bytes(self.bb_dir)
                    if need[self.node] <= left:
                        break
                return self.node, left

            trimmed = agreed_allgather(self.comm, "checkpoint: making room", trim)
            short = [(n, left) for n, left in filter(None, trimmed) if need[n] > left]
        if short:
            node, left = short[0]
            self._say_direct(
                f"the burst buffer of node {node} cannot hold it ({format_bytes(need[node])} "
                f"needed, {format_bytes(left)} free)"
            )
        return not short

    def _bb_room(self) -> int:
        """A node leader: the bytes free in the node's burst buffer, its spare files
        counted (a save reuses or deletes them before it writes)."""
        return files.free_bytes(self.bb_dir) + drain.spare_bytes(self.bb_dir, self.node)

    def _start_drain(self) -> None:
        """Start this node's drain, unless this process's is running or another drain
        waits to take the journal over (one that cannot finish its queue holds it)."""
        if self._drain is not None and self._drain.poll() is None:
            return
        if drain.has_waiting_drain(self.journal):
            return
        log_file = open(self.journal / "drain.log", "ab")  # noqa: SIM115 (the child keeps it)
        self._drain = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bbio.checkpoint.drainer",
                "--journal",
                str(self.journal),
                "--parent",
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # outlives the training process
            close_fds=True,
        )
        log_file.close()

    # ------------------------------------------------------------- restore

    def restore(
        self,
        step: int | None = None,
        want: Mapping[str, tuple[Sequence[int], Sequence[int]]] | None = None,
        from_rank: int | None = None,
    ) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
        """Collective: load the newest complete checkpoint (or ``step``): (step, arrays, attrs).

        By default each rank gets back what it saved, which needs the same
        rank count.  With global arrays, ``want`` maps keys to the (start,
        shape) box this rank wants, whatever the rank count; with per-rank
        arrays, ``from_rank`` picks whose arrays to read.  Copies that fail
        verification are skipped with a warning naming the file, for the
        step's other copy or the previous checkpoint, which a last warning
        names.  A ``want`` or ``from_rank`` the newest complete checkpoint
        cannot serve (per-rank arrays, an unsaved rank, key or box), or neither
        when it was saved by another rank count, raises :class:`UsageError` on
        every rank instead.
        """
        self._check_open()
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            step = int(step)  # NumPy's steps equal to Python's
        same_arguments(  # each rank's want and from_rank may differ, not whether it gives one
            self.comm,
            f"checkpoint {self.name}: restore",
            {
                "step": step,
                "want given": want is not None,
                "from_rank given": from_rank is not None,
            },
        )
        comm = self.comm
        with agreed(comm, f"checkpoint {self.name}: restore"):  # want and from_rank: per rank
            if step is not None:
                step = integer_argument("step", step, 0)
            if want is not None:
                want = layout.wanted_boxes(want)
            if from_rank is not None:
                from_rank = integer_argument("from_rank", from_rank, 0)
        skipped: list[str] = []
        tried: set[tuple[int, str]] = set()
        resharding = want is not None or from_rank is not None
        for _ in range(RESTORE_LISTINGS):  # listed again if a newer step was committed since
            untried = [
                (s, tier)
                for s, tier in self._restore_candidates(step, resharding)
                if (s, tier) not in tried
            ]
            tried.update(untried)
            result = self._restore_first(untried, want, from_rank, skipped)
            if result is not None:
                return result
            if not untried:
                break
        where = f"step {step}" if step is not None else "any step"
        why = f"; skipped: {'; '.join(skipped[:3])}" if skipped else ""
        raise NotFoundError(
            f"no complete checkpoint {self.name!r} ({where}) in the burst buffers or on the "
            f"PFS{why}",
            path=self.pfs_dir,
            hint="a checkpoint counts once every node's file is durable (and, on the PFS, "
            "its manifest is written)",
        )

    def _restore_candidates(self, step: int | None, resharding: bool) -> list[tuple[int, str]]:
        """Collective: the copies a restore may read, newest first: (step, "bb" or "pfs"),
        or (step, state) for a step only in the burst buffers that this restore cannot
        read: "bb only" (``resharding`` reads the PFS), or the step's
        :func:`reader.bb_states` state ("other layout", "partial")."""
        pfs_saves: dict[int, Any] = {}
        with agreed(self.comm, f"checkpoint {self.name}: listing checkpoints"):
            if self.rank == 0:
                pfs_saves = drain.committed_saves(self.pfs_dir)
            local = self._bb_copies_here() if self.topo.is_leader else None
        pfs_saves = self.comm.bcast(pfs_saves, root=0)
        per_node = [c for c in self.comm.allgather(local) if c is not None]
        states = reader.bb_states(per_node, pfs_saves)
        copies = []
        for s in sorted(set(pfs_saves) | set(states), reverse=True):
            if step is not None and s != step:
                continue
            state = states.get(s)
            tiers = ["bb"] if state == reader.USABLE and not resharding else []
            if s in pfs_saves:
                tiers.append("pfs")
            elif state in (reader.PARTIAL, reader.SET_ASIDE):
                tiers.append(state)
            elif resharding:
                tiers.append("bb only")
            elif state == reader.OTHER_LAYOUT:
                tiers.append(state)
            copies += [(s, tier) for tier in tiers]
        return copies

    def _bb_copies_here(self) -> dict[int, dict[str, Any]]:
        """The node leader: this node's complete burst-buffer copies, {step: {"time",
        "same_layout", "nodes", "set_aside"}} as :func:`reader.bb_states` takes them.  A
        record of an earlier bbio does not say its layout: taken as this job's, checked
        when read."""
        mine = self._rank_layout()
        aside = drain.set_aside(self.journal)
        copies = {}
        for s, record in reader.bb_copies(self.bb_dir, self.node).items():
            saved, when = record.get("layout", mine), record.get("time")
            copies[s] = {"time": when, "same_layout": saved == mine, "nodes": saved["nodes"]}
            set_aside = s in aside and aside[s].get("time") == when
            why = "task file" if set_aside and aside[s].get(drain.TASK_DAMAGED) else "node file"
            copies[s]["set_aside"] = why if set_aside else None
        return copies

    def _restore_first(
        self, copies: list[tuple[int, str]], want, from_rank, skipped: list[str]
    ) -> tuple[int, dict[str, np.ndarray], dict[str, Any]] | None:
        """Collective: the first of ``copies`` that restores, else None; each copy passed
        over is added to ``skipped`` and warned of.  A step saved by another layout of
        ranks, only in the burst buffers, raises :class:`UsageError` on every rank (all
        have the same ``copies``): the newest checkpoint is not passed over for an older
        one because this job cannot read it yet."""
        for s, tier in copies:
            if tier == reader.OTHER_LAYOUT:
                raise UsageError(
                    f"checkpoint {self.name} step {s} is only in the burst buffers, saved by "
                    f"another layout of ranks than this job's ({self.size} ranks on "
                    f"{self.nodes} nodes): restore reads it in the layout that saved it, or "
                    "from the PFS once drained",
                    path=self.pfs_dir / layout.step_dirname(s),  # the same on every rank
                    hint="let its drain commit it ('bbio ckpt drain --finish' on the nodes "
                    "that saved it, or 'bbio ckpt wait'), then restore (with want= or "
                    "from_rank= for another rank count); or restore step= an older one",
                )
            if tier in _UNREADABLE:
                problem = _UNREADABLE[tier]
                skipped.append(f"step {s} (bb): {problem}")
                if self.rank == 0:
                    log.warning(
                        "checkpoint %s step %d skipped: %s%s",
                        self.name,
                        s,
                        problem,
                        " (wait for its drain)" if tier == "bb only" else "",
                    )
                continue
            result, problem = self._try_restore(s, tier, want, from_rank)
            if result is not None:
                self.last_restore_tier = tier
                if skipped and self.rank == 0:
                    log.warning(
                        "checkpoint %s: restored step %d from its %s copy instead",
                        self.name,
                        s,
                        "burst-buffer" if tier == "bb" else "PFS",
                    )
                return result
            skipped.append(f"step {s} ({tier}): {problem}")
            if self.rank == 0:
                log.warning("checkpoint %s step %d (%s) skipped: %s", self.name, s, tier, problem)
        return None

    def _try_restore(self, step: int, tier: str, want, from_rank):
        """Collective: (result, None), or (None, the first problem: the same on every rank).

        Verification, then reading; each ends with an agreement, and nothing
        between them is collective, so a failure on one rank never hangs another.
        A request the checkpoint cannot serve (:class:`reader.RequestError`) on
        any rank raises the same :class:`UsageError` on every rank: an older
        checkpoint is not tried instead.
        """
        for phase in (self._verify, self._read):
            problem = None
            result = None
            try:
                result = phase(step, tier, want, from_rank)
            except reader.RequestError as exc:
                problem = (True, str(exc))
            except Exception as exc:  # any failure of any rank: agree, then try the next copy
                problem = (
                    False,
                    f"{type(exc).__name__}: {exc}" if not isinstance(exc, BBIOError) else str(exc),
                )
            problems = [(r, *p) for r, p in enumerate(self.comm.allgather(problem)) if p]
            requests = [(r, "UsageError", text) for r, request, text in problems if request]
            if requests:
                what = f"restoring checkpoint {self.name} step {step}"
                raise agreed_error(requests, what, self.size)
            if problems:
                return None, problems[0][2]
        return result, None

    def _verify(self, step: int, tier: str, want, from_rank) -> None:
        """Check that the PFS copy can serve this rank's ``want`` or ``from_rank``, then the
        files this rank is responsible for (each file is checked once): a burst-buffer
        copy whole, by its node's leader, before any rank opens it with HDF5."""
        name = layout.step_dirname(step)
        if tier == "bb":
            if self.topo.is_leader:
                path = self.bb_dir / name / layout.node_filename(self.node)
                record = files.read_json(self.bb_dir / name / layout.node_record_name(self.node))
                if record is None:
                    raise NotFoundError("the burst-buffer copy is no longer recorded", path=path)
                reader.verify_file(path, record["size"], reader.bb_file_crc(record))
            return
        manifest = reader.pfs_manifest(self.pfs_dir, step)
        if manifest is None:
            raise NotFoundError("the checkpoint is no longer committed", path=self.pfs_dir / name)
        reader.check_request(manifest, self.pfs_dir / name, want, from_rank)
        if want is None and from_rank is None and manifest["ranks"] != self.size:
            raise reader.RequestError(  # not a damaged copy: an older step is not tried
                f"checkpoint {step} was saved by {manifest['ranks']} ranks, not {self.size}",
                path=self.pfs_dir / name,
                hint="pass want= (global arrays) or from_rank= (per-rank arrays), or step= "
                f"a checkpoint saved by {self.size} ranks",
            )
        records = {f["path"]: f for f in manifest["files"]}
        for n in range(self.rank, manifest["nodes"], self.size):
            entry = records[layout.node_filename(n)]
            reader.verify_file(self.pfs_dir / name / entry["path"], entry["size"], entry["crc32c"])

    def _read(self, step: int, tier: str, want, from_rank):
        name = layout.step_dirname(step)
        if tier == "bb":
            path = self.bb_dir / name / layout.node_filename(self.node)
            meta = reader.file_meta(path)
            if meta["nodes"] != self.nodes or meta["node_ranks"] != self.node_ranks:
                raise reader.RequestError(  # a save whose record does not say its layout
                    f"step {step} was saved by {meta['ranks']} ranks on {meta['nodes']} nodes "
                    f"(ranks {meta['node_ranks']} on this one), not this job's layout",
                    path=path,
                    hint="restore it once drained, with want= or from_rank=; or restore "
                    "step= an older one",
                )
            return step, reader.read_rank(path, self.rank), meta["user_attrs"]
        step_dir = self.pfs_dir / name
        manifest = reader.pfs_manifest(self.pfs_dir, step)
        if manifest is None:
            raise NotFoundError("the checkpoint is no longer committed", path=step_dir)
        attrs = manifest["attrs"]
        if want is not None:  # of a global checkpoint: check_request saw to that
            return (
                step,
                reader.read_boxes(
                    reader.saved_boxes(manifest, step_dir), want, manifest["global_shapes"]
                ),
                attrs,
            )
        source_rank = self.rank if from_rank is None else from_rank  # checked by _verify
        node = manifest["rank_nodes"][source_rank]
        return step, reader.read_rank(step_dir / layout.node_filename(node), source_rank), attrs

    # -------------------------------------------------------- list, close

    def list(self) -> list[CheckpointInfo]:
        """Collective over the checkpointer's communicator: every step in either tier, with
        its state.  A step's burst-buffer copies are "all nodes" only when every node holds
        one of the same save, the committed one's if it is committed, saved in this job's
        layout of ranks (as :meth:`restore` counts them); else the nodes holding a copy are
        named, and why copies of another layout, or on every node, do not count."""
        self._check_open()
        same_arguments(self.comm, f"checkpoint {self.name}: list", {})
        pfs: dict[int, str] = {}
        saves: dict[int, Any] = {}
        with agreed(self.comm, f"checkpoint {self.name}: listing"):
            if self.rank == 0:
                pfs, saves = drain.describe_pfs(self.pfs_dir)
            local = self._bb_copies_here() if self.topo.is_leader else None
        pfs, saves = self.comm.bcast((pfs, saves), root=0)
        per_node = [c for c in self.comm.allgather(local) if c is not None]
        states = reader.bb_states(per_node, saves)
        infos = []
        for s in sorted(set(pfs) | set(states)):
            holders = [n for n, c in enumerate(per_node) if s in c]
            if states.get(s) == reader.USABLE:
                bb = "all nodes"
            elif states.get(s) == reader.SET_ASIDE:
                bb = f"nodes {holders}, set aside as damaged (not restored from)"
            elif holders and not all(per_node[n][s]["same_layout"] for n in holders):
                bb = f"nodes {holders}, saved by another layout of ranks (not restored from)"
            elif len(holders) == self.nodes:
                times = {c[s].get("time") for c in per_node}
                which = "of different saves" if len(times) > 1 else "not the committed save"
                bb = f"nodes {holders}, {which} (not restored from)"
            else:
                bb = f"nodes {holders}" if holders else "-"
            infos.append(CheckpointInfo(s, bb, pfs.get(s, "-")))
        return infos

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Collective over the checkpointer's communicator: optionally wait until every
        save is committed, then stop the drains (which delete the spare files).

        With ``wait``, returns on every rank once every node's drain has stopped,
        and the ``timeout`` is agreed: every rank raises the same error at once
        (the drains then keep their journals for ``bbio ckpt drain --finish``).
        Without ``wait`` (as on an exception inside ``with``) nothing waits for
        other ranks.  Closing a closed checkpointer does nothing (and is not collective).
        While other ranks are in another call of this checkpointer (closed on some ranks
        only), every rank raises the same :class:`UsageError` and nothing is closed.
        """
        if self._closed:
            return
        if wait:  # a rank in another call (say save) raises here, and nothing is closed
            same_arguments(self.comm, f"checkpoint {self.name}: close", {})  # each its timeout
            with agreed(self.comm, f"checkpoint {self.name}: close"):
                timeout = seconds_argument("close: timeout", timeout)
        drained = False
        try:
            if wait:
                deadline = None if timeout is None else time.monotonic() + timeout
                while self._busy():
                    late = deadline is not None and time.monotonic() > deadline
                    # the smallest timeout that has passed on any rank: the same on every rank
                    passed = self.comm.allreduce(timeout if late else math.inf, op=_min())
                    if passed != math.inf:
                        raise BBIOTimeoutError(
                            f"checkpoints of {self.name} still draining after {passed:g} s "
                            "(the shortest close timeout given on any rank)",
                            hint="'bbio ckpt drain --finish' completes them",
                        )
                    time.sleep(0.05)
                drained = True
        finally:
            self._mappings.close()  # before the drains delete the spares: their memory is freed
            if self.topo.is_leader:
                self._stop_drain(drained)
            if drained:
                self.comm.Barrier()
            self._closed = True
            for directory in self._directories():
                if _OPEN.get(directory) is self:
                    del _OPEN[directory]
            self.topo.free()
            self.comm.Free()

    def _stop_drain(self, drained: bool) -> None:
        """Node leader: tell this node's drain to stop once idle with the journal's (empty)
        stop file, which a full burst buffer still takes; with every save ``drained``,
        wait for the drain this process started to exit (it only trims, and deletes the
        spares).  Where the file cannot be created, that drain is told by
        :data:`drain.STOP_SIGNAL` instead, and another drain stops once its training
        process is gone; said in a warning.  Never raises."""
        stop = self.journal / drain.STOP
        running = self._drain is not None and self._drain.poll() is None
        ours = self._drain if drained and running else None
        try:
            os.close(os.open(stop, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as exc:
            if ours is not None:  # it has drained saves: its handler is in place
                ours.send_signal(drain.STOP_SIGNAL)
            log.warning(
                "checkpoint %s, node %d: cannot create %s (%s); %s",
                self.name,
                self.node,
                stop,
                exc.strerror or exc,
                "its drain was told to stop by a signal"
                if ours is not None
                else "its drain stops once the training process has exited",
            )
        if ours is not None:
            ours.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=exc[0] is None)


_UNREADABLE = {  # why a step only in the burst buffers is not restored, by its state
    "bb only": "only in the burst buffers; want= and from_rank= read the PFS copy",
    reader.PARTIAL: "its burst-buffer copies are not one whole save on this job's nodes, and "
    "it is not committed (a save that did not finish, or one by nodes not all in this job: "
    "if it finished, 'bbio ckpt drain --finish' on its nodes commits it)",
    reader.SET_ASIDE: "its drain set it aside (a node file, or a drain task file, was damaged "
    "in the burst buffer: 'bbio ckpt verify' on its node names it), so it is never committed",
}


def attrs_json(step: int, attrs: Mapping[str, Any] | None) -> str:
    """The JSON text of a checkpoint's ``attrs``, or the :class:`UsageError` saying why
    they cannot be restored as given: a dict key that is not a string (JSON would make
    it one), NaN or infinity (not JSON), or a value JSON has no type for.  Tuples are
    restored as lists.  Not collective."""
    try:
        document = dict(attrs or {})
        json.dumps(document, allow_nan=False)  # first: a cycle is refused here
        for odd_key in _non_string_keys(document):
            raise ValueError(f"the key {odd_key!r} is not a string (JSON would make it one)")
        return json.dumps(document, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"the attrs of checkpoint {step} are not JSON: {exc}",
            hint="pass a dict with string keys of str, int, finite float, bool, None, lists "
            "and dicts (NumPy numbers: int() or float() them; tuples come back as lists)",
        ) from None


def _non_string_keys(value: Any) -> Iterator[Any]:
    """The dict keys inside ``value`` that are not ``str``."""
    if isinstance(value, Mapping):
        yield from (key for key in value if not isinstance(key, str))
        items: Iterable[Any] = value.values()
    else:
        items = value if isinstance(value, (list, tuple)) else ()
    for item in items:
        yield from _non_string_keys(item)


def _min():
    from mpi4py import MPI

    return MPI.MIN
