"""Collective reads at the machine's limits: more files than descriptors, a rank out of
memory, more samples than one MPI message can describe.  The MPI tests run on 2 or 4
ranks."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import resource
import signal
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest

import bbio
from bbio.read import datasets
from bbio.read.datasets import _DatasetDescriptors, _Descriptors
from tests.test_read import MODES, config_for, sample_bytes
from tests.test_read_usage import last_rank, same_everywhere


@contextmanager
def soft_limit(kind: int, value: int):
    """This process's soft limit ``kind`` set to ``value`` for the block (the hard one kept)."""
    soft, hard = resource.getrlimit(kind)
    resource.setrlimit(kind, (value, hard))
    try:
        yield
    finally:
        resource.setrlimit(kind, (soft, hard))


# ------------------------------------------------------------ open descriptors


class FilesOf:
    """Stands for a dataset: opens ``paths`` by index."""

    def __init__(self, paths: list) -> None:
        self.paths = paths

    def _open_file(self, f: int, direct: bool) -> tuple[int, bool]:
        return os.open(self.paths[f], os.O_RDONLY), direct


def shared_descriptors(owners: list, limit: int):
    """A :class:`_Descriptors` of ``limit`` and each of ``owners``' share of it."""
    shared = _Descriptors(limit)
    views = [_DatasetDescriptors(owner, shared) for owner in owners]
    shared.limit = limit  # each view set it from RLIMIT_NOFILE
    return shared, views


def test_descriptors_in_use_stay_open_and_the_others_within_the_limit(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(4)]
    for path in paths:
        path.write_bytes(b"x")
    owner = FilesOf(paths)
    _, (cache,) = shared_descriptors([owner], 3)
    with (
        cache.pinned([(0, False), (1, False)]) as first,
        cache.pinned([(2, True)]) as second,  # a second reader, within the limit
    ):
        in_use = {**first, **second}
        assert set(cache.held) == set(in_use)
        for (f, _), (fd, _) in in_use.items():
            assert os.fstat(fd).st_ino == paths[f].stat().st_ino
    with cache.pinned([(3, False)]):  # the least recently used went
        assert list(cache.held) == [(1, False), (2, True), (3, False)]
    cache.close_all()
    assert not cache.held


def test_a_read_that_would_pin_beyond_the_limit_waits_for_the_reads_in_flight(tmp_path):
    """Before, reads in flight at once (a loader's prefetch, an aggregator's round,
    another dataset's read) could each pin up to the limit: twice RLIMIT_NOFILE's
    budget, EMFILE.  A read now waits until the pinned ones leave it room."""
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for path in paths:
        path.write_bytes(b"x")
    owners = [FilesOf(paths), FilesOf(paths)]
    shared, (train, validation) = shared_descriptors(owners, 2)
    entered = threading.Event()

    def read_validation() -> None:
        with validation.pinned([(2, False)]):
            entered.set()

    reader = threading.Thread(target=read_validation)
    with train.pinned([(0, False), (1, False)]):
        reader.start()
        assert not entered.wait(0.3)  # three would be pinned: it waits
        assert len(shared.held) == 2
    reader.join(timeout=10)
    assert entered.is_set() and len(shared.held) <= 2


def test_the_datasets_of_a_process_share_one_limit(tmp_path):
    """Before, each dataset kept up to the whole budget open: two of them could together
    reach RLIMIT_NOFILE."""
    paths = [tmp_path / f"f{i}" for i in range(4)]
    for path in paths:
        path.write_bytes(b"x")
    owners = [FilesOf(paths), FilesOf(paths)]
    shared, (train, validation) = shared_descriptors(owners, 3)
    for f in range(3):
        with train.pinned([(f, False)]):
            pass
    with validation.pinned([(0, False), (1, False)]) as opened:
        assert len(shared.held) == 3  # of train, only its most recent is left
        assert list(train.held) == [(2, False)] and set(validation.held) == set(opened)
    validation.close_all()  # closes its own only
    assert list(shared.held) and list(train.held) == [(2, False)] and not validation.held
    train.close_all()
    assert not shared.held


