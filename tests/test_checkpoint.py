"""Checkpoints on 2 or 4 ranks in 2 virtual nodes: real parallel HDF5, real drain processes."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import crc32c
import h5py
import numpy as np
import pytest

import bbio
from bbio.checkpoint import admin, drain, layout
from bbio.checkpoint import restore as reader
from bbio.config import Config
from bbio.demo.__main__ import processes_running

pytestmark = pytest.mark.mpi(min_size=2)


def config_for(comm, tmp: Path, **settings) -> Config:
    values = {
        "bb_root": str(tmp / "bb" / "{node}"),
        "pfs_root": str(tmp / "pfs"),
        "ranks_per_node": comm.Get_size() // 2,
        "progress": "never",
        **settings,
    }
    return Config(**values)


def state(step: int, rank: int, rows: int = 100) -> dict:
    rng = np.random.default_rng(step * 100 + rank)
    return {
        "model/w": rng.standard_normal((rows, 8)).astype(np.float32),
        "model/b": rng.integers(0, 1 << 30, 17).astype(np.int64),
        "optimizer/step": np.int64(step),
        "rng_state": np.frombuffer(rng.bytes(32), dtype=np.uint8).copy(),
        "empty": np.zeros((0, 3), dtype=np.float64),
    }


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes()
        and np.asarray(a[k]).shape == np.asarray(b[k]).shape
        for k in a
    )


def leader(comm) -> bool:
    return comm.Get_rank() % (comm.Get_size() // 2) == 0


def node_of(comm) -> int:
    return comm.Get_rank() // (comm.Get_size() // 2)


def test_save_drain_commit_and_restore_per_rank_state(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "run", keep_bb=2, keep_pfs=2, config=config) as ckpt:
        for step in (10, 20, 30):
            handle = ckpt.save(step, state(step, rank), attrs={"lr": step / 100})
            assert isinstance(handle, bbio.SaveHandle) and not handle.skipped
        handle.wait(timeout=60)
        assert handle.done()
        ckpt_states = {i.step: i for i in ckpt.list()}
        step, arrays, attrs = ckpt.restore()
        assert step == 30 and attrs == {"lr": 0.3}
        assert same(arrays, state(30, rank))
        step, arrays, _ = ckpt.restore(step=20)
        assert step == 20 and same(arrays, state(20, rank))
    pfs = shared_tmp / "pfs" / "ckpt" / "run"
    assert drain.committed_steps(pfs) == [20, 30]  # keep_pfs
    for node in range(2):  # keep_bb: the drains trimmed step 10 once it was committed
        bb = shared_tmp / "bb" / str(node) / "ckpt" / "run"
        kept = sorted((p.name, sorted(c.name for c in p.iterdir())) for p in bb.glob("step-*"))
        assert [name for name, _ in kept] == ["step-00000020", "step-00000030"], kept
    assert ckpt_states[30].pfs == "committed" and ckpt_states[30].bb == "all nodes"
    manifest = json.loads((pfs / "step-00000030" / "manifest.json").read_text())
    assert manifest["ranks"] == comm.Get_size() and manifest["nodes"] == 2
    assert manifest["layout"] == layout.PER_RANK
    assert {f["path"] for f in manifest["files"]} == {"node-00000.h5", "node-00001.h5", "global.h5"}
    with h5py.File(pfs / "step-00000030" / "global.h5", "r") as f:  # plain h5py, no bbio
        assert np.array_equal(f[f"model/w/r{rank:05d}"][:], state(30, rank)["model/w"])
        assert int(f[f"optimizer/step/r{rank:05d}"][()]) == 30


def test_node_files_are_plain_hdf5_with_each_arrays_crc(comm, shared_tmp):
    rank = comm.Get_rank()
    arrays = {
        "big_endian": np.arange(1000, dtype=">f8") * rank,
        "flags": np.arange(13) % (rank + 2) == 0,
        "complex": np.full((3, 5), 1 + 2j * rank, dtype=np.complex64),
        "names": np.array([b"alpha", f"rank{rank}".encode()], dtype="S8"),
        "scalar": np.int16(-rank),
        "big_endian_scalar": np.array(7 + rank, dtype=">i8"),
        "padded_bytes_scalar": np.array(b"ab", dtype="S4"),  # read as b"ab" by [()]
        "empty": np.zeros(0, dtype=np.uint32),
    }
    with bbio.Checkpointer(comm, "plain", config=config_for(comm, shared_tmp)) as ckpt:
        ckpt.save(7, arrays).wait(timeout=60)
        _, restored, _ = ckpt.restore()  # each dataset's CRC32C over the bytes saved
        assert same(restored, arrays)
        assert {k: v.dtype for k, v in restored.items()} == {
            k: np.asarray(v).dtype for k, v in arrays.items()
        }
    node_file = (
        shared_tmp / "bb" / str(node_of(comm)) / "ckpt" / "plain" / layout.step_dirname(7)
    ) / layout.node_filename(node_of(comm))
    with h5py.File(node_file, "r") as f:  # plain h5py, no MPI, no bbio
        crcs = json.loads(f.attrs["crc32c"])
        for key, value in arrays.items():
            name = layout.rank_dataset(key, rank)
            stored = f[name][...]
            assert stored.dtype == value.dtype and stored.shape == np.shape(value), key
            assert np.array_equal(stored, value), key
            raw = np.ascontiguousarray(value).tobytes()
            assert crcs[name] == crc32c.crc32c(raw), key


def test_global_arrays_restore_any_slice_with_fewer_ranks(comm, shared_tmp):
    config = config_for(comm, shared_tmp, ckpt_verify="device")  # the cold read-back too
    size, rank = comm.Get_size(), comm.Get_rank()
    full = np.arange(size * 6 * 5, dtype=np.float64).reshape(size * 6, 5)
    mine = {"weights": bbio.Shard(full[rank * 6 : (rank + 1) * 6], (rank * 6, 0), full.shape)}
    with bbio.Checkpointer(comm, "g", config=config) as ckpt:
        ckpt.save(1, mine).wait(timeout=60)
        _, back, _ = ckpt.restore()
        assert np.array_equal(back["weights"], full[rank * 6 : (rank + 1) * 6])
    half = comm.Split(0 if rank < size // 2 else 1, rank)  # a restart with half the ranks
    if rank < size // 2:
        small = config_for(half, shared_tmp, ranks_per_node=1)
        with bbio.Checkpointer(half, "g", config=small) as again:
            box = ((rank * 5 + 1, 2), (7, 3))
            step, back, _ = again.restore(want={"weights": box})
            assert step == 1
            assert np.array_equal(back["weights"], full[rank * 5 + 1 : rank * 5 + 8, 2:5])
            with pytest.raises(bbio.UsageError, match=rf"checkpoint 1 was saved by {size} ranks"):
                again.restore()  # per-rank defaults need the same rank count
    half.Free()
    if rank == 0 and shutil.which("h5dump"):  # the global view needs neither bbio nor h5py
        dumped = subprocess.run(
            ["h5dump", "-d", "weights", str(shared_tmp / "pfs/ckpt/g/step-00000001/global.h5")],
            capture_output=True,
            text=True,
            cwd="/",
        )
        assert dumped.returncode == 0, dumped.stderr
        last_row = f"({size * 6 - 1},0): " + ", ".join(f"{v:g}" for v in full[-1])
        assert last_row in dumped.stdout


def test_a_corrupt_burst_buffer_copy_is_skipped_for_the_pfs_copy(comm, shared_tmp, caplog):
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "c", config=config) as ckpt:
        ckpt.save(5, state(5, rank, rows=20000)).wait(timeout=60)
        victim = shared_tmp / "bb" / "1" / "ckpt" / "c" / "step-00000005" / "node-00001.h5"
        comm.Barrier()
        if rank == 0:
            size = victim.stat().st_size
            with open(victim, "r+b") as f:  # one byte, in the data of the arrays
                f.seek(size - 5000)
                byte = f.read(1)
                f.seek(size - 5000)
                f.write(bytes([byte[0] ^ 0x01]))
        comm.Barrier()
        with caplog.at_level(logging.WARNING, logger="bbio"):
            step, arrays, _ = ckpt.restore()
        assert step == 5 and same(arrays, state(5, rank, rows=20000))
        if rank == 0:
            assert "(bb) skipped" in caplog.text and "node-00001.h5" in caplog.text
            assert "restored step 5 from its PFS copy instead" in caplog.text
        # the HDF5 signature zeroed: the warning still names the file (before: only
        # h5py's "file signature not found")
        ckpt.save(6, state(6, rank, rows=20000)).wait(timeout=60)
        comm.Barrier()
        if rank == 0:
            with open(str(victim).replace("00000005", "00000006"), "r+b") as f:
                f.write(bytes(8))
        comm.Barrier()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bbio"):
            step, arrays, _ = ckpt.restore()
        assert step == 6 and same(arrays, state(6, rank, rows=20000))
        if rank == 0:
            assert "step 6 (bb) skipped" in caplog.text
            assert "step-00000006/node-00001.h5" in caplog.text


def test_a_partial_checkpoint_is_never_restored(comm, shared_tmp):
    """What a rank killed during save leaves: a node file without its record, no manifest."""
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "p", config=config) as ckpt:
        ckpt.save(1, state(1, rank)).wait(timeout=60)
        comm.Barrier()
        if rank == 0:  # node 1 died while writing step 2: only a temporary file on its BB
            step2 = shared_tmp / "bb" / "1" / "ckpt" / "p" / "step-00000002"
            step2.mkdir()
            (step2 / ".node-00001.h5.bbio-part").write_bytes(b"half written")
            step2_0 = shared_tmp / "bb" / "0" / "ckpt" / "p" / "step-00000002"
            step2_0.mkdir()
            (step2_0 / "node-00000.h5").write_bytes(b"complete on node 0 only, no record")
        comm.Barrier()
        step, arrays, _ = ckpt.restore()
        assert step == 1 and same(arrays, state(1, rank))


class _DeviceState(Mapping):
    """Arrays produced on each read, as from a device; counts the reads of each key and,
    given ``lost_on_read``, fails that read of every key."""

    def __init__(self, arrays: dict, lost_on_read: int | None = None) -> None:
        self.arrays, self.lost_on_read = arrays, lost_on_read
        self.reads: collections.Counter = collections.Counter()

    def __getitem__(self, key):
        self.reads[key] += 1
        if self.reads[key] == self.lost_on_read:
            raise RuntimeError(f"device lost while copying {key}")
        return self.arrays[key]

    def __iter__(self):
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)


def failed_save(comm, ckpt, step: int, last_read: int) -> str:
    """Collective: save ``step`` with the last rank's state failing on its ``last_read``-th
    read of each key; the error, checked to be the same on every rank."""
    rank, victim = comm.Get_rank(), comm.Get_size() - 1
    arrays = state(step, rank)
    with pytest.raises(bbio.BBIOError) as info:
        ckpt.save(step, _DeviceState(arrays, last_read) if rank == victim else arrays)
    message = str(info.value)
    assert comm.allgather(message) == [message] * comm.Get_size()
    assert "device lost while copying" in message, message
    return message


def test_a_rank_failing_while_writing_fails_the_save_on_every_rank(comm, shared_tmp):
    """One rank's state fails as its bytes are written (its last read in a save): no hang,
    the same error on every rank, nothing committed, and the next save works."""
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "w", config=config) as ckpt:
        counted = _DeviceState(state(1, rank))
        ckpt.save(1, counted).wait(timeout=60)
        message = failed_save(comm, ckpt, 2, max(counted.reads.values()))
        assert "node-00001.h5" in message, message
        for node in ("0", "1"):  # withdrawn: no file, temporary file or record is left
            assert not (shared_tmp / "bb" / node / "ckpt" / "w" / "step-00000002").exists()
        ckpt.save(3, state(3, rank)).wait(timeout=60)
        step, restored, _ = ckpt.restore()
        assert step == 3 and same(restored, state(3, rank))
        assert 2 not in [info.step for info in ckpt.list()]


def test_backpressure_skip_and_block(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    big = {"x": np.ones(4 << 20, dtype=np.uint8)}
    with bbio.Checkpointer(comm, "s", backpressure="skip", config=config) as ckpt:
        first = ckpt.save(1, big)
        second = ckpt.save(2, big)  # the first is (almost surely) still draining
        first.wait(timeout=60)
        if second.skipped:
            assert second.done()
        else:
            second.wait(timeout=60)
        assert comm.allgather(second.skipped) == [second.skipped] * comm.Get_size()
    with bbio.Checkpointer(comm, "b", backpressure="block", config=config) as ckpt:
        ckpt.save(1, big)
        ckpt.save(2, big)  # waits for step 1 to drain first
        assert (shared_tmp / "pfs" / "ckpt" / "b" / "step-00000001" / "manifest.json").exists()


def stop_idle_drains(comm, ckpt) -> list[int]:
    """Collective: stop (SIGSTOP) every node's drain once its queue is empty, and never
    while it holds the records' lock, which a save takes; their pids."""
    if leader(comm):
        deadline = time.monotonic() + 60
        while drain.pending(ckpt.journal) and time.monotonic() < deadline:
            time.sleep(0.01)  # a wait returns once the commit is told, before the task goes
        with drain.records_locked(ckpt.journal):
            os.kill(ckpt._drain.pid, signal.SIGSTOP)
    comm.Barrier()
    return [pid for pid in comm.allgather(ckpt._drain.pid if leader(comm) else None) if pid]


