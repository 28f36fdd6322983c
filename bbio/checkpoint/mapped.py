"""Rewriting recycled node files on tmpfs through mappings kept from one save to the next.

A save that rewrites a recycled node file (a spare, see :mod:`bbio.checkpoint.writer`)
overwrites pages the file already has.  On tmpfs a ``pwrite`` still costs the
kernel a lookup and a lock for every 4 KiB page: 16 MiB took four times as long
as copying them in memory.  Through a shared mapping of the file that is already
set up, the same bytes are a plain copy.  So each rank maps its part of a node
file the first time it rewrites it and keeps the mapping, and the next save
that gets the same file back (a node's few files take turns: those kept in the
burst buffer and its spare) copies into it.

Only on tmpfs: there, a file's pages stay in memory, written or not.  On a disk
file system a mapped page must be read before it is written once its file was
flushed, and each written page faults; ``pwrite`` is faster there.

A mapping keeps its file's pages alive.  A rank therefore also keeps a
descriptor of each mapped file and releases the mappings of deleted files
(:func:`release_deleted`, every checkpointer's of the process) when a save
starts, before a save lays out a new file, and once a save dropped a copy
(a step saved again, a failed save withdrawn); a save short of room releases
all of its own before it trims copies; at most ``limit`` are kept.  Mappings
and descriptors are left out of forked children (a data loader's workers),
which could otherwise hold a deleted file's memory for as long as they live.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import weakref
from pathlib import Path

from bbio import _native

log = logging.getLogger("bbio")


@dataclasses.dataclass
class _Kept:
    fd: int  # the file's own descriptor: whether it was deleted is asked of it
    mapping: _native.SharedMapping

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


class NodeFileMappings:
    """Not collective, not thread-safe: one process's mappings of the node files it
    rewrote in a tmpfs burst buffer, at most ``limit`` of them, each file's own."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._kept: collections.OrderedDict[tuple[int, int], _Kept] = collections.OrderedDict()
        _LIVE.add(self)

    def __len__(self) -> int:
        return len(self._kept)

    def mapping(self, fd: int, path: Path, start: int, end: int) -> _native.SharedMapping | None:
        """A mapping of bytes ``start`` to ``end`` of the node file ``path``, open read-write
        as ``fd``, the one kept from an earlier save of the same file if it covers them.
        None where the file is not on tmpfs, is shorter than ``end`` or cannot be mapped:
        the caller writes with ``pwrite`` instead."""
        info = os.fstat(fd)
        identity = (info.st_dev, info.st_ino)  # not reused while kept: the mapping holds it
        kept = self._kept.pop(identity, None)
        if kept is not None:
            covers = kept.mapping.start <= start and end <= kept.mapping.end
            if covers and info.st_size >= kept.mapping.end:
                self._kept[identity] = kept  # the most recently used last
                return kept.mapping
            kept.close()
        if info.st_size < end:
            return None
        try:
            if not _native.on_tmpfs(fd, path):
                return None
            # a page of the range that is a hole would be a SIGBUS, not an error, if the
            # tmpfs were full when the copy reached it: none is
            _native.preallocate(fd, end - start, at_least=0, keep_size=True, offset=start)
            own = os.dup(fd)
        except OSError as exc:
            log.debug("checkpoint file %s: written without a mapping (%s)", path, exc)
            return None
        try:
            mapping = _native.SharedMapping(own, start, end, path)
        except OSError as exc:
            os.close(own)
            log.debug("checkpoint file %s: written without a mapping (%s)", path, exc)
            return None
        while len(self._kept) >= self.limit:
            self._kept.popitem(last=False)[1].close()
        self._kept[identity] = _Kept(own, mapping)
        return mapping

    def release_unlinked(self) -> None:
        """Release the mappings of files deleted since (their memory goes back to tmpfs)."""
        for identity, kept in list(self._kept.items()):
            if os.fstat(kept.fd).st_nlink == 0:
                del self._kept[identity]
                kept.close()

    def close(self) -> None:
        """Release every mapping."""
        while self._kept:
            self._kept.popitem()[1].close()

    def _forget_in_child(self) -> None:
        """In a forked child: it has none of the mappings; close its copies of the
        descriptors, which would keep deleted files' memory."""
        for kept in self._kept.values():
            kept.mapping.forget()
            with contextlib.suppress(OSError):
                os.close(kept.fd)
        self._kept.clear()


_LIVE: weakref.WeakSet[NodeFileMappings] = weakref.WeakSet()


def release_deleted() -> None:
    """Not collective: every checkpointer of this process releases its mappings of files
    deleted since (:meth:`NodeFileMappings.release_unlinked`)."""
    for mappings in list(_LIVE):
        mappings.release_unlinked()


def _forget_all_in_child() -> None:
    for mappings in list(_LIVE):
        mappings._forget_in_child()


os.register_at_fork(after_in_child=_forget_all_in_child)