class SlowFilesOf(FilesOf):
    """Stands for a dataset on a slow PFS: opening file 1 waits for ``opening_may_end``."""

    def __init__(self, paths: list) -> None:
        super().__init__(paths)
        self.opening, self.opening_may_end = threading.Event(), threading.Event()

    def _open_file(self, f: int, direct: bool) -> tuple[int, bool]:
        if f == 1:
            self.opening.set()
            self.opening_may_end.wait(10)
        return super()._open_file(f, direct)


def test_a_slow_open_holds_up_no_read_of_a_file_already_open(tmp_path):
    """Before, files were opened under the lock of the descriptors every dataset
    shares: one slow open on the PFS held up every read of the process."""
    paths = [tmp_path / f"f{i}" for i in range(2)]
    for path in paths:
        path.write_bytes(b"x")
    owner = SlowFilesOf(paths)
    _, (view,) = shared_descriptors([owner], 4)
    with view.pinned([(0, False)]):
        pass  # file 0 stays open

    def open_slowly() -> None:
        with view.pinned([(1, False)]):
            pass

    slow = threading.Thread(target=open_slowly)
    slow.start()
    owner.opening.wait(10)
    read = threading.Event()

    def read_open_file() -> None:
        with view.pinned([(0, False)]):
            read.set()

    reader = threading.Thread(target=read_open_file)
    reader.start()
    try:
        assert read.wait(5), "the read of an open file waited for another file's open"
    finally:
        owner.opening_may_end.set()
        slow.join()
        reader.join()


@pytest.mark.timeout(30)  # before the fix: a deadlock
def test_a_collection_in_a_thread_holding_the_lock_does_not_deadlock(tmp_path):
    """A dataset dropped in a reference cycle is collected whenever the garbage collector
    runs, in whatever thread, which may hold the shared descriptors' lock: its
    finalizer takes no lock."""
    path = tmp_path / "f0"
    path.write_bytes(b"x")
    owner = FilesOf([path])
    owner.cycle = owner
    shared, (view,) = shared_descriptors([owner], 4)
    with view.pinned([(0, False)]):
        pass
    del owner
    with shared._changed:  # as inside any call of the pool
        gc.collect()
    assert not view.held and not shared.held


def test_a_forked_child_opens_files_while_the_parent_held_the_lock(tmp_path):
    """Another thread of the parent holds the shared descriptors' lock when the process
    forks: the child starts with a new lock instead of waiting for ever."""
    path = tmp_path / "f0"
    path.write_bytes(b"x")
    owner = FilesOf([path])
    shared = datasets._SHARED_DESCRIPTORS  # the process's, which datasets use
    view = _DatasetDescriptors(owner, shared)
    holding, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with shared._changed:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    holding.wait(10)
    child = os.fork()
    if child == 0:  # the child: exit status 0 if it could read, killed after 10 s if not
        signal.alarm(10)
        with view.pinned([(0, False)]) as opened:
            os._exit(0 if os.pread(opened[(0, False)][0], 1, 0) == b"x" else 1)
    release.set()
    holder.join()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    view.close_all()


def test_a_dataset_collected_without_close_has_its_descriptors_closed(tmp_path):
    """The shared descriptors refer to a dataset weakly: they neither keep it alive nor
    keep its files open once it is collected."""
    path = tmp_path / "f0"
    path.write_bytes(b"x")
    owner = FilesOf([path])
    shared, (view,) = shared_descriptors([owner], 4)
    with view.pinned([(0, False)]) as opened:
        fd = opened[(0, False)][0]
    collected = weakref.ref(owner)
    del owner
    gc.collect()
    assert collected() is None
    assert not view.held and not shared.held  # closed once the lock is next taken
    link = Path(f"/proc/self/fd/{fd}")  # closed, or its number reused by another file
    assert not link.exists() or link.resolve() != path.resolve()