def test_a_restore_lists_again_when_retention_removes_the_step_it_reads(
    comm, shared_tmp, monkeypatch
):
    """keep_pfs=1: step 2 is committed, and step 1 retired, while a restore verifies
    step 1.  Before, the restore raised NotFoundError although step 2 was committed."""
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    step_1 = shared_tmp / "pfs" / "ckpt" / "race" / layout.step_dirname(1)
    verify_file = reader.verify_file

    def once_step_1_is_retired(*args):
        for pid in drains:  # the drains commit step 2 now, and retire step 1
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while step_1.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        verify_file(*args)

    with bbio.Checkpointer(comm, "race", keep_pfs=1, config=config) as ckpt:
        ckpt.save(1, state(1, rank)).wait(timeout=60)
        drains = stop_idle_drains(comm, ckpt)
        try:
            ckpt.save(2, state(2, rank))  # queued: only in the burst buffers when listed
            monkeypatch.setattr(reader, "verify_file", once_step_1_is_retired)
            step, arrays, _ = ckpt.restore(from_rank=rank)  # reads the PFS copies
        finally:
            for pid in drains:
                os.kill(pid, signal.SIGCONT)
        assert step == 2 and same(arrays, state(2, rank)) and not step_1.exists()


def test_a_resave_is_refused_also_when_the_save_would_be_skipped(comm, shared_tmp):
    """Before, ``backpressure="skip"`` skipped such a save while earlier ones drained
    instead of raising the UsageError a queued save raises."""
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "sk", backpressure="skip", config=config) as ckpt:
        ckpt.save(1, state(1, rank)).wait(timeout=60)
        drains = stop_idle_drains(comm, ckpt)  # step 2 stays queued: later saves are skipped
        try:
            assert not ckpt.save(2, state(2, rank)).skipped  # nothing was draining
            refused_resave(comm, ckpt, 2, "in every node's burst buffer")
            assert ckpt.save(3, state(3, rank)).skipped
        finally:
            for pid in drains:
                os.kill(pid, signal.SIGCONT)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting small file systems needs root")
