"""Saves that rewrite recycled node files on tmpfs through kept mappings, on 2 or 4 ranks
in 2 virtual nodes: real tmpfs burst buffers, real parallel HDF5, real drain processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import bbio
from bbio.config import Config
from tests.test_checkpoint import config_for, leader, node_of, same, state
from tests.test_checkpoint_recycle import rewrote_spare, settle
from tests.test_ckpt_capacity import small_burst_buffers

pytestmark = pytest.mark.mpi(min_size=2)


@contextlib.contextmanager
def burst_buffers_in_shm(comm, tmp: Path, name: str) -> Iterator[tuple[Config, Path]]:
    """Collective: the configuration of burst buffers in a fresh directory on the tmpfs
    ``/dev/shm`` (removed at the end), and this node's directory of checkpointer ``name``."""
    where = f"/dev/shm/bbio-test-{uuid.uuid4().hex}" if comm.Get_rank() == 0 else None
    shm = Path(comm.bcast(where))
    try:
        config = config_for(comm, tmp, bb_root=str(shm / "{node}"))
        yield config, shm / str(node_of(comm)) / "ckpt" / name
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(shm, ignore_errors=True)


def save_until_files_take_turns(comm, ckpt, home: Path, arrays_of: Callable[[int], dict]):
    """Collective: steps 1 to 4 (``keep_bb`` 1), each drained and trimmed before the next:
    steps 3 and 4 rewrite the node's two files through the ranks' mappings."""
    for step in range(1, 5):
        ckpt.save(step, arrays_of(step)).wait(timeout=60)
        settle(comm, home)


def queue_behind_stopped_drains(comm, ckpt, home: Path, arrays_of: Callable[[int], dict]):
    """Collective: after :func:`save_until_files_take_turns`, steps 5 (a rewrite of the
    spare) and 6 (no spare left: a new file) saved while the drains are stopped, then
    drained: each drain keeps step 5's file as the spare, deleting the one it kept
    before, which the ranks map."""
    drain_pid = ckpt._drain.pid if leader(comm) else None
    if drain_pid is not None:
        os.kill(drain_pid, signal.SIGSTOP)
    try:
        comm.Barrier()
        ckpt.save(5, arrays_of(5))
        queued = ckpt.save(6, arrays_of(6))
        comm.Barrier()
    finally:
        if drain_pid is not None:
            os.kill(drain_pid, signal.SIGCONT)
    queued.wait(timeout=60)
    settle(comm, home)


def test_saves_rewrite_their_files_through_kept_mappings_and_restore_what_they_saved(
    comm, shared_tmp
):
    """Each node's two files take turns (``keep_bb`` 1): from step 3 on each save rewrites
    one of them, through mappings each rank keeps; every step restores as saved, from the
    burst buffer and from the PFS, and every drain verified the files' CRC32C."""
    rank = comm.Get_rank()
    with (
        burst_buffers_in_shm(comm, shared_tmp, "mapped") as (config, home),
        bbio.Checkpointer(comm, "mapped", keep_bb=1, config=config) as ckpt,
    ):
        for step in range(1, 7):
            ckpt.save(step, state(step, rank, rows=2000)).wait(timeout=60)
            assert step < 3 or rewrote_spare(comm, home, step)
            settle(comm, home)
            assert len(ckpt._mappings) == min(max(step - 2, 0), 2)
        restored_step, arrays, _ = ckpt.restore()
        assert restored_step == 6 and ckpt.last_restore_tier == "bb"
        assert same(arrays, state(6, rank, rows=2000))
        for step in range(3, 6):
            assert same(ckpt.restore(step=step)[1], state(step, rank, rows=2000))
            assert ckpt.last_restore_tier == "pfs"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_mapped_spare_dropped_for_another_layout_gives_its_room_to_the_new_file(comm, shared_tmp):
    """Each node's burst buffer holds its checkpoint and its spare and 1.25 MiB more.  The
    spares were rewritten through mappings; a save of other arrays drops them, and the
    new files fit only once the ranks release their mappings (a mapping keeps a deleted
    file's pages)."""
    rank = comm.Get_rank()
    per_node = comm.Get_size() // 2 * (2 << 20)  # a 2 MiB array per rank
    with small_burst_buffers(comm, shared_tmp, str(2 * per_node + (5 << 18))) as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root)
        home = Path(bb_root.replace("{node}", str(node_of(comm)))) / "ckpt" / "room"

        def arrays(step: int, name: str = "x") -> dict:
            return {name: np.full(2 << 20, step * 10 + rank, dtype=np.uint8)}

        with bbio.Checkpointer(comm, "room", keep_bb=1, config=config) as ckpt:
            for step in range(1, 5):
                handle = ckpt.save(step, arrays(step))
                assert not handle.direct and (step < 3 or rewrote_spare(comm, home, step))
                handle.wait(timeout=60)
                settle(comm, home)
            assert len(ckpt._mappings) == 2  # both files, the spare (step 3's) among them
            if leader(comm):  # the probe's link would keep the spare's pages
                (home.parent / "probe").unlink()
            comm.Barrier()
            handle = ckpt.save(5, arrays(5, "y"))
            assert not handle.direct
            step, restored, _ = ckpt.restore()
            assert step == 5 and np.array_equal(restored["y"], arrays(5, "y")["y"])


