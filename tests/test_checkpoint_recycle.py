"""Recycled burst-buffer files (``ckpt_recycle``) on 2 or 4 ranks in 2 virtual nodes: real
parallel HDF5, real drain processes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import crc32c
import h5py
import numpy as np
import pytest

import bbio
from bbio.checkpoint import layout
from tests.test_checkpoint import (
    _DeviceState,
    config_for,
    failed_save,
    leader,
    node_of,
    same,
    state,
)

pytestmark = pytest.mark.mpi(min_size=2)


def node_ckpt_dir(comm, tmp: Path, name: str) -> Path:
    return tmp / "bb" / str(node_of(comm)) / "ckpt" / name


def _leaders_say(comm, value):
    """Collective: what this rank's node leader computed (``value`` there)."""
    return comm.allgather(value)[comm.Get_rank() - comm.Get_rank() % (comm.Get_size() // 2)]


def settle(comm, ckpt_dir: Path, keep: int = 1, timeout: float = 30) -> int:
    """Collective: once retention left ``keep`` steps in every burst buffer, how many spare
    files this node has; a hard link (``probe``) holds the spare's inode, if one."""
    count = None
    if leader(comm):
        deadline = time.monotonic() + timeout
        while len(list(ckpt_dir.glob("step-*"))) > keep and time.monotonic() < deadline:
            time.sleep(0.01)
        spares = list(ckpt_dir.glob(layout.spare_pattern()))
        probe = ckpt_dir.parent / "probe"
        probe.unlink(missing_ok=True)
        if spares:
            os.link(spares[0], probe)
        count = len(spares)
    return _leaders_say(comm, count)


def rewrote_spare(comm, ckpt_dir: Path, step: int) -> bool:
    """Collective: is this node's file of ``step`` the spare :func:`settle` saw?"""
    same_file = None
    if leader(comm):
        node_file = ckpt_dir / layout.step_dirname(step) / layout.node_filename(node_of(comm))
        probe = ckpt_dir.parent / "probe"
        same_file = probe.exists() and node_file.exists() and os.path.samefile(node_file, probe)
    return _leaders_say(comm, same_file)


def save_until_a_spare(comm, ckpt, home: Path) -> None:
    """Collective: save steps 1 and 2 (``keep_bb`` 1): step 1's file becomes the spare."""
    for step in (1, 2):
        ckpt.save(step, state(step, comm.Get_rank())).wait(timeout=60)
    assert settle(comm, home) == 1


def test_a_trimmed_file_is_rewritten_in_place_by_the_next_save_of_its_layout(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    rank, home = comm.Get_rank(), node_ckpt_dir(comm, shared_tmp, "re")
    with bbio.Checkpointer(comm, "re", keep_bb=1, config=config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step, rank), attrs={"step": step}).wait(timeout=60)
        assert settle(comm, home) == 1, "step 1's file should be this node's spare"
        ckpt.save(3, state(3, rank), attrs={"note": "x" * 300}).wait(timeout=60)
        assert rewrote_spare(comm, home, 3)
        if leader(comm):  # the file's CRC32C, recorded at save, from its arrays' and HDF5's
            step_3 = home / layout.step_dirname(3)
            record = json.loads((step_3 / layout.node_record_name(node_of(comm))).read_text())
            data = (step_3 / layout.node_filename(node_of(comm))).read_bytes()
            assert record["file_crc32c"] == record["crc32c"] == crc32c.crc32c(data)
        step, arrays, attrs = ckpt.restore()
        assert (step, attrs) == (3, {"note": "x" * 300}) and same(arrays, state(3, rank))
        comm.Barrier()
        pfs_step = shared_tmp / "pfs" / "ckpt" / "re" / layout.step_dirname(3)
        with h5py.File(pfs_step / "global.h5", "r") as f:  # plain h5py reads the drained copy
            assert int(f.attrs["step"]) == 3
            np.testing.assert_array_equal(
                f[layout.rank_dataset("model/w", rank)][()], state(3, rank)["model/w"]
            )
        assert settle(comm, home) == 1  # step 2's file is the spare now
    comm.Barrier()  # closed: the drains stopped and took the spares with them
    assert not list(home.glob(layout.spare_pattern()))


def test_a_file_grown_too_large_or_a_spare_of_another_layout_is_not_reused(comm, shared_tmp):
    config = config_for(comm, shared_tmp)
    rank, home = comm.Get_rank(), node_ckpt_dir(comm, shared_tmp, "other")
    with bbio.Checkpointer(comm, "other", keep_bb=1, config=config) as ckpt:
        save_until_a_spare(comm, ckpt, home)
        if leader(comm):  # as if HDF5 had leaked past the file's allowance in rewrites
            step_2 = home / layout.step_dirname(2) / layout.node_filename(node_of(comm))
            os.truncate(step_2, 8 << 20)
        comm.Barrier()
        ckpt.save(3, state(3, rank)).wait(timeout=60)
        assert rewrote_spare(comm, home, 3)  # step 1's file
        assert settle(comm, home) == 0  # step 2's file is deleted, not kept
        ckpt.save(4, state(4, rank)).wait(timeout=60)
        assert settle(comm, home) == 1  # step 3's file
        ckpt.save(5, state(5, rank, rows=50)).wait(timeout=60)  # other shapes: a new file
        assert not rewrote_spare(comm, home, 5)
        step, arrays, _ = ckpt.restore()
        assert step == 5 and same(arrays, state(5, rank, rows=50))


def test_a_damaged_spare_is_laid_out_anew_and_the_save_succeeds(comm, shared_tmp, caplog):
    """Node 0's spare holds a dataset more than its layout key says (its saved ones
    intact), node 1's is not HDF5 at all: each node lays a new file out."""
    config = config_for(comm, shared_tmp)
    rank, home = comm.Get_rank(), node_ckpt_dir(comm, shared_tmp, "damaged")
    with bbio.Checkpointer(comm, "damaged", keep_bb=1, config=config) as ckpt:
        save_until_a_spare(comm, ckpt, home)
        if leader(comm):
            (spare,) = home.glob(layout.spare_pattern())
            if node_of(comm) == 0:
                with h5py.File(spare, "r+") as f:
                    f[layout.rank_dataset("model/extra", rank)] = np.arange(4)
            else:
                spare.write_bytes(b"not HDF5" * 1000)
        comm.Barrier()
        with caplog.at_level("WARNING", logger="bbio"):
            ckpt.save(3, state(3, rank)).wait(timeout=60)
        assert ("the spare cannot be rewritten" in caplog.text) == leader(comm), caplog.text
        assert not rewrote_spare(comm, home, 3)  # a new file: a reader of the old keeps it
        node_file = home / layout.step_dirname(3) / layout.node_filename(node_of(comm))
        if leader(comm):
            with h5py.File(node_file, "r") as f:
                assert layout.rank_dataset("model/extra", rank) not in f
        step, arrays, _ = ckpt.restore()
        assert step == 3 and same(arrays, state(3, rank))


def test_with_recycling_off_trimmed_files_are_deleted(comm, shared_tmp):
    config = config_for(comm, shared_tmp, ckpt_recycle="off")
    rank, home = comm.Get_rank(), node_ckpt_dir(comm, shared_tmp, "off")
    with bbio.Checkpointer(comm, "off", keep_bb=1, config=config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state(step, rank)).wait(timeout=60)
        assert settle(comm, home) == 0
        step, arrays, _ = ckpt.restore()
        assert step == 3 and same(arrays, state(3, rank))


def test_a_rank_failing_in_a_rewrite_fails_the_save_everywhere_and_the_next_save_works(
    comm, shared_tmp
):
    config = config_for(comm, shared_tmp)
    rank, home = comm.Get_rank(), node_ckpt_dir(comm, shared_tmp, "fail")
    with bbio.Checkpointer(comm, "fail", keep_bb=1, config=config) as ckpt:
        counted = _DeviceState(state(1, rank))
        ckpt.save(1, counted).wait(timeout=60)
        ckpt.save(2, state(2, rank)).wait(timeout=60)
        assert settle(comm, home) == 1
        failed_save(comm, ckpt, 3, max(counted.reads.values()))
        assert settle(comm, home) == 0  # the spare was taken, then withdrawn with the save
        assert not (home / layout.step_dirname(3)).exists()
        ckpt.save(4, state(4, rank)).wait(timeout=60)
        step, arrays, _ = ckpt.restore()
        assert step == 4 and same(arrays, state(4, rank))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_spare_counts_as_room_in_a_burst_buffer_that_holds_four_files(comm, shared_tmp):
    """Both nodes' burst buffers share a tmpfs that holds a checkpoint and a spare per node
    and 2.5 MiB more: less than a save needs beside them (its arrays and 1 MiB for HDF5,
    reserved before HDF5 writes), enough once its spare counts."""
    rpn = comm.Get_size() // 2
    per_node = rpn * (2 << 20)  # a 2 MiB array per rank
    small = shared_tmp / "fourfiles"
    if comm.Get_rank() == 0:
        small.mkdir()
        size = f"size={4 * per_node + (5 << 19)}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(small)], check=True)
    comm.Barrier()
    try:
        config = config_for(comm, shared_tmp, bb_root=str(small / "{node}"))
        home = small / str(node_of(comm)) / "ckpt" / "room"
        rank = comm.Get_rank()

        def arrays(step: int, name: str = "x") -> dict:
            return {name: np.full(2 << 20, step * 10 + rank, dtype=np.uint8)}

        with bbio.Checkpointer(comm, "room", keep_bb=1, config=config) as ckpt:
            for step in (1, 2):
                handle = ckpt.save(step, arrays(step))
                assert not handle.direct
                handle.wait(timeout=60)
            assert settle(comm, home) == 1  # each node: step 2 and step 1's file, the spare
            handle = ckpt.save(3, arrays(3))
            assert not handle.direct and rewrote_spare(comm, home, 3)
            handle.wait(timeout=60)
            assert settle(comm, home) == 1
            if leader(comm):  # the probe's link would keep the spare's pages
                (home.parent / "probe").unlink()
            comm.Barrier()
            handle = ckpt.save(4, arrays(4, "y"))  # other arrays: the spare goes first
            assert not handle.direct
            step, restored, _ = ckpt.restore()
            assert step == 4 and np.array_equal(restored["y"], arrays(4, "y")["y"])
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", "--lazy", str(small)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_spare_its_rewrite_would_grow_past_its_room_is_laid_out_anew(comm, shared_tmp):
    """Each rewrite of a spare grows it by its string attributes (HDF5 does not reuse their
    old room): 100 KiB of ``attrs``, 104 KiB a rewrite.  Every save here is left just
    the room it asks for: once a spare was within that room but its rewrite was not,
    HDF5 met the full device when it closed the file, closed it again, and crashed the
    job (SIGSEGV).  Now such a spare is laid out anew, in the room it gives back."""
    small = shared_tmp / "growing"
    if comm.Get_rank() == 0:
        for node in (0, 1):
            (small / str(node)).mkdir(parents=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small / str(node))],
                check=True,
            )
    comm.Barrier()
    try:
        config = config_for(comm, shared_tmp, bb_root=str(small / "{node}"))
        home = small / str(node_of(comm)) / "ckpt" / "growing"
        filler = home.parent / "filler"
        rank, blob = comm.Get_rank(), "x" * (100 << 10)
        laid_anew = False
        with bbio.Checkpointer(comm, "growing", keep_bb=1, config=config) as ckpt:
            for step in range(1, 31):
                spare_inode = None
                if step > 2:
                    assert settle(comm, home) == 1
                    if leader(comm):  # the room the save asks for, and nothing more
                        (home.parent / "probe").unlink()
                        spare = next(home.glob(layout.spare_pattern())).stat()
                        record = home / layout.step_dirname(step - 1)
                        record /= layout.node_record_name(node_of(comm))
                        room = json.loads(record.read_text())["spare"]["max_bytes"]
                        free = os.statvfs(home).f_bavail * os.statvfs(home).f_frsize
                        filler.write_bytes(b"\0" * (free + (spare.st_size - room) // 4096 * 4096))
                        spare_inode = spare.st_ino
                handle = ckpt.save(step, state(step, rank), attrs={"blob": blob})
                assert not handle.direct
                handle.wait(timeout=60)
                if spare_inode is not None:
                    node_file = home / layout.step_dirname(step)
                    node_file /= layout.node_filename(node_of(comm))
                    laid_anew |= node_file.stat().st_ino != spare_inode
                    filler.unlink()
            assert any(comm.allgather(laid_anew)), "no spare came near its room"
            restored_step, arrays, attrs = ckpt.restore()
            assert restored_step == 30 and same(arrays, state(30, rank))
            assert attrs == {"blob": blob}
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            for node in (0, 1):
                subprocess.run(["umount", "--lazy", str(small / str(node))], check=True)