def test_full_burst_buffer_writes_straight_to_the_pfs(comm, shared_tmp, caplog):
    small = shared_tmp / "tinybb"
    if comm.Get_rank() == 0:
        small.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    comm.Barrier()
    try:
        config = config_for(comm, shared_tmp, bb_root=str(small / "{node}"))
        pfs_step = shared_tmp / "pfs" / "ckpt" / "f" / "step-00000001"
        # A drain of an earlier save of step 1 copying meanwhile: the direct save never
        # writes under the drain's temporary name (before, both wrote the same file).
        drains_temp = pfs_step / ".node-00000.h5.bbio-part"
        if comm.Get_rank() == 0:
            pfs_step.mkdir(parents=True)
            drains_temp.write_bytes(b"an old save's bytes")
        comm.Barrier()
        with bbio.Checkpointer(comm, "f", config=config) as ckpt:
            with caplog.at_level(logging.WARNING, logger="bbio"):
                handle = ckpt.save(1, state(1, comm.Get_rank(), rows=100_000))
            assert handle.direct and handle.done()
            assert drains_temp.read_bytes() == b"an old save's bytes"
            assert sorted(p.name for p in pfs_step.iterdir() if p.name.startswith(".node")) == [
                drains_temp.name
            ]  # the save's own temporary file was renamed
            if comm.Get_rank() == 0:
                assert "cannot hold it" in caplog.text and "straight to the PFS" in caplog.text
            step, arrays, _ = ckpt.restore()
            assert step == 1 and same(arrays, state(1, comm.Get_rank(), rows=100_000))
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", "--lazy", str(small)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only mount needs root")
def test_unwritable_pfs_save_succeeds_drain_retries_wait_times_out(comm, shared_tmp):
    pfs = shared_tmp / "ropfs"
    if comm.Get_rank() == 0:
        pfs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64m", "tmpfs", str(pfs)], check=True)
    comm.Barrier()
    try:
        config = config_for(comm, shared_tmp, pfs_root=str(pfs))
        with bbio.Checkpointer(comm, "ro", config=config) as ckpt:
            handle = ckpt.save(7, state(7, comm.Get_rank()))
            deadline = time.monotonic() + 60  # the drain starts and fails once (slow machines)
            while "Read-only" not in str(drain.read_status(handle.journal).get("error")):
                assert time.monotonic() < deadline, drain.read_status(handle.journal)
                time.sleep(0.05)
            with pytest.raises(bbio.BBIOTimeoutError) as info:
                handle.wait(timeout=3)
            assert "not committed on the PFS after 3 s" in str(info.value)
            assert "Read-only file system" in str(info.value)
            only_bb = r"step 7 \(bb\): only in the burst buffers; want= and from_rank= read"
            with pytest.raises(bbio.NotFoundError, match=only_bb):
                ckpt.restore(from_rank=comm.Get_rank())  # a resharded restore reads the PFS
            comm.Barrier()
            if comm.Get_rank() == 0:
                subprocess.run(["mount", "-o", "remount,rw", str(pfs)], check=True)
            comm.Barrier()
            handle.wait(timeout=60)  # the drain's retries get through
            step, arrays, _ = ckpt.restore()
            assert step == 7 and same(arrays, state(7, comm.Get_rank()))
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", "--lazy", str(pfs)], check=True)


