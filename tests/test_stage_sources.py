"""Stage-in of sources that change type between the walk and the copy: a file removed,
or replaced by a FIFO or by a symlink to a file outside the tree, is skipped as removed
during the copy; the symlink is never followed and the FIFO never blocks."""

from __future__ import annotations

import os
import time

import pytest

import bbio
from bbio.stage import run as run_module
from tests.test_stage import files_under, same_on_all_ranks, two_nodes

pytestmark = pytest.mark.mpi(min_size=2)

CHANGED = ("gone.bin", "fifo.bin", "link.bin")


def _change_sources_once(comm, src, secret, monkeypatch, executor: str) -> None:
    """Wrap ``executor`` so that, at the first copy, rank 0 changes the sources the walk
    saw and the other ranks wait for it (a marker file, no collective)."""
    original = getattr(run_module, executor)
    marker = src.parent / "changed"
    state = {"done": False}

    def changing(*args, **kwargs):
        if not state["done"]:
            state["done"] = True
            if comm.Get_rank() == 0:
                (src / "gone.bin").unlink()
                (src / "fifo.bin").unlink()
                os.mkfifo(src / "fifo.bin")
                (src / "link.bin").unlink()
                (src / "link.bin").symlink_to(secret)
                marker.touch()
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return original(*args, **kwargs)

    monkeypatch.setattr(run_module, executor, changing)


@pytest.mark.parametrize(
    ("mode", "executor"), [("shard", "copy_direct"), ("replicate", "copy_broadcast")]
)
def test_a_source_gone_or_no_longer_a_file_is_skipped_never_followed(
    comm, shared_tmp, monkeypatch, mode, executor
):
    src = shared_tmp / "pfs" / "data"
    secret = shared_tmp / "secret"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        secret.write_bytes(b"not part of the dataset")
        for i in range(6):
            (src / f"keep{i}.bin").write_bytes(bytes([i]) * 5000)
        for name in CHANGED:
            (src / name).write_bytes(b"a sample" * 100)
    comm.Barrier()
    _change_sources_once(comm, src, secret, monkeypatch, executor)
    dst = shared_tmp / "bb" / "{node}" / "data"
    summary = bbio.stage_in(comm, src, dst, mode=mode, config=two_nodes(comm, shared_tmp))
    skipped = {s.path: s.reason for s in summary.skipped}
    assert same_on_all_ranks(comm, sorted(skipped.items()))
    assert set(CHANGED) <= set(skipped), skipped
    assert all(skipped[name] == "removed during the copy" for name in CHANGED), skipped
    node = 0 if comm.Get_rank() < comm.Get_size() // 2 else 1
    copied = files_under(shared_tmp / "bb" / str(node) / "data")
    if mode == "replicate":
        assert sorted(copied) == [f"keep{i}.bin" for i in range(6)]
    assert not set(CHANGED) & set(copied)
    assert b"not part of the dataset" not in copied.values()
