"""Burst buffers too small for what is asked of them, on 2 or 4 ranks in 2 virtual nodes:
one real tmpfs per node, real parallel HDF5, real drain processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import bbio
from bbio.checkpoint import drain
from tests.test_checkpoint import config_for, node_of

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting small file systems needs root"),
]

MiB = 1 << 20


@contextlib.contextmanager
def small_burst_buffers(comm, tmp: Path, size: str, inodes: int = 0) -> Iterator[str]:
    """Collective: a tmpfs of ``size`` (and of ``inodes`` inodes, if given) for each
    virtual node; yields the ``bb_root``."""
    mounts = [tmp / "smallbb" / str(node) for node in range(2)]
    if comm.Get_rank() == 0:
        for mount in mounts:
            mount.mkdir(parents=True)
            options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)])
    comm.Barrier()
    try:
        assert all(os.path.ismount(mount) for mount in mounts)
        yield str(tmp / "smallbb" / "{node}")
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            for mount in mounts:
                subprocess.run(["umount", "--lazy", str(mount)], check=True)


def rank_state(step: int, rank: int, per_node: int, comm) -> dict:
    """About ``per_node`` bytes of arrays per node, split over its ranks."""
    ranks_per_node = comm.Get_size() // 2
    return {"w": np.full(per_node // ranks_per_node, step * 10 + rank, dtype=np.uint8)}


def bb_steps(comm, tmp: Path, name: str) -> list[int]:
    """The steps of ``name`` in this rank's node's burst buffer (its record there)."""
    ckpt_dir = tmp / "smallbb" / str(node_of(comm)) / "ckpt" / name
    return sorted(int(p.parent.name.split("-")[1]) for p in ckpt_dir.glob("step-*/node-*.json"))


def test_a_burst_buffer_that_holds_fewer_than_keep_bb_keeps_the_newest_it_can(comm, shared_tmp):
    """Each node's burst buffer holds two checkpoints of about 2 MiB, and keep_bb is 3.
    Before, the two oldest stayed there for good and every later save went straight to
    the PFS; now a save short of room trims drained, committed copies, oldest first, until
    its file fits."""
    rank = comm.Get_rank()
    with small_burst_buffers(comm, shared_tmp, "6m") as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root, ckpt_recycle="off")
        with bbio.Checkpointer(comm, "k", keep_bb=3, config=config) as ckpt:
            for step in range(1, 6):
                handle = ckpt.save(step, rank_state(step, rank, 2 * MiB, comm))
                handle.wait(timeout=60)
                assert not handle.direct, f"step {step} went straight to the PFS"
            assert bb_steps(comm, shared_tmp, "k") == [4, 5]  # as many as fit, the newest
            step, arrays, _ = ckpt.restore()
            assert step == 5 and ckpt.last_restore_tier == "bb"
            assert np.array_equal(arrays["w"], rank_state(5, rank, 2 * MiB, comm)["w"])


def test_large_attrs_count_in_the_room_a_save_needs(comm, shared_tmp, caplog):
    """3 MiB of attrs beside 2 MiB of arrays per node do not fit a 5 MiB burst buffer.
    Before, the estimate left the attrs out: the nodes wrote into the burst buffer, HDF5
    ran out of space, and the job died ("stack smashing detected")."""
    rank = comm.Get_rank()
    attrs = {"notes": "x" * (3 * MiB)}
    with small_burst_buffers(comm, shared_tmp, "5m") as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root)
        with bbio.Checkpointer(comm, "a", config=config) as ckpt:
            with caplog.at_level(logging.WARNING, logger="bbio"):
                handle = ckpt.save(1, rank_state(1, rank, 2 * MiB, comm), attrs=attrs)
            assert handle.direct and handle.done()
            if rank == 0:
                assert "cannot hold it" in caplog.text
            step, arrays, restored_attrs = ckpt.restore()
            assert step == 1 and json.dumps(restored_attrs) == json.dumps(attrs)
            assert np.array_equal(arrays["w"], rank_state(1, rank, 2 * MiB, comm)["w"])
            small = ckpt.save(2, rank_state(2, rank, 2 * MiB, comm), attrs={"notes": "short"})
            assert not small.direct  # the same arrays fit without the attrs
            small.wait(timeout=60)


def fill(path: Path) -> Path:
    """Write into ``path``'s file system until it is full, as another process of the job
    might; returns the file written."""
    filler = path / "another-process-data"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\1" * (256 << 10))
    return filler


def fill_node_0_before(comm, tmp: Path, monkeypatch, module, name: str) -> list[Path]:
    """On rank 0, fill node 0's burst buffer (:func:`fill`) right before the first call of
    ``module.name``, as another process of the job might; returns the files written
    (filled in by then: none on the other ranks)."""
    fillers: list[Path] = []
    if comm.Get_rank() == 0:
        original = getattr(module, name)

        def filling_first(*args, **kwargs):
            if not fillers:
                fillers.append(fill(tmp / "smallbb" / "0"))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, filling_first)
    return fillers


def test_long_keys_count_in_the_room_a_save_needs(comm, shared_tmp):
    """HDF5's metadata for a long key outgrew the estimate (1 MiB per file, 4 KiB per
    array): the save passed the check, then HDF5 met the full burst buffer while it
    closed the file, and the save could hang (on 4 ranks) or crash."""
    key = "k" * 1_400_000
    with small_burst_buffers(comm, shared_tmp, "3m") as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root)
        with bbio.Checkpointer(comm, "long", config=config) as ckpt:
            handle = ckpt.save(1, {key: np.arange(4) + comm.Get_rank()})
            assert handle.direct
            step, arrays, _ = ckpt.restore()
            assert step == 1 and np.array_equal(arrays[key], np.arange(4) + comm.Get_rank())


def test_a_burst_buffer_another_process_fills_during_a_save(comm, shared_tmp, monkeypatch):
    """Node 0's burst buffer fills after its ranks wrote their arrays, before HDF5 writes
    its metadata.  Before, every rank raised "Unable to flush cached data" and the node's
    ranks then crashed (HDF5 could not close the file); now the node file's room was
    reserved before HDF5 wrote a byte, and the save succeeds."""
    from bbio.checkpoint import writer

    rank = comm.Get_rank()
    fillers = fill_node_0_before(comm, shared_tmp, monkeypatch, writer, "_set_root_attrs")
    state = {f"layer{i}/weight": np.full(64, i + rank, np.float32) for i in range(50)}
    with small_burst_buffers(comm, shared_tmp, "4m") as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root, ckpt_recycle="off")
        with bbio.Checkpointer(comm, "filled", config=config) as ckpt:
            handle = ckpt.save(1, state)
            assert not handle.direct
            assert comm.allreduce(len(fillers)) == 1
            step, arrays, _ = ckpt.restore()
            assert step == 1 and all(np.array_equal(arrays[k], v) for k, v in state.items())
            for filler in fillers:
                filler.unlink()
            handle.wait(timeout=60)


def test_a_burst_buffer_full_before_the_file_is_made_sends_the_save_to_the_pfs(
    comm, shared_tmp, monkeypatch, caplog
):
    """Node 0's burst buffer fills between the free-space check and the write: its leader
    cannot reserve the file's room, before HDF5 opens the file (which HDF5 on a full
    device could not survive), and the save goes straight to the PFS, said once."""
    from bbio.checkpoint import checkpointer

    rank = comm.Get_rank()
    fillers = fill_node_0_before(comm, shared_tmp, monkeypatch, checkpointer, "write_node_file")
    with small_burst_buffers(comm, shared_tmp, "4m") as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root, ckpt_recycle="off")
        with bbio.Checkpointer(comm, "full", config=config) as ckpt:
            with caplog.at_level(logging.WARNING, logger="bbio"):
                handle = ckpt.save(1, {"w": np.full(1024, rank, np.uint8)})
            assert handle.direct and handle.done()
            if rank == 0:
                assert "could not reserve its file's room" in caplog.text, caplog.text
            assert not list((shared_tmp / "smallbb").glob("*/ckpt/full/step-*/*.h5*"))
            step, arrays, _ = ckpt.restore()
            assert step == 1 and np.array_equal(arrays["w"], np.full(1024, rank, np.uint8))
            for filler in fillers:
                filler.unlink()


def test_virtual_nodes_whose_burst_buffers_share_a_device_too_small_for_both(comm, shared_tmp):
    """Two virtual nodes' burst buffers on one 1600 KiB tmpfs: each passes the free-space
    check alone, and their reservations together do not fit.  Before, every save raised
    NoSpaceError; now it goes straight to the PFS."""
    rank = comm.Get_rank()
    shared = shared_tmp / "sharedbb"
    if rank == 0:
        shared.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(shared)])
    comm.Barrier()
    try:
        config = config_for(comm, shared_tmp, bb_root=str(shared / "{node}"), ckpt_recycle="off")
        with bbio.Checkpointer(comm, "shared", config=config) as ckpt:
            for step in range(2):
                handle = ckpt.save(step, {"w": np.full(1024, rank + step, np.uint8)})
                assert handle.direct and handle.done()
            step, arrays, _ = ckpt.restore()
            assert step == 1 and np.array_equal(arrays["w"], np.full(1024, rank + 1, np.uint8))
    finally:
        comm.Barrier()
        if rank == 0:
            subprocess.run(["umount", "--lazy", str(shared)], check=True)


@pytest.mark.timeout(120)  # before the fix: the other ranks waited for node 0's leader
def test_close_on_a_full_burst_buffer_stops_every_drain(comm, shared_tmp):
    """Node 0's burst buffer is full when the job closes its checkpointer.  Before, node 0's
    leader alone raised NoSpaceError writing the drains' stop file, and the job aborted;
    now the stop file is empty, which a full burst buffer still takes."""
    rank = comm.Get_rank()
    with small_burst_buffers(comm, shared_tmp, "4m") as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root, ckpt_recycle="off")
        ckpt = bbio.Checkpointer(comm, "closing", config=config)
        ckpt.save(1, {"w": np.full(1024, rank, np.uint8)}).wait(timeout=60)
        filler = fill(shared_tmp / "smallbb" / "0") if rank == 0 else None
        comm.Barrier()
        leader = ckpt.topo.is_leader
        ckpt.close(timeout=60)
        if leader:  # close waited for this node's drain to exit
            assert ckpt._drain is not None and ckpt._drain.poll() is not None
        if filler is not None:
            filler.unlink()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", [True, False])
def test_close_where_the_stop_file_cannot_be_made_warns_and_returns(comm, shared_tmp, caplog, wait):
    """Node 0's burst buffer has no inode left: its leader cannot even create the empty
    stop file.  close() says so and returns on every rank.  Once every save is drained
    (``wait``), that node's drain is told to stop by a signal instead, and stops as the
    stop file would have made it; else (as on an exception inside ``with``) it goes on,
    and stops once the stop file is there or the training process is gone."""
    rank = comm.Get_rank()
    with small_burst_buffers(comm, shared_tmp, "4m", inodes=64) as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root, ckpt_recycle="off")
        ckpt = bbio.Checkpointer(comm, "inodes", config=config)
        ckpt.save(1, {"w": np.full(1024, rank, np.uint8)}).wait(timeout=60)
        journal = shared_tmp / "smallbb" / "0" / "ckpt" / "inodes" / ".journal"
        inode_fillers = []
        if rank == 0:
            time.sleep(2 * drain.IDLE_TRIM_SECONDS)  # the idle drain's trim frees inodes
            with contextlib.suppress(OSError):
                while True:
                    inode_fillers.append(journal.parent / f"filler-{len(inode_fillers)}")
                    inode_fillers[-1].touch()
        comm.Barrier()
        leader, drain_process = ckpt.topo.is_leader, ckpt._drain
        with caplog.at_level(logging.WARNING, logger="bbio"):
            ckpt.close(wait=wait, timeout=60)
        if rank == 0:
            assert f"cannot create {journal / 'stop'}" in caplog.text, caplog.text
            if wait:  # it stopped as the stop file makes it, not killed by a signal
                assert "its drain was told to stop by a signal" in caplog.text, caplog.text
                assert drain_process.poll() is not None and drain_process.returncode >= 0
            else:
                assert "stops once the training process has exited" in caplog.text
                assert drain_process.poll() is None  # still waiting to be told
        for filler in inode_fillers[:-1]:
            filler.unlink()
        if leader:
            (
                journal.parents[3] / str(node_of(comm)) / "ckpt" / "inodes" / ".journal" / "stop"
            ).touch()
            drain_process.wait(timeout=30)