def test_close_timeout_of_one_rank_raises_the_same_timeout_error_on_every_rank(comm, shared_tmp):
    pfs = shared_tmp / "pfs" / "ckpt" / "late"
    if comm.Get_rank() == 0:  # a file where step 7's directory goes: the drains retry
        pfs.mkdir(parents=True)
        (pfs / layout.step_dirname(7)).write_bytes(b"in the way")
    comm.Barrier()
    ckpt = bbio.Checkpointer(comm, "late", config=config_for(comm, shared_tmp))
    ckpt.save(7, state(7, comm.Get_rank()))
    started = time.monotonic()
    with pytest.raises(bbio.BBIOTimeoutError) as info:  # before, a TypeError where None
        ckpt.close(timeout=1.5 if comm.Get_rank() == 0 else None)
    assert time.monotonic() - started < 30
    assert "still draining after 1.5 s" in str(info.value)
    assert comm.allgather(str(info.value)) == [str(info.value)] * comm.Get_size()
    if comm.Get_rank() == 0:  # the drains, left to finish on their own, get through
        (pfs / layout.step_dirname(7)).unlink()
    journal = shared_tmp / "bb" / str(node_of(comm)) / "ckpt" / "late" / ".journal"
    deadline = time.monotonic() + 60
    while drain.committed_steps(pfs) != [7] or drain.is_draining(journal):
        assert time.monotonic() < deadline, drain.read_status(journal)
        time.sleep(0.1)


