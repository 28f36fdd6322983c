"""Burst buffers too small for what is asked of them, on 2 or 4 ranks in 2 virtual nodes:
one real tmpfs per node, real parallel HDF5, real drain processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import bbio
from tests.test_checkpoint import config_for, node_of

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting small file systems needs root"),
]

MiB = 1 << 20


@contextlib.contextmanager
def small_burst_buffers(comm, tmp: Path, size: str) -> Iterator[str]:
    """Collective: a tmpfs of ``size`` for each virtual node; yields the ``bb_root``."""
    mounts = [tmp / "smallbb" / str(node) for node in range(2)]
    if comm.Get_rank() == 0:
        for mount in mounts:
            mount.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)])
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
