"""The drain's commit bookkeeping, without MPI: the global view built from the
node records, and what a waiting rank learns from its node's journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from bbio import _native
from bbio.checkpoint import drain, layout
from bbio.checkpoint.globalview import describe_node_file, merge_descriptions, write_global_view
from bbio.checkpoint.writer import file_attrs
from bbio.errors import IntegrityError
from bbio.transfer import files


def write_node_file(path, step, node, ranks, state):
    """A node file as the writer lays it out, written with plain h5py."""
    attrs = file_attrs(step, 1.5, 4, 2, node, ranks, layout.PER_RANK, {}, {"lr": 0.1})
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        for rank in ranks:
            for key, value in state(rank).items():
                dataset = f.create_dataset(layout.rank_dataset(key, rank), data=value)
                dataset.attrs["crc32c"] = _native.crc32c(np.ascontiguousarray(value).view(np.uint8))


def state(rank):
    return {
        "weights": np.arange(12, dtype=np.float32).reshape(3, 4) + rank,
        "step": np.int64(100 + rank),  # a scalar: copied into the view, not mapped
        "empty": np.zeros((0, 3), dtype=np.float64),
    }


def test_global_view_is_built_from_the_node_descriptions_and_read_by_plain_h5py(tmp_path):
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        write_node_file(tmp_path / layout.node_filename(node), 7, node, ranks, state)
    descriptions = [describe_node_file(tmp_path / layout.node_filename(n), n) for n in (0, 1)]
    json.dumps(descriptions)  # it travels in the node records
    meta = merge_descriptions(descriptions, tmp_path)
    assert meta["rank_nodes"] == [0, 0, 1, 1]
    size, crc = write_global_view(tmp_path / drain.GLOBAL_VIEW, meta)
    assert (size, crc) == files.checksum_file(tmp_path / drain.GLOBAL_VIEW)
    with h5py.File(tmp_path / drain.GLOBAL_VIEW, "r") as f:
        assert int(f.attrs["step"]) == 7
        assert json.loads(f.attrs["user_attrs"]) == {"lr": 0.1}
        for rank in range(4):
            expected = state(rank)
            for key in expected:
                np.testing.assert_array_equal(f[layout.rank_dataset(key, rank)][()], expected[key])
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left


def test_node_files_of_different_steps_are_not_committed_together(tmp_path):
    write_node_file(tmp_path / layout.node_filename(0), 7, 0, [0, 1], state)
    write_node_file(tmp_path / layout.node_filename(1), 8, 1, [2, 3], state)
    descriptions = [describe_node_file(tmp_path / layout.node_filename(n), n) for n in (0, 1)]
    with pytest.raises(IntegrityError, match=r"step 8.*step 7"):
        merge_descriptions(descriptions, tmp_path)


def _status(journal, **status):
    files.write_json_atomic(journal / drain.STATUS, status)


def test_a_waiting_rank_learns_the_commit_from_its_node_journal(tmp_path):
    journal = tmp_path / ".journal"
    journal.mkdir()
    task = drain.Task("run", 5, 0, 2, str(tmp_path / "bb"), str(tmp_path / "pfs"), 2)
    drain.add_task(journal, task)
    assert drain.step_committed(journal, 5) is False  # queued
    drain.task_path(journal, 5).unlink()
    alive = os.getpid()
    _status(journal, pid=alive, state="idle", awaiting=[5], committed=[])
    assert drain.step_committed(journal, 5) is False  # drained, other nodes not yet
    _status(journal, pid=alive, state="idle", awaiting=[], committed=[4, 5])
    assert drain.step_committed(journal, 5) is True
    _status(journal, pid=alive, state=drain.STOPPED, awaiting=[5], committed=[])
    assert drain.step_committed(journal, 5) is None  # nobody polls: ask the PFS
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE
    )
    _status(journal, pid=int(gone.stdout), state="idle", awaiting=[5], committed=[])
    assert drain.step_committed(journal, 5) is None  # the drain died
    _status(journal, pid=alive, state="idle", awaiting=[], committed=[])
    assert drain.step_committed(journal, 5) is None  # a restarted drain never saw it