def test_drain_killed_mid_copy_is_finished_by_the_epilog(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    big = {"x": np.full(96 << 20, rank, dtype=np.uint8)}  # 96 MiB per rank
    ckpt = bbio.Checkpointer(comm, "k", config=config)
    ckpt.save(3, big)
    journal = shared_tmp / "bb" / str(node_of(comm)) / "ckpt" / "k" / ".journal"
    killed = False
    if leader(comm):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = drain.read_status(journal)
            if status.get("state") == "copying" and drain.pending(journal):
                os.kill(status["pid"], signal.SIGKILL)
                killed = True
                break
            time.sleep(0.002)
    assert comm.allreduce(killed) >= 1, "no drain was caught copying"
    if leader(comm) and not killed:  # it finished first: idle, it would hold the journal
        with contextlib.suppress(ProcessLookupError):
            os.kill(drain.read_status(journal)["pid"], signal.SIGKILL)
    comm.Barrier()
    if leader(comm):  # the Slurm epilog of each node
        assert admin.finish(shared_tmp / "bb" / str(node_of(comm)), timeout=60).failed == []
    comm.Barrier()
    pfs = shared_tmp / "pfs" / "ckpt" / "k"
    assert drain.committed_steps(pfs) == [3]
    assert not list(pfs.rglob("*bbio-part"))
    step, arrays, _ = ckpt.restore()
    assert step == 3 and np.array_equal(arrays["x"], big["x"])
    ckpt.close()
    if rank == 0:
        assert admin.verify(shared_tmp / "bb" / "0", shared_tmp / "pfs", name="k") == 4


def refused_resave(comm, ckpt, step: int, where: str) -> None:
    """``ckpt.save(step)`` without ``replace`` raises the same UsageError on every rank,
    naming where the step's complete copy is."""
    with pytest.raises(bbio.UsageError) as info:
        ckpt.save(step, state(99, comm.Get_rank()))
    message = str(info.value)
    assert comm.allgather(message) == [message] * comm.Get_size()
    assert f"step {step} is already saved ({where})" in message and "replace=True" in message


def test_resaving_a_step_replaces_it(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "again", config=config) as ckpt:
        ckpt.save(4, state(4, rank)).wait(timeout=60)
        refused_resave(comm, ckpt, 4, "in every node's burst buffer")
        step, arrays, _ = ckpt.restore()  # the refused save dropped nothing
        assert step == 4 and same(arrays, state(4, rank)) and ckpt.last_restore_tier == "bb"
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(4, state(40, rank), replace="yes")
        assert "replace must be True or False, not 'yes'" in str(info.value)
        ckpt.save(4, state(40, rank), replace=np.bool_(True)).wait(timeout=60)
        step, arrays, _ = ckpt.restore()
        assert step == 4 and same(arrays, state(40, rank))
        comm.Barrier()
        if (
            rank == 0
        ):  # the burst buffers go away (new allocation): the PFS copy must be the new one
            for node in (0, 1):
                for f in (shared_tmp / "bb" / str(node) / "ckpt" / "again").glob("step-*/*"):
                    f.unlink()
        comm.Barrier()
        step, arrays, _ = ckpt.restore()
        assert step == 4 and same(arrays, state(40, rank))


def test_a_new_job_saving_a_committed_step_again_replaces_it(comm, shared_tmp):
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "rerun", config=config_for(comm, shared_tmp)) as ckpt:
        ckpt.save(4, state(4, rank)).wait(timeout=60)
    pfs_step = shared_tmp / "pfs" / "ckpt" / "rerun" / "step-00000004"
    first = json.loads((pfs_step / "manifest.json").read_text())
    # the next job runs on other nodes: fresh burst buffers, the same PFS
    fresh = config_for(comm, shared_tmp, bb_root=str(shared_tmp / "bb2" / "{node}"))
    with bbio.Checkpointer(comm, "rerun", config=fresh) as ckpt:
        refused_resave(comm, ckpt, 4, "committed on the PFS")
        assert json.loads((pfs_step / "manifest.json").read_text()) == first
        ckpt.save(4, state(40, rank), replace=True).wait(timeout=60)
        step, arrays, _ = ckpt.restore()
        assert step == 4 and same(arrays, state(40, rank))
        assert ckpt.last_restore_tier == "bb"
    manifest = json.loads((pfs_step / "manifest.json").read_text())
    assert manifest["time"] > first["time"]
    third = config_for(comm, shared_tmp, bb_root=str(shared_tmp / "bb3" / "{node}"))
    with bbio.Checkpointer(comm, "rerun", config=third) as ckpt:  # no BB copy: the PFS one
        step, arrays, _ = ckpt.restore()
        assert step == 4 and same(arrays, state(40, rank)) and ckpt.last_restore_tier == "pfs"