def directory_of_samples(comm, root, count: int):
    """Collective: ``root`` made by rank 0 with ``count`` files of 64 bytes
    (:func:`sample_bytes`); returns it."""
    if comm.Get_rank() == 0:
        root.mkdir()
        for i in range(count):
            (root / f"f{i:03d}").write_bytes(sample_bytes(i, 64))
    comm.Barrier()
    return root


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["aggregated", "direct"])
def test_a_directory_of_more_files_than_descriptors_is_read(comm, shared_tmp, mode, monkeypatch):
    """Before, every file read stayed open until close: EMFILE once the files outnumbered
    RLIMIT_NOFILE."""
    monkeypatch.setattr(datasets, "MAX_OPEN_FILES", 32)  # the limit it may raise is lower
    count = 300
    root = directory_of_samples(comm, shared_tmp / "many", count)
    expected = [sample_bytes(i, 64) for i in range(count)]
    config = config_for(comm, shared_tmp, **MODES[mode])
    allowed = len(os.listdir("/proc/self/fd")) + 64  # far fewer than the files
    with (
        soft_limit(resource.RLIMIT_NOFILE, allowed),
        bbio.open_dataset(comm, root, config=config) as ds,
    ):
        assert [g.tobytes() for g in ds.read(np.arange(count))] == expected
        with bbio.Loader(comm, ds, batch_size=40, seed=0, prefetch=2) as loader:
            for batch in loader:
                assert [b.tobytes() for b in batch] == [expected[i] for i in loader.indices]
        assert len(ds._descriptors.held) <= ds._descriptors.limit == 32


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_two_directory_datasets_open_at_once_stay_within_the_limit(comm, shared_tmp, monkeypatch):
    """Two datasets of 100 files each under a soft limit that holds one budget (16 files)
    and not two.  Before, each kept 16 open, and the second failed with EMFILE."""
    roots = [directory_of_samples(comm, shared_tmp / name, 100) for name in ("train", "val")]
    config = config_for(comm, shared_tmp, **MODES["direct"])
    in_use = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(datasets, "MAX_OPEN_FILES", 16)
    monkeypatch.setattr(datasets, "RESERVED_FILES", in_use + 8)  # the job's, and a few more
    allowed = in_use + 24  # the budget and the reserve: no raise
    ids = np.arange(100)
    expected = [sample_bytes(i, 64) for i in ids]
    with (
        soft_limit(resource.RLIMIT_NOFILE, allowed),
        bbio.open_dataset(comm, roots[0], config=config) as train,
        bbio.open_dataset(comm, roots[1], config=config) as val,
    ):
        assert train._descriptors.limit == 16
        for _ in range(2):
            for ds in (train, val):
                assert [g.tobytes() for g in ds.read(ids)] == expected
        assert len(train._descriptors.held) + len(val._descriptors.held) <= 16


# ------------------------------------------------------------ memory


def address_space_in_use() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)  # before the fix the other ranks hung
@pytest.mark.parametrize("short", ["aggregator", "reader"])
def test_a_rank_that_cannot_allocate_its_read_is_one_error_everywhere(comm, shared_tmp, short):
    """One node, so rank 0 alone aggregates; the last rank asks for 512 MiB of a sparse
    file.  The aggregator's buffer, or the reader's samples, cannot be allocated."""
    path, record = shared_tmp / "sparse.raw", 1 << 20
    if comm.Get_rank() == 0:
        with open(path, "wb") as f:
            f.truncate(1024 * record)  # sparse
    comm.Barrier()
    config = dataclasses.replace(
        config_for(comm, shared_tmp, **MODES["aggregated"]), ranks_per_node=comm.Get_size()
    )
    short_rank = 0 if short == "aggregator" else comm.Get_size() - 1
    ids = np.arange(512) if last_rank(comm) else []
    with bbio.open_dataset(comm, path, record_bytes=record, config=config) as ds:
        headroom = address_space_in_use() + (128 << 20)
        with pytest.raises(MemoryError) as info:  # bbio.errors.OutOfMemoryError, everywhere
            if comm.Get_rank() == short_rank:
                with soft_limit(resource.RLIMIT_AS, headroom):
                    ds.read(ids)
            else:
                ds.read(ids)
        assert isinstance(info.value, bbio.BBIOError)
        message = same_everywhere(comm, info.value)
        what = "the aggregator's read buffer" if short == "aggregator" else "the 512 samples"
        assert f"rank {short_rank}, node 0: cannot allocate 536870912 bytes" in message
        assert what in message and "smaller batch_size" in message, message
        assert ds.read([1] if last_rank(comm) else []).shape[1:] == (record,)  # still in step


