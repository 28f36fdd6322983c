"""Packing and replicating many small files keeps a bounded number of them open at once
(:data:`bbio.stage.plan.OPEN_FILES_AT_ONCE`): with a low limit on open files
(RLIMIT_NOFILE), both still work.  MPI tests on 2 or 4 ranks in 2 virtual nodes."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

import bbio
from bbio.stage.plan import OPEN_FILES_AT_ONCE
from tests.test_stage import files_under, two_nodes

pytestmark = pytest.mark.mpi(min_size=2)

MARGIN = 64  # descriptors MPI, HDF5 and the copy's own files may open meanwhile


@contextlib.contextmanager
def open_files_limited() -> Iterator[int]:
    """For the block, this process may open :data:`OPEN_FILES_AT_ONCE` + :data:`MARGIN`
    more files than it holds now: the limit it yields."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + OPEN_FILES_AT_ONCE + MARGIN
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def many(comm, shared_tmp) -> Path:
    """More one-byte files than each rank may open at once under :func:`open_files_limited`,
    even when they are shared out over every rank."""
    root = shared_tmp / "pfs" / "many"
    if comm.Get_rank() == 0:
        root.mkdir(parents=True)
        for i in range(2 * (OPEN_FILES_AT_ONCE + MARGIN) * comm.Get_size()):
            (root / f"f{i:05d}").write_bytes(b"x")
    comm.Barrier()
    return root


def test_pack_reads_many_small_files_a_bounded_number_at_a_time(comm, shared_tmp, many):
    """Before, a slab of 64 MiB opened every file it held at once: "Too many open files"."""
    config = two_nodes(comm, shared_tmp)
    with open_files_limited():
        summary = bbio.pack(comm, many, shared_tmp / "packed", config=config)
    assert (summary.samples, summary.shards) == (len(os.listdir(many)), 1)


def test_replicate_reads_many_small_files_a_bounded_number_at_a_time(comm, shared_tmp, many):
    """Before, a column member opened every file of its 64 MiB round at once."""
    config = two_nodes(comm, shared_tmp)
    with open_files_limited():
        summary = bbio.stage_in(comm, many, shared_tmp / "bb" / "{node}" / "many", config=config)
    assert summary.files == 2 * len(os.listdir(many))
    assert len(files_under(shared_tmp / "bb" / "1" / "many")) == len(os.listdir(many))