def test_a_step_with_no_complete_copy_is_saved_again_without_replace(comm, shared_tmp):
    """A step whose save never committed and whose burst-buffer copies are gone (a job
    killed while draining it, on nodes since given up) has no copy to lose: saved
    again as any new step."""
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "lost", config=config_for(comm, shared_tmp)) as ckpt:
        ckpt.save(4, state(4, rank)).wait(timeout=60)
    pfs_step = shared_tmp / "pfs" / "ckpt" / "lost" / "step-00000004"
    if rank == 0:
        (pfs_step / "manifest.json").unlink()  # the node files stay: never committed
    comm.Barrier()
    fresh = config_for(comm, shared_tmp, bb_root=str(shared_tmp / "bb2" / "{node}"))
    with bbio.Checkpointer(comm, "lost", config=fresh) as ckpt:
        ckpt.save(4, state(40, rank)).wait(timeout=60)
        step, arrays, _ = ckpt.restore()
        assert step == 4 and same(arrays, state(40, rank))


def test_virtual_nodes_sharing_one_burst_buffer_are_refused(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    with pytest.raises(bbio.ConfigError, match="virtual nodes") as info:
        bbio.Checkpointer(comm, "shared", bb_root=shared_tmp / "one-bb", config=config)
    assert comm.allgather(str(info.value)) == [str(info.value)] * comm.Get_size()


def test_bad_state_is_the_same_clear_error_everywhere(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "bad", config=config) as ckpt:
        for bad in (
            np.array(["not", "storable"]),
            np.zeros(2, dtype=[("step", "i8"), ("loss", "f4")]),
        ):
            arrays = {"ok": np.zeros(3)}
            if comm.Get_rank() == 1:
                arrays = {"bad": bad}
            with pytest.raises(bbio.UsageError) as info:
                ckpt.save(1, arrays)
            assert "cannot store" in str(info.value) and str(bad.dtype) in str(info.value)
            assert comm.allgather(str(info.value)) == [str(info.value)] * comm.Get_size()
            comm.Barrier()  # no burst buffer keeps a directory made for the refused save
            assert not list((shared_tmp / "bb").glob("*/ckpt/bad/step-*"))
            comm.Barrier()  # every rank looked before the next save
        with pytest.raises(bbio.UsageError) as info:  # the same state, attrs of its own
            ckpt.save(2, {"ok": np.zeros(3)}, attrs={"loss": 1.0 / (1 + comm.Get_rank())})
        assert "disagree on the attrs" in str(info.value)
        assert comm.allgather(str(info.value)) == [str(info.value)] * comm.Get_size()
        with pytest.raises(bbio.NotFoundError, match="no complete checkpoint"):
            ckpt.restore()


@pytest.mark.timeout(150)
def test_damaged_metadata_of_an_undrained_copy_is_caught_at_restore_and_by_its_drain(
    comm, shared_tmp, caplog
):
    """One changed byte in the HDF5 metadata of a burst-buffer copy not drained yet (its
    user attrs).  Before, only the arrays' CRC32Cs were checked until the drain had
    copied the file: restore returned the changed attrs without a warning, and the
    drain committed the copy.  Now the node file's CRC32C is recorded at save."""
    config = config_for(comm, shared_tmp)
    rank = comm.Get_rank()
    ckpt = bbio.Checkpointer(comm, "meta", config=config)
    ckpt.save(0, state(0, rank), attrs={"lr": 0.125}).wait(timeout=60)
    save_step_1_then_kill_its_drains(comm, shared_tmp, ckpt, attrs={"lr": 0.125})
    bb_root = shared_tmp / "bb" / str(node_of(comm))
    step_dir = bb_root / "ckpt" / "meta" / layout.step_dirname(1)
    node_file = step_dir / layout.node_filename(node_of(comm))
    if leader(comm):
        record = json.loads((step_dir / layout.node_record_name(node_of(comm))).read_text())
        assert (record["size"], record["file_crc32c"]) == file_checksum(node_file)
        if node_of(comm) == 1:
            image = node_file.read_bytes()
            assert image.count(b"0.125") == 1
            node_file.write_bytes(image.replace(b"0.125", b"0.625"))
    comm.Barrier()
    with caplog.at_level(logging.WARNING, logger="bbio"):
        step, arrays, attrs = ckpt.restore()
    assert (step, attrs) == (0, {"lr": 0.125}) and same(arrays, state(0, rank))
    if rank == 0:
        assert "step 1 (bb) skipped" in caplog.text
        assert "step-00000001/node-00001.h5" in caplog.text and "CRC32C" in caplog.text
    if leader(comm):
        damaged = node_of(comm) == 1
        if damaged:
            with pytest.raises(bbio.IntegrityError, match=r"step-00000001/node-00001\.h5"):
                admin.verify(bb_root, shared_tmp / "pfs", node=1)
        journal = drain.journal_dir(bb_root / "ckpt" / "meta")
        assert drain.run(journal, None, finish=True, timeout=60) == (1 if damaged else 0)
    comm.Barrier()
    assert drain.committed_steps(shared_tmp / "pfs" / "ckpt" / "meta") == [0]
    ckpt.close(timeout=60)
    # set aside: passed over with a warning that says so, also by a job of another layout
    # of ranks whose nodes hold the whole save (before, that one raised: "drain it first")
    layouts = [comm.Get_size() // 2] + ([1] if comm.Get_size() == 4 else [])
    for per_node in layouts:
        config = config_for(comm, shared_tmp, ranks_per_node=per_node)
        with bbio.Checkpointer(comm, "meta", config=config) as again:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="bbio"):
                step, arrays, attrs = again.restore()
            assert (step, attrs) == (0, {"lr": 0.125}) and same(arrays, state(0, rank))
            if rank == 0:
                assert "step 1 skipped: its drain set it aside" in caplog.text, caplog.text


@pytest.mark.timeout(150)
def test_a_newest_step_only_in_burst_buffers_of_another_layout_is_not_passed_over(
    comm, shared_tmp, caplog
):
    """Job A saves step 0 (committed) and step 1 (its drains die) on 2 nodes.  Job B
    has the same ranks in another layout: on 4 ranks, 1 per node, on nodes 0 to 3 (all
    of A's among them), a plain restore must raise, not restore step 0 (before: step 1
    was not on nodes 2 and 3, so step 0 came back without a word); on 2 ranks, on node
    0 alone (A's node 1 not in the job), step 1 is skipped with a warning.  Drained,
    step 1 is restored from the PFS."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ckpt = bbio.Checkpointer(comm, "shape", config=config_for(comm, shared_tmp))
    ckpt.save(0, state(0, rank)).wait(timeout=60)
    save_step_1_then_kill_its_drains(comm, shared_tmp, ckpt)
    ckpt.close(wait=False)
    blocker = shared_tmp / "pfs" / "ckpt" / "shape" / layout.step_dirname(1)
    if rank == 0:  # the drains job B starts cannot commit step 1 yet
        blocker.write_bytes(b"in the way")
    comm.Barrier()
    per_node = 1 if size == 4 else 2
    config = config_for(comm, shared_tmp, ranks_per_node=per_node)
    with bbio.Checkpointer(comm, "shape", config=config) as ckpt:
        listed = {info.step: info.bb for info in ckpt.list()}
        assert "saved by another layout of ranks (not restored from)" in listed[1], listed
        if size == 4:
            with pytest.raises(bbio.UsageError) as info:
                ckpt.restore()
            message = str(info.value)
            assert comm.allgather(message) == [message] * size
            assert "step 1 is only in the burst buffers, saved by another layout" in message
            assert "4 ranks on 4 nodes" in message and "drain --finish" in message
        else:
            with caplog.at_level(logging.WARNING, logger="bbio"):
                step, arrays, _ = ckpt.restore()
            assert step == 0 and same(arrays, state(0, rank))
            if rank == 0:
                assert "step 1 skipped: its burst-buffer copies are not" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bbio"):
            step, arrays, _ = ckpt.restore(from_rank=rank)
        assert step == 0 and same(arrays, state(0, rank))
        if rank == 0:
            assert "step 1 skipped" in caplog.text
        comm.Barrier()
        if rank == 0:
            blocker.unlink()
        comm.Barrier()
    if rank == 0:  # node 1's journal, when job B did not drain it
        journal = drain.journal_dir(shared_tmp / "bb" / "1" / "ckpt" / "shape")
        assert drain.run(journal, None, finish=True, timeout=60) == 0
    comm.Barrier()
    with bbio.Checkpointer(comm, "shape", config=config) as ckpt:
        step, arrays, _ = ckpt.restore()
        assert step == 1 and same(arrays, state(1, rank)) and ckpt.last_restore_tier == "pfs"


def drains_of(journal: Path) -> list[int]:
    """The PIDs of the drain processes of ``journal`` on this machine."""
    return processes_running(f"bbio.checkpoint.drainer --journal {journal} ")


@pytest.mark.timeout(150)
def test_jobs_on_a_journal_whose_drain_cannot_finish_add_one_waiting_drain(comm, shared_tmp):
    """Step 1 cannot be drained (a file where its PFS directory goes): its drain retries
    for ever.  Before, each later job's Checkpointer started one more drain, which
    waited for that one for ever: five per node after a few jobs."""
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    pfs = shared_tmp / "pfs" / "ckpt" / "stuck"
    if rank == 0:
        pfs.mkdir(parents=True)
        (pfs / layout.step_dirname(1)).write_bytes(b"in the way")
    comm.Barrier()
    ckpt = bbio.Checkpointer(comm, "stuck", config=config)
    ckpt.save(1, state(1, rank))
    ckpt.close(wait=False)
    for _ in range(3):
        bbio.Checkpointer(comm, "stuck", config=config).close(wait=False)
    journal = shared_tmp / "bb" / str(node_of(comm)) / "ckpt" / "stuck" / ".journal"
    if leader(comm):
        deadline = time.monotonic() + 30
        while len(drains_of(journal)) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        drains = drains_of(journal)
        assert len(drains) == 2, drains  # the one retrying, and one waiting for it
        for pid in drains:
            os.kill(pid, signal.SIGKILL)
        while drain.is_draining(journal) or drain.has_waiting_drain(journal):
            time.sleep(0.01)
    comm.Barrier()


def file_checksum(path: Path) -> tuple[int, int]:
    """(size, CRC32C) of the file at ``path``, read now."""
    data = path.read_bytes()
    return len(data), crc32c.crc32c(data)


def save_step_1_then_kill_its_drains(comm, shared_tmp, ckpt, attrs=None):
    """Collective: save step 1 of ``ckpt`` while a file sits where its PFS directory goes,
    kill each node's drain once it retries, then remove the file: the step stays queued,
    and no drain runs.  Returns the save's handle."""
    pfs = shared_tmp / "pfs" / "ckpt" / ckpt.name
    if comm.Get_rank() == 0:
        pfs.mkdir(parents=True, exist_ok=True)
        (pfs / layout.step_dirname(1)).write_bytes(b"in the way")
    comm.Barrier()
    handle = ckpt.save(1, state(1, comm.Get_rank()), attrs=attrs)
    journal = shared_tmp / "bb" / str(node_of(comm)) / "ckpt" / ckpt.name / ".journal"
    if leader(comm):
        deadline = time.monotonic() + 60
        while drain.read_status(journal).get("state") != "retrying":
            assert time.monotonic() < deadline, drain.read_status(journal)
            time.sleep(0.01)
        os.kill(drain.read_status(journal)["pid"], signal.SIGKILL)
        while drain.is_draining(journal):
            time.sleep(0.01)
    comm.Barrier()
    if comm.Get_rank() == 0:
        (pfs / layout.step_dirname(1)).unlink()
    comm.Barrier()
    return handle


@pytest.mark.timeout(150)
@pytest.mark.parametrize("policy", ["block", "skip"])
def test_a_drain_that_died_is_started_again_while_saves_wait(comm, shared_tmp, policy):
    """A drain killed with a task queued: a blocking save, a skipping one and close wait
    for the queue to empty, so they start a new drain (before, they waited for ever)."""
    config = config_for(comm, shared_tmp, ckpt_backpressure=policy)
    rank = comm.Get_rank()
    pfs = shared_tmp / "pfs" / "ckpt" / "dead"
    ckpt = bbio.Checkpointer(comm, "dead", config=config)
    save_step_1_then_kill_its_drains(comm, shared_tmp, ckpt)
    handle = ckpt.save(2, state(2, rank))
    assert handle.skipped == (policy == "skip")
    ckpt.close(timeout=60)
    assert drain.committed_steps(pfs) == ([1] if policy == "skip" else [1, 2])


def test_a_burst_buffer_copy_of_a_save_made_again_since_is_not_restored(comm, shared_tmp):
    """Job A saves step 10 into its burst buffers; job B, on other burst buffers, saves
    step 10 again and commits it.  Job C, back on A's burst buffers, must restore B's save
    from the PFS, not A's older one from the burst buffers."""
    rank = comm.Get_rank()
    jobs = {
        job: config_for(comm, shared_tmp, bb_root=str(shared_tmp / f"bb-{job}" / "{node}"))
        for job in "AB"
    }
    for job, value in (("A", 1.0), ("B", 2.0)):
        with bbio.Checkpointer(comm, "again", config=jobs[job]) as ckpt:
            handle = ckpt.save(10, {"x": np.full(4, value)}, attrs={"v": value}, replace=True)
            handle.wait(timeout=60)
    with bbio.Checkpointer(comm, "again", config=jobs["A"]) as ckpt:
        (listed,) = ckpt.list()
        assert (listed.step, listed.pfs) == (10, "committed")
        (row,) = admin.list_checkpoints(shared_tmp / "bb-A" / "0", shared_tmp / "pfs", 0)
        assert (row.bb, row.pfs) == ("complete, not the committed save", "committed"), row
        assert listed.bb == "nodes [0, 1], not the committed save (not restored from)", listed
        step, arrays, attrs = ckpt.restore()
        assert (step, attrs, ckpt.last_restore_tier) == (10, {"v": 2.0}, "pfs")
        assert np.array_equal(arrays["x"], np.full(4, 2.0)), rank


@pytest.mark.timeout(150)
def test_a_wait_that_times_out_says_the_drain_is_not_running(comm, shared_tmp):
    """Before, it blamed the PFS ("check that the PFS is writable")."""
    config = config_for(comm, shared_tmp)
    pfs = shared_tmp / "pfs" / "ckpt" / "nodrain"
    ckpt = bbio.Checkpointer(comm, "nodrain", config=config)
    handle = save_step_1_then_kill_its_drains(comm, shared_tmp, ckpt)
    with pytest.raises(bbio.BBIOTimeoutError) as info:
        handle.wait(timeout=1)
    assert "this node's drain is not running" in str(info.value)
    assert "save or close starts a drain" in str(info.value)
    ckpt.close(timeout=60)  # starts a drain, which commits it
    assert drain.committed_steps(pfs) == [1]