def deleted_files_mapped(under: Path) -> list[str]:
    """The files under ``under`` that this process maps though they were deleted."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [line.split()[-2] for line in maps if str(under) in line and "(deleted)" in line]


def test_a_spare_the_drain_deletes_is_released_by_the_next_save(comm, shared_tmp):
    """Saves queued behind a stopped drain: once it runs again it keeps a newer file as the
    spare and deletes the older one, which the ranks had mapped; the next save releases
    it (before, its memory stayed taken until ``close``)."""
    rank = comm.Get_rank()
    with (
        burst_buffers_in_shm(comm, shared_tmp, "queued") as (config, home),
        bbio.Checkpointer(comm, "queued", keep_bb=1, config=config) as ckpt,
    ):
        save_until_files_take_turns(comm, ckpt, home, lambda step: state(step, rank, 2000))
        queue_behind_stopped_drains(comm, ckpt, home, lambda step: state(step, rank, 2000))
        assert deleted_files_mapped(home)
        ckpt.save(7, state(7, rank, rows=2000)).wait(timeout=60)
        settle(comm, home)
        assert deleted_files_mapped(home) == []
        assert same(ckpt.restore()[1], state(7, rank, rows=2000))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_save_short_of_room_gets_the_room_of_mapped_files_it_trims(comm, shared_tmp):
    """Each node's burst buffer holds its two files (the last checkpoint and the spare, both
    mapped) and is then filled up to 512 KiB: the save trims the drained checkpoint and
    its file fits once no rank maps the deleted files.  Before, their pages stayed taken:
    that save and every later one went straight to the PFS."""
    rank = comm.Get_rank()
    per_node = comm.Get_size() // 2 * (2 << 20)  # a 2 MiB array per rank
    with small_burst_buffers(comm, shared_tmp, str(3 * per_node + (2 << 20))) as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root)
        mount = Path(bb_root.replace("{node}", str(node_of(comm))))
        home = mount / "ckpt" / "trim"

        def arrays(step: int) -> dict:
            return {"x": np.full(2 << 20, step * 10 + rank, dtype=np.uint8)}

        with bbio.Checkpointer(comm, "trim", keep_bb=1, config=config) as ckpt:
            for step in range(1, 5):
                ckpt.save(step, arrays(step)).wait(timeout=60)
                settle(comm, home)
            assert len(ckpt._mappings) == 2
            if leader(comm):
                (home.parent / "probe").unlink()  # the probe's link would keep the spare
                with open(mount / "filler", "wb") as filler:
                    info = os.statvfs(mount)
                    filler.write(bytes(info.f_bavail * info.f_frsize - (512 << 10)))
            comm.Barrier()
            handle = ckpt.save(5, arrays(5))
            assert not handle.direct
            handle.wait(timeout=60)
            if leader(comm):
                (mount / "filler").unlink()
            comm.Barrier()
            handle = ckpt.save(6, arrays(6))
            assert not handle.direct
            step, restored, _ = ckpt.restore()
            assert step == 6 and ckpt.last_restore_tier == "bb"
            assert np.array_equal(restored["x"], arrays(6)["x"])


def test_a_step_saved_again_leaves_no_deleted_file_mapped(comm, shared_tmp):
    """``replace`` drops the step's old node file, which the ranks had rewritten through
    their mappings: the save releases them before it returns (before, its memory stayed
    taken until the next save)."""
    rank = comm.Get_rank()
    with (
        burst_buffers_in_shm(comm, shared_tmp, "again") as (config, home),
        bbio.Checkpointer(comm, "again", keep_bb=1, config=config) as ckpt,
    ):
        save_until_files_take_turns(comm, ckpt, home, lambda step: state(step, rank, 2000))
        ckpt.save(4, state(5, rank, rows=2000), replace=True).wait(timeout=60)
        assert deleted_files_mapped(home) == []
        assert same(ckpt.restore()[1], state(5, rank, rows=2000))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_save_gets_the_room_of_files_another_checkpointer_mapped(comm, shared_tmp):
    """Two checkpointers in one process share each node's burst buffer.  Saves of ``b``
    queued behind its stopped drain leave its ranks mapping a spare the drain then
    deleted; with the burst buffer full but for 1.5 MiB, ``a``'s first save fits only
    with that spare's memory back (before, ``a`` released only its own mappings and
    went to the PFS)."""
    rank = comm.Get_rank()
    per_node = comm.Get_size() // 2 * (2 << 20)  # a 2 MiB array per rank
    with small_burst_buffers(comm, shared_tmp, str(8 * per_node)) as bb_root:
        config = config_for(comm, shared_tmp, bb_root=bb_root)
        mount = Path(bb_root.replace("{node}", str(node_of(comm))))

        def arrays(step: int, name: str = "x") -> dict:
            return {name: np.full(2 << 20, step * 10 + rank, dtype=np.uint8)}

        with (
            bbio.Checkpointer(comm, "b", keep_bb=1, config=config) as b,
            bbio.Checkpointer(comm, "a", keep_bb=1, config=config) as a,
        ):
            save_until_files_take_turns(comm, b, mount / "ckpt" / "b", arrays)
            queue_behind_stopped_drains(comm, b, mount / "ckpt" / "b", arrays)
            assert deleted_files_mapped(mount / "ckpt" / "b")
            if leader(comm):
                (mount / "ckpt" / "probe").unlink(missing_ok=True)
                with open(mount / "filler", "wb") as filler:
                    info = os.statvfs(mount)
                    filler.write(bytes(info.f_bavail * info.f_frsize - (3 << 19)))
            comm.Barrier()
            handle = a.save(1, arrays(1, "y"))
            assert not handle.direct
            handle.wait(timeout=60)
            if leader(comm):
                (mount / "filler").unlink()
            comm.Barrier()