# ------------------------------------------------------------ many samples


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_raw_file_of_more_samples_than_one_message_describes_is_read(comm, shared_tmp):
    """2**27 one-byte records: their extent table (20 bytes each) was 2.7 GB on every rank,
    and broadcasting it was refused by MPI; fixed-size extents are now computed."""
    path, count = shared_tmp / "many.raw", 2**27
    marks = {0: 7, 12_345_678: 9, count - 1: 11}
    if comm.Get_rank() == 0:
        with open(path, "wb") as f:
            f.truncate(count)  # sparse
            for at, value in marks.items():
                f.seek(at)
                f.write(bytes([value]))
    comm.Barrier()
    config = config_for(comm, shared_tmp)
    with bbio.open_dataset(comm, path, record_bytes=1, config=config) as ds:
        assert len(ds) == count
        assert len(pickle.dumps(ds.layout)) < 2048
        assert ds.read(list(marks)).ravel().tolist() == list(marks.values())


@pytest.mark.mpi(min_size=2)
def test_an_hdf5_dataset_is_shared_in_a_few_bytes_whatever_its_length(comm, shared_tmp):
    path = shared_tmp / "long.h5"
    if comm.Get_rank() == 0:
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.arange(200_000, dtype=np.int32))
    comm.Barrier()
    with bbio.open_dataset(comm, path, config=config_for(comm, shared_tmp)) as ds:
        assert len(pickle.dumps(ds.layout)) < 2048
        assert ds.read([199_999, 3]).tolist() == [199_999, 3]


@pytest.mark.mpi(min_size=2)
def test_a_pack_too_large_to_share_at_open_is_one_usage_error(comm, shared_tmp, monkeypatch):
    """Its offsets and sizes travel in one MPI message; here one of at most 1,000 bytes."""
    monkeypatch.setattr(bbio.read.datasets, "MAX_MESSAGE_BYTES", 1000)
    root = shared_tmp / "pfs"
    if comm.Get_rank() == 0:
        (root / "src").mkdir(parents=True)
        for i in range(80):
            (root / "src" / f"s{i:02d}").write_bytes(sample_bytes(i, 10))
    comm.Barrier()
    config = config_for(comm, shared_tmp)
    bbio.pack(comm, root / "src", root / "packed", config=config)
    with pytest.raises(bbio.UsageError) as info:
        bbio.open_dataset(comm, root / "packed", config=config).close()
    message = same_everywhere(comm, info.value)
    assert "the pack's 80 samples are too many to share at open" in message, message
    assert "several packs" in message, message


# ------------------------------------------------------------ open descriptors, again
# (last: its reads leave the address space larger, which the memory tests measure)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_directory_of_hundreds_of_files_opens_each_once(comm, shared_tmp):
    """Before, a quarter of a soft RLIMIT_NOFILE of 1,024 (256 files) was kept open: a
    directory of 500 files reopened files every step, a metadata round trip each."""
    root = directory_of_samples(comm, shared_tmp / "hundreds", 500)
    config = config_for(comm, shared_tmp, **MODES["direct"])  # each rank reads hundreds
    with (
        soft_limit(resource.RLIMIT_NOFILE, 1024),
        bbio.open_dataset(comm, root, config=config) as ds,
    ):
        opened: list = []
        open_file = ds._descriptors.open_file

        def counted(f: int, direct: bool) -> tuple[int, bool]:
            opened.append((f, direct))
            return open_file(f, direct)

        ds._descriptors.open_file = counted
        with bbio.Loader(comm, ds, batch_size=25, seed=0, epochs=4) as loader:
            for batch in loader:
                assert [b.tobytes() for b in batch] == [sample_bytes(i, 64) for i in loader.indices]
        assert opened and len(opened) == len(set(opened)), (len(opened), len(set(opened)))
