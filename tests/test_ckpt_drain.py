"""The drain's commit bookkeeping, without MPI: the global view built from the
node records, and what a waiting rank learns from its node's journal."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from bbio import _native
from bbio.bench import fs_type
from bbio.checkpoint import admin, drain, layout, restore
from bbio.checkpoint.globalview import describe_node_file, global_view, merge_descriptions
from bbio.checkpoint.writer import file_attrs
from bbio.errors import BBIOError, IntegrityError, UsageError
from bbio.transfer import files


def write_node_file(path, step, node, ranks, state, when=1.5, user_attrs=None):
    """A node file (of the save at ``when``) as the writer lays it out, with plain h5py."""
    user_attrs = {"lr": 0.1} if user_attrs is None else user_attrs
    attrs = file_attrs(step, when, 4, 2, node, ranks, layout.PER_RANK, {}, user_attrs)
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        crcs = {}
        for rank in ranks:
            for key, value in state(rank).items():
                name = layout.rank_dataset(key, rank)
                f.create_dataset(name, data=value)
                crcs[name] = _native.crc32c(np.ascontiguousarray(value).view(np.uint8))
        f.attrs[layout.CRC_ATTR] = json.dumps(crcs)


def state(rank):
    return {
        "weights": np.arange(12, dtype=np.float32).reshape(3, 4) + rank,
        "step": np.int64(100 + rank),  # a scalar: mapped like any array
        "empty": np.zeros((0, 3), dtype=np.float64),
    }


def test_global_view_is_built_from_the_node_descriptions_and_read_by_plain_h5py(tmp_path):
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        write_node_file(tmp_path / layout.node_filename(node), 7, node, ranks, state)
    descriptions = [describe_node_file(tmp_path / layout.node_filename(n), n) for n in (0, 1)]
    json.dumps(descriptions)  # it travels in the node records
    meta = merge_descriptions(descriptions, tmp_path)
    assert meta["rank_nodes"] == [0, 0, 1, 1]
    image, crc = global_view(meta)
    (tmp_path / drain.GLOBAL_VIEW).write_bytes(image)
    assert (len(image), crc) == files.checksum_file(tmp_path / drain.GLOBAL_VIEW)
    with h5py.File(tmp_path / drain.GLOBAL_VIEW, "r") as f:
        assert int(f.attrs["step"]) == 7
        assert json.loads(f.attrs["user_attrs"]) == {"lr": 0.1}
        for rank in range(4):
            expected = state(rank)
            for key in expected:
                np.testing.assert_array_equal(f[layout.rank_dataset(key, rank)][()], expected[key])


def wider_state(rank):
    return {**state(rank), "weights": np.arange(20, dtype=np.float32).reshape(4, 5) - rank}


def test_each_global_view_carries_its_own_save_and_layout(tmp_path):
    # The views of one layout share their virtual datasets (built once per
    # process); each must still hold its own save's attributes, and a new
    # layout its own datasets.
    saves = [(7, 1.5, 0.1, state), (8, 2.5, 0.2, state), (9, 3.5, 0.3, wider_state)]
    for step, when, lr, state_of in saves:
        step_dir = tmp_path / layout.step_dirname(step)
        step_dir.mkdir()
        for node, ranks in ((0, [0, 1]), (1, [2, 3])):
            path = step_dir / layout.node_filename(node)
            write_node_file(path, step, node, ranks, state_of, when, {"lr": lr})
        descriptions = [describe_node_file(step_dir / layout.node_filename(n), n) for n in (0, 1)]
        image, _ = global_view(merge_descriptions(descriptions, step_dir))
        (step_dir / drain.GLOBAL_VIEW).write_bytes(image)
    for step, when, lr, state_of in saves:
        with h5py.File(tmp_path / layout.step_dirname(step) / drain.GLOBAL_VIEW, "r") as f:
            assert (int(f.attrs["step"]), float(f.attrs["time"])) == (step, when)
            assert json.loads(f.attrs["user_attrs"]) == {"lr": lr}
            assert int(f.attrs["ranks"]) == 4
            for rank in range(4):
                for key, expected in state_of(rank).items():
                    np.testing.assert_array_equal(f[layout.rank_dataset(key, rank)][()], expected)


def test_node_files_of_different_steps_are_not_committed_together(tmp_path):
    write_node_file(tmp_path / layout.node_filename(0), 7, 0, [0, 1], state)
    write_node_file(tmp_path / layout.node_filename(1), 8, 1, [2, 3], state)
    descriptions = [describe_node_file(tmp_path / layout.node_filename(n), n) for n in (0, 1)]
    with pytest.raises(IntegrityError, match=r"not of one save.*step 8.*7"):
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


def two_node_save(bb_root, step, when, pfs_root=None, keep_pfs=5, elements=5):
    """Both nodes' files of one save of checkpointer "run" in their burst buffers
    (``bb_root``/NODE), each rank's array "w" of ``elements`` values, recorded and
    queued for ``pfs_root`` (default: ``pfs`` beside ``bb_root``); returns the nodes'
    journals."""
    journals = []
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        ckpt_dir = bb_root / str(node) / layout.CKPT_DIR / "run"
        step_dir = ckpt_dir / layout.step_dirname(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        write_node_file(
            step_dir / layout.node_filename(node),
            step,
            node,
            ranks,
            lambda rank: {"w": np.full(elements, when + rank)},
            when,
            user_attrs={},
        )
        record = {"size": 0, "crc32c": None, "node": node, "time": when, "complete": True}
        files.write_json_atomic(step_dir / layout.node_record_name(node), record)
        journal = drain.journal_dir(ckpt_dir)
        journal.mkdir(exist_ok=True)
        pfs_step = (pfs_root or bb_root.parent / "pfs") / layout.step_dirname(step)
        task = drain.Task(
            "run", step, node, 2, str(step_dir), str(pfs_step), keep_pfs, 2, "cache", when
        )
        drain.add_task(journal, task)
        journals.append(journal)
    return journals


def test_drains_commit_one_save_and_report_it_to_waiting_ranks(tmp_path):
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0  # node 1 not drained yet
    assert drain.read_manifest(pfs_step) is None
    assert drain.read_status(j0)["awaiting"] == [7]
    assert drain.step_committed(j0, 7) is None  # that drain stopped: ask the PFS
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    assert drain.read_manifest(pfs_step)["time"] == 1.5
    assert drain.read_status(j1)["committed"] == [7]
    assert drain.step_committed(j1, 7) is True
    with h5py.File(pfs_step / drain.GLOBAL_VIEW, "r") as f:
        np.testing.assert_array_equal(f[layout.rank_dataset("w", 3)][()], np.full(5, 4.5))


def resident_pages(path):
    """How many of ``path``'s pages are in the page cache (mincore of a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address != ctypes.c_void_p(-1).value, os.strerror(ctypes.get_errno())
        vector = ctypes.create_string_buffer((size + page - 1) // page)
        try:
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vector.raw)


@pytest.mark.parametrize("verify", ["cache", "device"])
def test_a_drained_copy_leaves_the_page_cache(tmp_path, verify):
    """The PFS copies are written, flushed and read back, then dropped from the page cache:
    left there, every drained checkpoint would hold memory the job needs."""
    if fs_type(tmp_path) == "tmpfs":
        pytest.skip("on tmpfs the page cache is the file")
    journals = two_node_save(tmp_path / "bb", 7, 1.5, elements=1 << 19)  # 4 MiB a rank
    for journal in journals:
        task_file = drain.task_path(journal, 7)
        task = json.loads(task_file.read_text())
        files.write_json_atomic(task_file, {**task, "verify": verify})
        assert drain.run(journal, None, finish=True, timeout=60) == 0
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.read_manifest(pfs_step) is not None
    for node in (0, 1):
        node_file = pfs_step / layout.node_filename(node)
        assert node_file.stat().st_size > 8 << 20
        assert resident_pages(node_file) == 0


def test_a_drain_awaiting_another_node_drops_its_copy_once_it_sees_the_commit(tmp_path):
    """A drain that was not the last keeps its copy cached while another node commits (no
    competing with the commit), and drops it once its looks find the manifest."""
    if fs_type(tmp_path) == "tmpfs":
        pytest.skip("on tmpfs the page cache is the file")
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5, elements=1 << 19)  # 4 MiB a rank
    node_file = tmp_path / "pfs" / layout.step_dirname(7) / layout.node_filename(0)
    draining = threading.Thread(target=drain.run, args=(j0, os.getpid(), False, None))
    draining.start()
    try:
        assert _wait_for(lambda: drain.read_status(j0).get("awaiting") == [7])
        assert resident_pages(node_file) > 0  # not dropped while another node commits
        assert drain.run(j1, None, finish=True, timeout=60) == 0
        assert _wait_for(lambda: drain.read_status(j0).get("committed") == [7], seconds=5)
        assert _wait_for(lambda: resident_pages(node_file) == 0, seconds=5)
    finally:
        (j0 / drain.STOP).touch()
        draining.join(60)
    assert not draining.is_alive()


def test_a_later_job_of_fewer_nodes_never_commits_a_checkpoint_of_more(tmp_path):
    """Node 1 never drained step 7; a one-node job of the same name then recorded its
    target (nodes 1): finishing node 0's journal must not commit node 0's file alone."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs = tmp_path / "pfs"
    pfs_step = pfs / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    drain.set_target(j0, pfs, nodes=1, keep_pfs=5)
    assert drain.try_commit(pfs_step, 1) is False
    assert drain.commit_ready(j0) == []
    assert drain.read_manifest(pfs_step) is None
    node0 = describe_node_file(pfs_step / layout.node_filename(0), 0)
    with pytest.raises(IntegrityError, match=r"are not those of ranks \[2, 3\]"):
        merge_descriptions([node0], pfs_step)


def files_unlike_the_manifest(step_dir: Path) -> list[str]:
    """The files of the committed checkpoint in ``step_dir`` whose size or CRC32C is not
    the manifest's."""
    return [
        entry["path"]
        for entry in drain.read_manifest(step_dir)["files"]
        if files.checksum_file(step_dir / entry["path"]) != (entry["size"], entry["crc32c"])
    ]


@pytest.mark.parametrize("left_queued", ["node 0", "both nodes"])
def test_an_earlier_jobs_task_never_drains_over_a_later_jobs_save(tmp_path, left_queued):
    """Job 1 saved step 7 (save 1.0) and was killed before (some of) its nodes drained it:
    their tasks stay in their burst buffers' journals.  Job 2, on other nodes, saved step
    7 again (2.0) and committed it.  Before, a later drain of job 1's journal (a job of the
    same name on that node, or its epilog run again) copied the old file over job 2's
    (the committed checkpoint torn), or, with both nodes' tasks left, committed the older
    save over the newer one."""
    pfs = tmp_path / "pfs"
    step_dir = pfs / layout.step_dirname(7)
    old = two_node_save(tmp_path / "bb-job-1", 7, 1.0, pfs_root=pfs)
    if left_queued == "node 0":
        assert drain.run(old[1], None, finish=True, timeout=60) == 0
    drain.uncommit(step_dir, 2)  # job 2's save of step 7 drops job 1's copy first
    for journal in two_node_save(tmp_path / "bb-job-2", 7, 2.0, pfs_root=pfs, elements=6):
        assert drain.run(journal, None, finish=True, timeout=60) == 0
    for journal in old[: 1 if left_queued == "node 0" else 2]:
        assert drain.run(journal, None, finish=True, timeout=60) == 0
        assert drain.pending(journal) == []  # done with: retired, not set aside
        bb_record = next(Path(journal).parent.glob("step-*/node-*.json"))
        assert files.read_json(bb_record)["retired"] is True
    assert drain.read_manifest(step_dir)["time"] == 2.0
    assert files_unlike_the_manifest(step_dir) == []
    for node in (0, 1):
        assert files.read_json(step_dir / layout.node_record_name(node))["time"] == 2.0


def test_a_step_saved_again_while_draining_is_never_committed_from_mixed_saves(tmp_path):
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    old_task = drain.pending(j0)[0]
    two_node_save(tmp_path / "bb", 7, 2.5)  # saved again before the drain took the old task
    assert drain._begin(j0, old_task) is None  # stale: left to the new task
    assert drain.pending(j0)[0].save_time == 2.5
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert not (pfs_step / layout.node_record_name(0)).exists()
    # node 1 drained the old save before it was saved again: its record is of 1.5
    drain.start_copy(dataclasses.replace(drain.pending(j1)[0], save_time=None)).finish(j1)
    files.write_json_atomic(
        pfs_step / layout.node_record_name(1),
        {**files.read_json(pfs_step / layout.node_record_name(1)), "time": 1.5},
    )
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert drain.try_commit(pfs_step, 2) is False  # 2.5 on node 0, 1.5 on node 1
    assert drain.read_manifest(pfs_step) is None
    assert drain.run(j1, None, finish=True, timeout=60) == 0  # node 1's new task
    assert drain.read_manifest(pfs_step)["time"] == 2.5


def test_a_task_whose_record_is_of_another_save_is_set_aside_not_retried(tmp_path):
    """The queued task and the node's burst-buffer record disagree on the save (a record
    changed by hand, or damaged): no copy can ever be made, and the drain must not spin."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    record = task.source.parent / layout.node_record_name(0)
    files.write_json_atomic(record, {**files.read_json(record), "time": 9.5})
    start = time.monotonic()
    assert drain.run(j0, None, finish=True, timeout=30) == 1  # set aside, said
    assert time.monotonic() - start < 10
    assert "not of the queued save" in drain.set_aside(j0)[7]["why"]


def test_a_copy_of_a_file_saved_again_meanwhile_never_replaces_the_pfs_file(tmp_path):
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    # saved again after the drain took the task: the new file is in place on the
    # BB (its record not yet), and already on the PFS (written there directly)
    new_save = task.source.parent / "new.h5"
    write_node_file(new_save, 7, 0, [0, 1], lambda rank: {"w": np.full(5, 9.0)}, 2.5, {})
    new_save.replace(task.source)
    task.target.parent.mkdir(parents=True)
    task.target.write_bytes(b"the new save's file")
    copying = drain.start_copy(task)  # the BB record is still the old save's
    assert copying is not None and copying.finish(j0) is None
    assert task.target.read_bytes() == b"the new save's file"
    assert not (task.target.parent / layout.node_record_name(0)).exists()
    assert not list(task.target.parent.glob("*bbio-part"))  # neither copy nor record left


def test_a_copy_goes_to_the_final_name_when_free_else_under_its_temporary_name(tmp_path):
    """A node file goes to its final name when no file is there (nothing to rename), and
    a copy given up (its file saved again meanwhile) deletes what it made there.  With a
    file there (another's, left behind), it goes under its temporary name and replaces
    that file once verified."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    copying = drain.start_copy(task)
    assert copying.written == task.target and not files.temp_path(task.target).exists()
    record = task.source.parent / layout.node_record_name(0)
    files.write_json_atomic(record, {**files.read_json(record), "time": 2.5})  # saved again
    assert copying.finish(j0) is None
    assert not task.target.exists() and not list(task.target.parent.iterdir())
    j0, j1 = two_node_save(tmp_path / "bb", 7, 2.5, elements=7)  # saved again, both nodes
    task.target.write_bytes(b"a file another process left there")
    copying = drain.start_copy(drain.pending(j0)[0])
    assert copying.written == files.temp_path(task.target)
    assert copying.finish(j0) is not None and not copying.written.exists()
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    manifest = drain.read_manifest(task.target.parent)
    assert manifest["time"] == 2.5
    for entry in manifest["files"]:  # node 0's file is the new save's, whole
        restore.verify_file(task.target.parent / entry["path"], entry["size"], entry["crc32c"])


def test_a_copy_under_its_temporary_name_is_renamed_while_the_records_are_locked(
    tmp_path, monkeypatch
):
    """The rename over a file already at the node file's name happens under the node's
    records lock, after the BB record is checked: a save that drops the record (under
    the same lock) before it writes the step again, straight to the PFS, is never
    overwritten by the older save's copy."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    (task,) = drain.pending(j0)
    task.target.parent.mkdir(parents=True)
    task.target.write_bytes(b"a file another process left there")
    held = []
    rename_sealed = files.rename_sealed

    def watched(finals):
        fd = os.open(j0 / drain.RECORDS_LOCK, os.O_RDWR)
        try:  # a lock of another open file description: refused while the drain holds it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        rename_sealed(finals)

    monkeypatch.setattr(files, "rename_sealed", watched)
    copying = drain.start_copy(task)
    assert copying.written == files.temp_path(task.target)
    assert copying.finish(j0, publish=False) is not None
    assert held == [True]


def test_a_copy_given_up_leaves_a_file_renamed_over_its_own_in_place(tmp_path):
    """What a given-up copy made at the final name is deleted only while the name is still
    that file's: a file renamed there since (a direct save's) stays."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    copying = drain.start_copy(task)
    assert copying.written == task.target
    other = task.target.with_name("other")
    other.write_bytes(b"another save's file")
    other.replace(task.target)
    copying.abandon()
    assert task.target.read_bytes() == b"another save's file"


def test_a_source_gone_before_its_copy_makes_no_file_on_the_pfs(tmp_path):
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    task.source.unlink()
    with pytest.raises(BBIOError) as info:
        drain.start_copy(task)
    assert str(task.source) in str(info.value)
    assert not list(task.target.parent.iterdir())


def test_the_last_node_commits_before_it_publishes_its_record(tmp_path, monkeypatch):
    """A node that finds every other node's record on the PFS commits at once, and renames
    its own record into place after the manifest (a rename off the commit's path); a node
    that is not the last publishes its record first.  The node files were written at
    their final names: nothing else is renamed."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    renamed = []
    rename_sealed = files.rename_sealed

    def watched(finals):
        committed = drain.read_manifest(pfs_step) is not None
        renamed.extend((Path(final).name, committed) for final in finals)
        rename_sealed(finals)

    monkeypatch.setattr(files, "rename_sealed", watched)
    assert drain.run(j0, None, finish=True, timeout=60) == 0  # node 1 not drained yet
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    assert renamed == [(layout.node_record_name(0), False), (layout.node_record_name(1), True)]
    assert drain.read_manifest(pfs_step)["time"] == 1.5
    assert files.read_json(pfs_step / layout.node_record_name(1))["time"] == 1.5


def two_published_records(tmp_path, step=7, when=1.5):
    """Both nodes' copies of a save drained and their records published on the PFS, not
    committed: the step's PFS directory."""
    for journal in two_node_save(tmp_path / "bb", step, when):
        drain.start_copy(drain.pending(journal)[0]).finish(journal)
    return tmp_path / "pfs" / layout.step_dirname(step)


def test_a_commit_of_records_uncommitted_meanwhile_leaves_no_manifest(tmp_path, monkeypatch):
    """A committer read the records of save 1.5; before it takes the commit lock, the step
    is saved again and uncommitted (its records removed under the lock).  Its manifest
    of the old save is never renamed into place, and its temporary files go."""
    pfs_step = two_published_records(tmp_path)
    take = drain._take_commit_lock
    uncommitted = []

    def saved_again_first(step_dir):
        if not uncommitted:
            uncommitted.append(True)
            drain.uncommit(step_dir, 2)
        return take(step_dir)

    monkeypatch.setattr(drain, "_take_commit_lock", saved_again_first)
    assert drain.try_commit(pfs_step, 2, patience=0.0) is False
    assert uncommitted and drain.read_manifest(pfs_step) is None
    assert not [p.name for p in pfs_step.iterdir() if p.name.startswith(".manifest")]
    assert not (pfs_step / drain.COMMIT_LOCK).exists()


def test_a_commit_of_a_known_record_no_longer_current_leaves_no_manifest(tmp_path):
    """The last node commits with its own record not yet published (``known``); if its
    burst buffer no longer records that save (dropped, to be saved again), no manifest."""
    pfs_step = two_published_records(tmp_path)
    mine = files.read_json(pfs_step / layout.node_record_name(1))
    (pfs_step / layout.node_record_name(1)).unlink()  # as if not yet published
    assert not drain.try_commit(pfs_step, 2, {1: mine}, patience=0.0, known_current=lambda: False)
    assert drain.read_manifest(pfs_step) is None
    assert drain.try_commit(pfs_step, 2, {1: mine}, patience=0.0, known_current=lambda: True)
    assert drain.read_manifest(pfs_step)["time"] == 1.5


def test_uncommit_waits_for_a_commit_holding_the_lock_then_removes_it(tmp_path, monkeypatch):
    """A save of the step made again while a commit holds the lock: the uncommit waits
    for the lock, so the manifest it removes is never renamed in after it."""
    pfs_step = two_published_records(tmp_path)
    write = drain._write_view_then_manifest
    waiting: list[threading.Thread] = []

    def slow_write(*args):
        uncommitting = threading.Thread(target=drain.uncommit, args=(pfs_step, 2))
        uncommitting.start()
        waiting.append(uncommitting)
        time.sleep(0.3)  # the uncommit waits on the lock meanwhile
        assert uncommitting.is_alive()
        return write(*args)

    monkeypatch.setattr(drain, "_write_view_then_manifest", slow_write)
    assert drain.try_commit(pfs_step, 2, patience=0.0)
    waiting[0].join(10)
    assert not waiting[0].is_alive()
    assert drain.read_manifest(pfs_step) is None
    assert not [p for p in pfs_step.glob("*.json") if p.name.startswith("node-")]


def test_a_drain_s_own_save_is_current_until_its_burst_buffer_drops_it(tmp_path):
    """What the last node tells its commit about its own, unpublished record."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    (task,) = drain.pending(j0)
    assert drain._still_saved(task)
    files.write_json_atomic(task.bb_record, {**files.read_json(task.bb_record), "time": 2.5})
    assert not drain._still_saved(task)  # saved again
    task.bb_record.unlink()
    assert not drain._still_saved(task)  # dropped for a save to come


def _watch_the_step(monkeypatch, events):
    """Record in ``events`` the renames of records into place ("publish"), directory
    fsyncs, commit locks taken and tasks taken out of a journal, in order."""
    fsync_dirs, rename_sealed = files.fsync_dirs, files.rename_sealed
    take_lock, unqueue = drain._take_commit_lock, drain._unqueue

    def fsynced(directories):
        fsync_dirs(directories)
        events.extend(("fsync", Path(d).name) for d in directories)

    def renamed(finals):
        rename_sealed(finals)
        events.extend(("publish", Path(f).name) for f in finals)

    def locked(step_dir):
        lock = take_lock(step_dir)
        events.append(("lock", lock is not None))
        return lock

    def unqueued(journal, task):
        events.append(("unqueue", task.node))
        return unqueue(journal, task)

    monkeypatch.setattr(files, "fsync_dirs", fsynced)
    monkeypatch.setattr(files, "rename_sealed", renamed)
    monkeypatch.setattr(drain, "_take_commit_lock", locked)
    monkeypatch.setattr(drain, "_unqueue", unqueued)


def test_a_node_that_is_not_the_last_makes_its_renames_durable_before_its_task_leaves(
    tmp_path, monkeypatch
):
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    events = []
    _watch_the_step(monkeypatch, events)
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    published = events.index(("publish", layout.node_record_name(0)))
    assert ("fsync", pfs_step.name) in events[published : events.index(("unqueue", 0))]


def test_ranks_learn_of_a_commit_from_the_status_and_a_re_save_then_keeps_its_record(
    tmp_path, monkeypatch
):
    """The last node's waiting ranks learn of the commit from the status, which names
    the save, while the drain still holds the task (and the commit lock, and has not
    published its record).  A rank that saves the step again right then drops the old
    copies (as ``save`` does: the PFS records, then the node's BB record and task under
    the records lock) and writes its own record: the old drain never renames its record
    over it."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0  # not the last: awaits
    task = drain.pending(j1)[0]
    record_path = pfs_step / layout.node_record_name(1)
    seen = []
    settle = drain._Commits.settle

    def saved_again_at_once(commits, settled, done):
        settle(commits, settled, done)
        seen.append(
            (
                drain.step_committed(j1, 7, 1.5),
                drain.step_committed(j1, 7, 2.5),
                drain.task_path(j1, 7).exists(),
                os.path.lexists(pfs_step / drain.COMMIT_LOCK),
                record_path.exists(),
            )
        )
        for n in range(2):  # rank 0 uncommits the step, then each node leader drops its copy
            (pfs_step / layout.node_record_name(n)).unlink(missing_ok=True)
        drain.manifest_path(pfs_step).unlink()
        with drain.records_locked(j1):
            for name in layout.node_copy_names(1):
                (Path(task.bb_step_dir) / name).unlink()
            drain.task_path(j1, 7).unlink()
        files.write_json_atomic(record_path, {"node": 1, "time": 2.5})  # the new save's

    monkeypatch.setattr(drain._Commits, "settle", saved_again_at_once)
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    assert seen == [(True, False, True, True, False)]
    assert files.read_json(record_path) == {"node": 1, "time": 2.5}
    assert not files.temp_path(record_path).exists()


def test_a_rank_that_read_the_status_before_the_drain_settled_reads_it_again(tmp_path, monkeypatch):
    """Step 7 was committed by save 1.5 and saved again (2.5).  A rank waiting for 2.5
    reads the status, which still reports 1.5 committed; the drain then reports 7
    awaited and takes 2.5's task out.  Finding no task, the rank reads the status again:
    not committed (the status it read first was older than the task's look)."""
    journal = tmp_path / "journal"
    journal.mkdir()
    drain._write_status(journal, committed=[7], committed_saves={"7": 1.5}, awaiting=[])
    task_file = drain.task_path(journal, 7)
    task_file.write_text("{}")
    read_status = drain.read_status
    reads = []

    def settled_meanwhile(path):
        status = read_status(path)
        if not reads:
            drain._write_status(journal, committed=[], committed_saves={}, awaiting=[7])
            task_file.unlink()
        reads.append(status)
        return status

    monkeypatch.setattr(drain, "read_status", settled_meanwhile)
    assert drain.step_committed(journal, 7, 2.5) is False
    assert len(reads) == 2


def test_a_save_replaced_before_its_record_is_published_is_left_to_the_new_one(
    tmp_path, monkeypatch
):
    """Node 0 (not the last) has copied step 7's save 1.5 when the step is saved again:
    the save drops node 0's BB record and task under the records lock.  The drain then
    neither publishes the old record (it deletes its temporary file), nor looks again,
    nor awaits the old save; a replay of such a copy does not publish either."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    record_path = task.target.parent / layout.node_record_name(0)
    events = []
    _watch_the_step(monkeypatch, events)
    publish = drain._publish

    def saved_again_first(publishing):
        with drain.records_locked(j0):
            for name in layout.node_copy_names(0):
                (Path(task.bb_step_dir) / name).unlink()
            drain.task_path(j0, 7).unlink()
        return publish(publishing)

    monkeypatch.setattr(drain, "_publish", saved_again_first)
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert not record_path.exists() and not files.temp_path(record_path).exists()
    assert ("lock", True) not in events and ("lock", False) not in events
    assert drain.read_status(j0)["awaiting"] == []


def test_two_nodes_that_finish_together_commit_at_the_second_look(tmp_path, monkeypatch):
    """Node 0 looks for node 1's record before node 1 has published it, node 1 for node
    0's likewise: both publish, look again, and the second look commits, with no
    directory fsync before it (the commit's, before the manifest, covers the renames)."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    publish = drain.NodeCopy.publish
    node1 = drain.start_copy(drain.pending(j1)[0])
    assert node1.finish(j1, publish=False) is not None
    assert drain.try_commit(pfs_step, 2, {1: node1.pfs_record}) is False  # node 0's missing

    def together(copying):
        publish(node1)  # node 1 publishes while node 0 publishes
        return publish(copying)

    monkeypatch.setattr(drain.NodeCopy, "publish", together)
    events = []
    _watch_the_step(monkeypatch, events)
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert drain.read_manifest(pfs_step)["time"] == 1.5
    assert drain.read_status(j0)["committed"] == [7]
    published = events.index(("publish", layout.node_record_name(0)))
    assert ("fsync", pfs_step.name) not in events[published : events.index(("lock", True))]


def test_a_failed_commit_publishes_the_record_and_its_retry_copies_nothing(tmp_path, monkeypatch):
    """The last node's commit fails once (the PFS): its record is published anyway, so
    the other nodes' looks and the epilog can commit the step, and the retry commits it
    without copying the file again."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0  # not the last: awaits
    copies = []
    copy_whole = _native.copy_whole
    monkeypatch.setattr(
        _native, "copy_whole", lambda *a, **k: copies.append(1) or copy_whole(*a, **k)
    )
    write = drain._write_view_then_manifest
    published = []  # node 1's record on the PFS: when its commit failed, at its next try

    def failing_once(step_dir, *rest):
        if not published:
            published.append((pfs_step / layout.node_record_name(1)).exists())
            raise BBIOError("cannot write: Input/output error", path=step_dir / "global.h5")
        return write(step_dir, *rest)

    monkeypatch.setattr(drain, "_write_view_then_manifest", failing_once)
    begin = drain._begin

    def trying(journal, task, retry=False):
        if published:  # the try after the failed one: meanwhile the others may commit it
            published.append((pfs_step / layout.node_record_name(1)).exists())
        return begin(journal, task, retry)

    monkeypatch.setattr(drain, "_begin", trying)
    assert drain.run(j1, None, finish=True, timeout=60) == 0  # tried again after 1 s
    assert published == [False, True]  # the commit came before the record's rename, then it
    assert drain.read_manifest(pfs_step)["time"] == 1.5
    assert len(copies) == 1


def test_a_drain_killed_before_it_published_its_record_publishes_it_when_replayed(tmp_path):
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    record_path = task.target.parent / layout.node_record_name(0)
    assert drain.start_copy(task).finish(j0, publish=False) is not None  # then killed
    assert not record_path.exists()
    replayed = drain.start_copy(task)
    assert replayed.drained is not None and replayed.finish(j0) == replayed.drained
    assert files.read_json(record_path)["crc32c"] == replayed.drained["crc32c"]
    record_path.replace(files.temp_path(record_path))  # unpublished again, then saved again:
    bb_record = Path(task.bb_step_dir) / layout.node_record_name(0)  # the new save's record
    files.write_json_atomic(bb_record, {**files.read_json(bb_record), "time": 2.5})
    assert drain._publish(task) is False  # a replay's rename goes through the same check
    assert not record_path.exists() and not files.temp_path(record_path).exists()


def test_a_replay_copies_again_when_the_file_in_place_is_not_the_size_recorded(tmp_path):
    """Drained, verified and recorded on the burst buffer, but the PFS then lost the rename
    of the copy (a crash before its directory was durable) and an older file of the step
    is at its name: a replay took that file for the copy (it looked only whether one was
    there), so the step could be committed with the new CRC32C over the old bytes."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    assert drain.start_copy(task).finish(j0) is not None
    task.target.write_bytes(b"an older save's node file")
    replayed = drain.start_copy(task)
    assert replayed.drained is None  # copied again
    replayed.finish(j0)
    assert files.checksum_file(task.target) == files.checksum_file(task.source)


def test_global_view_is_made_in_place_durably_and_renamed_over_an_older_save_s(
    tmp_path, monkeypatch
):
    """A first commit writes ``global.h5`` at its final name, fsyncs the step's directory
    (the view's and the node files' names) and only then renames the manifest: nothing
    else is renamed.  A commit of a newer save of the step, with the older one's view
    there, writes its view under a temporary name and renames it before the manifest."""
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    events = []
    fsync_dirs, replace = files.fsync_dirs, os.replace

    def fsynced(directories):
        fsync_dirs(directories)
        events.extend(("fsync", Path(d).name) for d in directories)

    def renamed(source, target):
        replace(source, target)
        events.append(("rename", Path(target).name))

    monkeypatch.setattr(files, "fsync_dirs", fsynced)
    monkeypatch.setattr(os, "replace", renamed)
    for save in (1.5, 2.5):
        j0, j1 = two_node_save(tmp_path / "bb", 7, save)
        for journal in (j0, j1):
            assert drain.start_copy(drain.pending(journal)[0]).finish(journal) is not None
        events.clear()
        assert drain.try_commit(pfs_step, 2) is True
        renames = [name for what, name in events if what == "rename"]
        manifest_at = events.index(("rename", drain.MANIFEST))
        assert ("fsync", pfs_step.name) in events[:manifest_at]
        if save == 1.5:
            assert renames == [drain.MANIFEST]
        else:
            assert renames == [drain.GLOBAL_VIEW, drain.MANIFEST]
        manifest = drain.read_manifest(pfs_step)
        assert manifest["time"] == save
        view = next(f for f in manifest["files"] if f["path"] == drain.GLOBAL_VIEW)
        assert files.checksum_file(pfs_step / drain.GLOBAL_VIEW) == (view["size"], view["crc32c"])
        assert not [p.name for p in pfs_step.iterdir() if files.is_temp_name(p.name)]


def test_a_manifest_of_an_older_save_is_replaced(tmp_path):
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    for journal in (j0, j1):
        drain.run(journal, None, finish=True, timeout=60)
    stale = drain.read_manifest(pfs_step)
    j0, j1 = two_node_save(tmp_path / "bb", 7, 2.5)
    for journal in (j0, j1):
        drain.run(journal, None, finish=True, timeout=60)
    files.write_json_atomic(drain.manifest_path(pfs_step), stale)  # a late old committer
    assert drain.try_commit(pfs_step, 2) is True
    assert drain.read_manifest(pfs_step)["time"] == 2.5


def test_a_commit_lock_just_created_by_another_node_is_waited_for_not_an_error(tmp_path):
    """Another node's committer has just created the lock (its owner not yet written into
    it): the last node's drain leaves the commit to it and awaits the step.  That owner
    then gives the lock up without committing: the drain's looks find the lock gone and
    commit (before, nobody did, and the step's handles waited for ever)."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    lock = pfs_step / drain.COMMIT_LOCK
    os.symlink(json.dumps({"host": "another-node", "pid": 1}), lock)
    background = threading.Thread(target=drain.run, args=(j1, os.getpid(), False, None))
    background.start()
    try:
        deadline = time.monotonic() + 30
        while drain.read_status(j1).get("awaiting") != [7]:
            assert time.monotonic() < deadline, drain.read_status(j1)
            time.sleep(0.05)
        assert drain.read_status(j1)["error"] is None
        time.sleep(0.5)
        assert drain.read_manifest(pfs_step) is None  # held: left to its owner
        lock.unlink()  # the owner gave up
        deadline = time.monotonic() + 10
        while 7 not in drain.read_status(j1).get("committed", ()):
            assert time.monotonic() < deadline, drain.read_status(j1)
            time.sleep(0.05)
        assert drain.read_status(j1)["committed_saves"] == {"7": None}  # of any save's records
    finally:
        (j1 / drain.STOP).touch()
        background.join(30)
    assert drain.read_manifest(pfs_step)["time"] == 1.5 and not background.is_alive()


def test_a_commit_lock_of_a_dead_committer_elsewhere_is_waited_out_then_taken(tmp_path):
    """Node 0's committer died on its host holding step 7's commit lock.  A commit waits
    until the lock is stale and commits (before, every drain gave up at once, the step
    stayed uncommitted and its handles waited for ever); with less patience than the
    lock has life left, it says it did not commit."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    for journal in (j0, j1):
        assert drain.start_copy(drain.pending(journal)[0]).finish(journal) is not None
    lock = pfs_step / drain.COMMIT_LOCK
    os.symlink(json.dumps({"host": "a-dead-node", "pid": 1}), lock)
    nearly_stale = time.time() - drain.STALE_LOCK_SECONDS + 1.5
    os.utime(lock, (nearly_stale, nearly_stale), follow_symlinks=False)
    assert drain.try_commit(pfs_step, 2, patience=0.2) is False
    assert drain.read_manifest(pfs_step) is None
    start = time.monotonic()
    assert drain.try_commit(pfs_step, 2) is True
    assert 1 <= time.monotonic() - start < 30
    assert drain.read_manifest(pfs_step)["time"] == 1.5 and not os.path.lexists(lock)


def test_a_commit_takes_the_records_its_caller_just_renamed_into_place(tmp_path):
    """The last node's drain commits with its own record in hand, as renamed on the PFS,
    and reads only the other nodes' records there."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    copying = drain.start_copy(drain.pending(j1)[0])
    assert copying.finish(j1) is not None
    record_path = pfs_step / layout.node_record_name(1)
    assert copying.pfs_record == files.read_json(record_path)
    record_path.unlink()
    assert drain.try_commit(pfs_step, 2) is False  # not every node's record is there
    assert drain.try_commit(pfs_step, 2, {1: copying.pfs_record}) is True
    assert drain.read_manifest(pfs_step)["files"][1]["crc32c"] == copying.pfs_record["crc32c"]


def test_a_commit_is_reported_under_its_lock_and_a_repeated_one_renames_nothing(tmp_path):
    """The committer reports the commit while it still holds the commit lock (its ranks
    learn it sooner); a commit of a step committed before leaves the manifest and no
    temporary file; a damaged manifest is replaced; with the lock held by another node,
    a committed step is still reported."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    pfs_step = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 0  # node 1 not copied yet
    assert drain.start_copy(drain.pending(j1)[0]).finish(j1) is not None
    lock = pfs_step / drain.COMMIT_LOCK
    seen = []

    def report():
        seen.append((os.path.lexists(lock), drain.committed_save(pfs_step, 1.5)))

    assert drain.try_commit(pfs_step, 2, on_commit=report) is True
    assert seen == [(True, True)] and not os.path.lexists(lock)
    manifest = drain.manifest_path(pfs_step)
    first = manifest.stat().st_ino
    assert drain.try_commit(pfs_step, 2, on_commit=report) is True
    assert seen[1] == (True, True) and manifest.stat().st_ino == first
    assert not [p.name for p in pfs_step.iterdir() if files.is_temp_name(p.name)]
    for damage in ("{garbage", "[]", "null"):  # JSON, but not an object: damaged too
        manifest.write_text(damage)
        assert drain.committed_steps(pfs_step.parent) == []
        assert drain.try_commit(pfs_step, 2) is True
        assert drain.read_manifest(pfs_step)["time"] == 1.5
    os.symlink(json.dumps({"host": "another-node", "pid": 1}), lock)  # just taken
    assert drain.try_commit(pfs_step, 2, on_commit=report) is True and len(seen) == 3


def test_the_drain_knows_whether_it_made_the_steps_directory(tmp_path):
    """A directory the drain made holds no other node's marker: it is not looked in."""
    step_dir = tmp_path / "pfs" / "run" / layout.step_dirname(7)
    assert drain._make_step_dir(step_dir) is True
    assert drain._make_step_dir(step_dir) is False
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(BBIOError, match="a-file"):
        drain._make_step_dir(tmp_path / "a-file" / layout.step_dirname(7))


def test_looks_for_damaged_markers_are_fewer_than_looks_for_commits(tmp_path):
    """While a commit is awaited, the manifest is looked for every 5 ms at first, another
    node's damaged-file marker at most every 50 ms."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    pfs_step = Path(task.pfs_step_dir)
    pfs_step.mkdir(parents=True)
    commits = drain._Commits(j0)
    commits.settle(task, False)
    commits.next_look = 0.0
    first = time.monotonic()
    commits.look()  # nothing yet
    files.write_json_atomic(drain.damaged_on_pfs(pfs_step), {"time": 1.5, "node": 1, "why": "x"})
    commits.next_look = 0.0
    commits.look()  # within 50 ms of the last look for markers: only the manifest
    if time.monotonic() - first < drain.AWAIT_POLL_SECONDS[1]:  # not on a stalled machine
        assert commits.damaged_elsewhere == {} and commits.awaiting.keys() == {7}
    time.sleep(drain.AWAIT_POLL_SECONDS[1])
    commits.next_look = 0.0
    commits.look()
    assert commits.damaged_elsewhere[7]["node"] == 1 and commits.awaiting == {}


def test_an_idle_drain_wakes_up_when_a_task_is_added(tmp_path):
    journal = tmp_path / "journal"
    journal.mkdir()
    drain.wake(journal)  # no drain waits: nothing to do, nothing raised
    waker = drain._Waker(journal)
    try:
        threading.Timer(0.2, drain.wake, [journal]).start()
        start = time.monotonic()
        waker.pause(30)
        assert time.monotonic() - start < 15
        start = time.monotonic()
        waker.pause(0.3)  # the wake-up was consumed: this pause lasts
        assert time.monotonic() - start >= 0.25
    finally:
        waker.close()
    (journal / drain.WAKE).unlink()
    (journal / drain.WAKE).write_text("not a FIFO")
    squatted = drain._Waker(journal)  # falls back to sleeping, never spins on the file
    start = time.monotonic()
    squatted.pause(0.3)
    assert time.monotonic() - start >= 0.25


def test_a_waiting_process_is_told_of_each_status_and_each_task_that_leaves(tmp_path):
    (journal,) = two_node_save(tmp_path / "bb", 7, 1.5)[:1]
    waiters = journal / drain.WAITERS
    waiter = drain.StatusWaiter(journal)
    try:
        assert waiter.notified and len(list(waiters.iterdir())) == 1
        threading.Timer(0.2, drain._write_status, [journal], {"state": "idle"}).start()
        start = time.monotonic()
        waiter.pause(30)
        assert time.monotonic() - start < 15
        start = time.monotonic()
        waiter.pause(0.3)  # told once: this pause lasts
        assert time.monotonic() - start >= 0.25
        (task,) = drain.pending(journal)
        drain._remove_task(journal, task)  # the step may be done: it is not in the journal
        start = time.monotonic()
        waiter.pause(30)
        assert time.monotonic() - start < 15
    finally:
        waiter.close()
    assert list(waiters.iterdir()) == []
    os.mkfifo(waiters / "12345-gone")  # a waiter that died: nobody reads it
    os.mkfifo(waiters / ".12345-half")  # one whose maker died before it was listed
    old = time.time() - drain.HALF_MADE_WAITER_SECONDS - 5
    os.utime(waiters / ".12345-half", (old, old))
    os.mkfifo(waiters / ".12346-making")  # one being made now: left alone
    drain._write_status(journal, state="idle")
    assert [p.name for p in waiters.iterdir()] == [".12346-making"]


def test_a_waiter_whose_descriptor_is_above_1023_still_pauses(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("the open-files limit is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:  # as in a rank with many descriptors open
            held.append(os.open(os.devnull, os.O_RDONLY))
        waiter = drain.StatusWaiter(tmp_path)
        try:
            assert waiter.notified and waiter.fd is not None and waiter.fd > 1023
            drain._write_status(tmp_path, state="idle")
            start = time.monotonic()
            waiter.pause(30)  # select() would raise ValueError here
            assert time.monotonic() - start < 15
        finally:
            waiter.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_write_that_fails_names_its_file_and_leaves_no_temporary_file(tmp_path):
    import resource

    target = tmp_path / "status.json"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # writes beyond 16 bytes fail
    try:
        with pytest.raises(BBIOError, match=r"status\.json") as err:
            files.write_json_atomic(target, {"state": "a document longer than 16 bytes"})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "bbio-part" not in str(err.value) and list(tmp_path.iterdir()) == []
    assert files.is_temp_name(files.unique_temp_path(target).name)  # found by cleanups


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to unbind from one")
def test_the_background_drain_does_not_keep_its_starters_cpu_binding():
    code = (
        f"import os; os.sched_setaffinity(0, {{{min(os.sched_getaffinity(0))}}}); "
        "from bbio.checkpoint import drain; drain.run_on_any_cpu(); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == sorted(os.sched_getaffinity(0))


def test_layout_keys_tell_apart_what_a_rewrite_in_place_cannot_change():
    spec = {"w": {"shape": [3, 4], "dtype": "<f4", "bytes": 48}}
    key = layout.layout_key([(0, spec), (1, spec)], "0.1.0")
    assert key == layout.layout_key([(0, json.loads(json.dumps(spec))), (1, spec)], "0.1.0")
    w = spec["w"]
    others = [
        layout.layout_key([(0, spec), (2, spec)], "0.1.0"),  # another rank
        layout.layout_key([(0, {"w": {**w, "shape": [4, 3]}}), (1, spec)], "0.1.0"),
        layout.layout_key([(0, {"w": {**w, "dtype": ">f4"}}), (1, spec)], "0.1.0"),
        layout.layout_key([(0, {"w": {**w, "start": [0, 0], "global_shape": [6, 4]}})], "0.1.0"),
        layout.layout_key([(0, {"v": w}), (1, spec)], "0.1.0"),  # another key
        layout.layout_key([(0, spec), (1, spec)], "0.2.0"),  # another writer
    ]
    assert key not in others and len(set(others)) == len(others)


def _drained_copies(bb, pfs, spares: dict[int, dict | None]) -> None:
    """Node 0's drained BB copies of ``spares``' steps (file: ``step<N>``, 5 bytes), each
    recorded with its spare allowance (or none); step 9 committed on the PFS."""
    for step, spare in spares.items():
        step_dir = bb / layout.step_dirname(step)
        step_dir.mkdir(parents=True)
        (step_dir / layout.node_filename(0)).write_bytes(f"step{step}".encode())
        record = {"size": 5, "crc32c": 7, "node": 0, "complete": True, "spare": spare}
        files.write_json_atomic(step_dir / layout.node_record_name(0), record)
    committed = pfs / layout.step_dirname(9)
    committed.mkdir(parents=True, exist_ok=True)
    files.write_json_atomic(drain.manifest_path(committed), sound_manifest(9))


def test_trimming_keeps_one_spare_that_only_a_save_of_its_layout_claims(tmp_path):
    bb, pfs = tmp_path / "bb" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    journal = drain.journal_dir(bb)
    journal.mkdir(parents=True)
    fits, grown = {"layout_key": "bbbb", "max_bytes": 5}, {"layout_key": "cccc", "max_bytes": 4}
    _drained_copies(bb, pfs, {1: {"layout_key": "aaaa", "max_bytes": 5}, 2: fits, 3: fits})
    assert drain.trim_bb(bb, 0, 1, pfs, journal) == 0
    assert sorted(p.name for p in bb.glob("step-*")) == [layout.step_dirname(3)]
    spare = bb / layout.spare_filename(0, "bbbb")  # step 2's file; step 1's was dropped
    assert list(bb.glob(layout.spare_pattern())) == [spare]
    assert spare.read_bytes() == b"step2" and drain.spare_bytes(bb, 0) == 5
    target = bb / layout.step_dirname(4) / "node.tmp"
    target.parent.mkdir()
    assert not drain.claim_spare(bb, 0, "aaaa", target)  # another layout's
    assert drain.claim_spare(bb, 0, "bbbb", target) and target.read_bytes() == b"step2"
    assert not drain.claim_spare(bb, 0, "bbbb", target)  # none left
    _drained_copies(bb, pfs, {5: grown, 6: None})
    assert drain.trim_bb(bb, 0, 1, pfs, journal) == 0
    assert list(bb.glob(layout.spare_pattern())) == [spare]  # 5 grew past its allowance
    assert spare.read_bytes() == b"step3"
    assert not (bb / layout.step_dirname(5)).exists()


def sound_manifest(step: int, nodes: int = 1) -> dict:
    """The smallest manifest of ``step`` that counts as committed (no files behind it)."""
    files_listed = [layout.node_filename(n) for n in range(nodes)] + [drain.GLOBAL_VIEW]
    return {
        "format": drain.MANIFEST_FORMAT,
        "step": step,
        "time": 1.0,
        "ranks": nodes,
        "nodes": nodes,
        "layout": layout.PER_RANK,
        "rank_nodes": list(range(nodes)),
        "global_shapes": {},
        "attrs": {},
        "files": [{"path": path, "size": 1, "crc32c": 7} for path in files_listed],
    }


def _commit_on_pfs(pfs, step: int, manifest: str | None = None) -> None:
    step_dir = pfs / layout.step_dirname(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    document = manifest or json.dumps(sound_manifest(step))
    drain.manifest_path(step_dir).write_text(document)


def test_newest_committed_step_reads_manifests_newest_first(tmp_path, monkeypatch):
    pfs = tmp_path / "pfs" / "ckpt" / "run"
    assert drain.newest_committed_step(pfs) is None  # no directory yet
    for step in range(1, 11):
        _commit_on_pfs(pfs, step)
    _commit_on_pfs(pfs, 11, manifest="{damaged")  # does not count
    (pfs / layout.step_dirname(12)).mkdir()  # draining: no manifest
    read = []
    sound = drain._sound_manifest
    monkeypatch.setattr(drain, "_sound_manifest", lambda d: read.append(d.name) or sound(d))
    assert drain.newest_committed_step(pfs) == 10
    assert read == [layout.step_dirname(s) for s in (12, 11, 10)]
    assert drain.newest_committed_step(pfs, at_least=11) is None
    assert drain.committed_steps(pfs) == list(range(1, 11))


def test_trimming_reads_the_pfs_down_to_its_newest_commit_only(tmp_path, monkeypatch):
    bb, pfs = tmp_path / "bb" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    journal = drain.journal_dir(bb)
    journal.mkdir(parents=True)
    _drained_copies(bb, pfs, {10: None, 11: None, 12: None})  # also commits step 9
    for step in range(1, 12):  # steps kept on the PFS (keep_pfs)
        _commit_on_pfs(pfs, step)
    (pfs / layout.step_dirname(12)).mkdir()  # still draining
    read = []
    sound = drain._sound_manifest
    monkeypatch.setattr(drain, "_sound_manifest", lambda d: read.append(d.name) or sound(d))
    assert drain.trim_bb(bb, 0, 1, pfs, journal) == 0
    assert [p.name for p in bb.glob("step-*")] == [layout.step_dirname(12)]
    assert read == [layout.step_dirname(12), layout.step_dirname(11)]


def test_without_recycling_trimmed_files_are_deleted(tmp_path):
    bb, pfs = tmp_path / "bb" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    journal = drain.journal_dir(bb)
    journal.mkdir(parents=True)
    fits = {"layout_key": "aaaa", "max_bytes": 5}
    _drained_copies(bb, pfs, {1: fits, 2: fits})
    assert drain.trim_bb(bb, 0, 1, pfs, journal, recycle=False) == 0
    assert [p.name for p in bb.iterdir() if p != journal] == [layout.step_dirname(2)]
    bb_spare = bb / layout.spare_filename(0, "aaaa")
    bb_spare.write_bytes(b"old")
    drain.drop_spares(bb)
    assert not bb_spare.exists()


def test_node_files_with_a_crc_per_dataset_are_still_read(tmp_path):
    """Files of earlier bbio builds: a crc32c attribute on each dataset, none at the root."""
    path = tmp_path / layout.node_filename(0)
    write_node_file(path, 7, 0, [0, 1], state)
    with h5py.File(path, "r+") as f:
        for name, crc in json.loads(f.attrs[layout.CRC_ATTR]).items():
            f[name].attrs[layout.CRC_ATTR] = crc
        del f.attrs[layout.CRC_ATTR]
        del f[layout.rank_dataset("step", 1)].attrs[layout.CRC_ATTR]
    with pytest.raises(IntegrityError, match=r"dataset step/r00001 has no recorded CRC32C"):
        describe_node_file(path, 0)
    with h5py.File(path, "r+") as f:
        f[layout.rank_dataset("step", 1)].attrs[layout.CRC_ATTR] = _native.crc32c(
            np.int64(101).reshape(1).view(np.uint8)
        )
    entries = {(d["key"], d["rank"]): d["crc32c"] for d in describe_node_file(path, 0)["datasets"]}
    assert entries[("weights", 1)] == _native.crc32c(state(1)["weights"].view(np.uint8))
    assert restore.read_rank(path, 1)["step"] == 101
    with h5py.File(path, "r+") as f:
        f.attrs[layout.CRC_ATTR] = "{not json"
    with pytest.raises(IntegrityError, match=r"invalid 'crc32c' attribute.*node-00000\.h5"):
        describe_node_file(path, 0)


@pytest.mark.parametrize(
    "key", ["", "/w", "w/", "a//b", ".", "..", "./w", "a/./b", "a/..", "d/.", "w/r00001", 3]
)
def test_state_keys_hdf5_would_rewrite_or_that_clash_with_rank_datasets_are_refused(key):
    with pytest.raises(UsageError, match="invalid state key"):
        layout.check_key(key)


@pytest.mark.parametrize("key", ["w", "model/layer1.weight", "r1", "a/r1234", "ünï/cödé", "a.b"])
def test_ordinary_state_keys_are_accepted(key):
    assert layout.check_key(key) == key


def test_state_keys_nested_beyond_64_parts_are_refused():
    """A key of 3,000 parts was saved, and its checkpoint never committed: the drain's
    walk of the node file (HDF5's) slows with the cube of the nesting."""
    assert layout.check_key("/".join(["g"] * 64)) == "/".join(["g"] * 64)
    with pytest.raises(UsageError, match="has 65 parts joined by '/': at most 64"):
        layout.check_key("/".join(["g"] * 65))


def test_overlapping_boxes_are_found_but_replicas_and_empty_boxes_are_not():
    rows = [((0, 0), (3, 2)), ((3, 0), (3, 2)), ((6, 0), (3, 2))]
    assert layout.first_overlap(rows) is None
    assert layout.first_overlap([*rows, rows[1]]) is None  # a replica of rank 1's
    assert layout.first_overlap([*rows, ((5, 0), (0, 2))]) is None  # empty
    assert layout.first_overlap([*rows, ((2, 1), (2, 1))]) == (0, 3)
    columns = [((0, 0), (9, 1)), ((0, 1), (9, 1))]  # split along the second axis
    assert layout.first_overlap(columns) is None
    assert layout.first_overlap([*columns, ((8, 1), (1, 1))]) == (1, 2)
    whole = ((0, 0), (9, 2))
    assert layout.covers(whole, [*rows, rows[0]]) and not layout.covers(whole, rows[:2] * 2)


def test_a_task_that_keeps_failing_does_not_hold_back_the_later_ones(tmp_path):
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    two_node_save(tmp_path / "bb", 8, 2.5)
    pfs = tmp_path / "pfs"
    pfs.mkdir()
    (pfs / layout.step_dirname(7)).write_text("a file where step 7's directory goes")
    # tries at about 0, 1 and 3 s, and a last one at the deadline (the backoff says 7 s)
    started = time.monotonic()
    assert drain.run(j0, None, finish=True, timeout=6) == 1  # step 7 never drains
    assert time.monotonic() - started >= 6  # before, it gave up at 3 s
    assert drain.run(j1, None, finish=True, timeout=6) == 1
    assert drain.read_manifest(pfs / layout.step_dirname(8))["time"] == 2.5
    status = drain.read_status(j0)
    assert status["failing"] == [7] and status["retries"] >= 4, status
    assert str(pfs / layout.step_dirname(7)) in status["error"], status
    assert [t.step for t in drain.pending(j0)] == [7]  # retried by the next drain


def test_a_damaged_burst_buffer_file_is_set_aside_not_retried(tmp_path):
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    two_node_save(tmp_path / "bb", 8, 2.5)
    damaged = tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000007" / "node-00000.h5"
    damaged.write_bytes(b"not an HDF5 file" * 100)
    started = time.monotonic()
    assert drain.run(j0, None, finish=True, timeout=60) == 1  # at once: nothing to retry
    assert time.monotonic() - started < 30
    assert drain.run(j1, None, finish=True, timeout=60) == 1  # node 1 sets step 7 aside too
    assert not (tmp_path / "pfs" / layout.step_dirname(7) / layout.node_filename(1)).exists()
    pfs = tmp_path / "pfs"
    assert drain.read_manifest(pfs / layout.step_dirname(8))["time"] == 2.5
    assert drain.read_manifest(pfs / layout.step_dirname(7)) is None
    assert not list((pfs / layout.step_dirname(7)).glob("*bbio-part"))
    status = drain.read_status(j0)
    assert list(status["damaged"]) == ["7"] and str(damaged) in status["damaged"]["7"]["why"]
    assert drain.pending(j0) == [] and drain.set_aside_path(j0, 7).exists()
    assert drain.damaged_save(pfs / layout.step_dirname(7), 1.5)["node"] == 0  # for the others
    assert drain.run(j0, None, finish=True, timeout=60) == 1  # a later drain still says so
    assert list(drain.read_status(j0)["damaged"]) == ["7"]
    two_node_save(tmp_path / "bb", 7, 3.5)  # saved again: the new save is drained
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    assert drain.read_manifest(pfs / layout.step_dirname(7))["time"] == 3.5
    assert not drain.set_aside_path(j0, 7).exists()
    assert drain.damaged_save(pfs / layout.step_dirname(7), 3.5) is None  # 1.5's stays apart
    from bbio.checkpoint.checkpointer import SaveHandle

    for journal in (j0, j1):  # the new save's handles do not raise
        SaveHandle("run", 7, pfs / layout.step_dirname(7), journal, 2, save_time=3.5).wait(10)


def test_the_drain_checks_a_node_file_against_its_save_before_hdf5_reads_it(tmp_path, monkeypatch):
    """One byte of node 0's HDF5 superblock changed since its save, which recorded the
    file's size and CRC32C.  Before, the drain read the file's HDF5 metadata (to
    describe it) before anything compared the file with its save: metadata damage could
    crash the drain, over and over on that task.  Now HDF5 never opens it."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    step_dir = tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / layout.step_dirname(7)
    node_file, record_path = step_dir / "node-00000.h5", step_dir / "node-00000.json"
    size, crc = files.checksum_file(node_file)
    record = {**files.read_json(record_path), "size": size, "file_crc32c": crc}
    files.write_json_atomic(record_path, record)
    image = bytearray(node_file.read_bytes())
    image[0] ^= 0x01
    node_file.write_bytes(bytes(image))
    described = []
    real_describe = drain.describe_node_file

    def recording(path, node):
        described.append(path)
        return real_describe(path, node)

    monkeypatch.setattr(drain, "describe_node_file", recording)
    assert drain.run(j0, None, finish=True, timeout=60) == 1
    assert node_file not in described
    why = drain.read_status(j0)["damaged"]["7"]["why"]
    assert str(node_file) in why and f"its save wrote {size} bytes, {crc:08x}" in why, why
    assert drain.run(j1, None, finish=True, timeout=60) == 1  # node 1 sets step 7 aside too
    assert drain.read_manifest(tmp_path / "pfs" / layout.step_dirname(7)) is None


def test_a_save_set_aside_for_another_nodes_damaged_task_file_says_so_on_every_node(tmp_path):
    """Node 0's task file is damaged (its node file whole); node 1's drain comes to the
    step after node 0 put its marker on the PFS.  Before, node 1's marker said node 0's
    *file* was damaged, and restore then passed over a save it can read in its layout."""
    from bbio.checkpoint import admin

    pfs = tmp_path / "pfs" / layout.CKPT_DIR / "run"
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5, pfs_root=pfs)
    for journal in (j0, j1):
        drain.set_target(journal, pfs, nodes=2, keep_pfs=5)
    (pfs / layout.step_dirname(7)).mkdir(parents=True)  # a retried step, say
    drain.task_path(j0, 7).write_text("{not json")
    assert drain.run(j0, None, finish=True, timeout=60) == 1
    assert drain.run(j1, None, finish=True, timeout=60) == 1
    for node, journal in enumerate((j0, j1)):
        assert drain.set_aside(journal)[7].get(drain.TASK_DAMAGED) is True, journal
        (row,) = admin.list_checkpoints(tmp_path / "bb" / str(node), tmp_path / "pfs", node, "run")
        assert (row.pfs, row.queue) == ("damaged task 0", "set aside")
    with pytest.raises(IntegrityError, match="node 0's drain task file is damaged"):
        admin.verify(tmp_path / "bb" / "1", tmp_path / "pfs", node=1)


def test_ls_and_verify_name_a_save_set_aside_as_damaged_until_it_is_saved_again(tmp_path):
    from bbio.checkpoint import admin

    pfs_root, bb = tmp_path / "pfs", tmp_path / "bb"
    j0, j1 = two_node_save(bb, 7, 1.5, pfs_root / layout.CKPT_DIR / "run")
    damaged = bb / "0" / layout.CKPT_DIR / "run" / "step-00000007" / "node-00000.h5"
    damaged.write_bytes(b"not an HDF5 file" * 100)
    assert drain.run(j0, None, finish=True, timeout=60) == 1
    assert drain.run(j1, None, finish=True, timeout=60) == 1
    for node in (0, 1):
        (row,) = admin.list_checkpoints(bb / str(node), pfs_root, node, "run")
        assert (row.step, row.pfs, row.queue) == (7, "damaged node 0", "set aside")
        for asked in (node, None):  # --node, or not (a real node: its own tasks say)
            with pytest.raises(IntegrityError, match="step 7 is never committed: node 0's") as err:
                admin.verify(bb / str(node), pfs_root, asked, "run")
            assert ("set aside by the drain" in str(err.value)) == (node == 0)
            assert str(bb / "1") not in str(err.value)  # node 1's copy is not to blame
    two_node_save(bb, 7, 3.5, pfs_root / layout.CKPT_DIR / "run")
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    for node in (0, 1):
        (row,) = admin.list_checkpoints(bb / str(node), pfs_root, node, "run")
        assert (row.pfs, row.queue) == ("committed", "-")
        assert admin.verify(bb / str(node), pfs_root, node, "run") == 4  # 3 on the PFS, 1 here


def test_a_marker_that_could_not_be_put_on_the_pfs_at_first_is_put_there_later(tmp_path):
    from bbio.checkpoint.checkpointer import SaveHandle

    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    shutil.rmtree(tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000007")
    step_dir = tmp_path / "pfs" / layout.step_dirname(7)
    assert drain.run(j0, None, finish=True, timeout=60) == 1  # node 0's copy is gone
    assert drain.set_aside_path(j0, 7).exists() and not step_dir.exists()  # nowhere to say so
    assert drain.run(j1, None, finish=True, timeout=60) == 0  # node 1 copied, awaits node 0
    assert drain.read_damaged(step_dir) is None
    two_node_save(tmp_path / "bb", 8, 2.5)
    assert drain.run(j0, None, finish=True, timeout=60) == 1  # a later pass, busy, says so
    assert drain.damaged_save(step_dir, 1.5)["node"] == 0
    handle = SaveHandle("run", 7, step_dir, j1, 2, save_time=1.5)
    with pytest.raises(IntegrityError, match="node 0's file is damaged"):
        handle.wait(timeout=60)  # at once, not at the timeout


def test_waiting_for_a_save_set_aside_as_damaged_fails_at_once_on_every_node(tmp_path):
    from bbio.checkpoint.checkpointer import SaveHandle

    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    damaged = tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000007" / "node-00000.h5"
    damaged.write_bytes(b"not an HDF5 file" * 100)
    assert drain.run(j0, None, finish=True, timeout=60) == 1
    assert drain.run(j1, None, finish=True, timeout=60) == 1  # from node 0's marker on the PFS
    step_dir = tmp_path / "pfs" / layout.step_dirname(7)
    for journal in (j0, j1):
        handle = SaveHandle("run", 7, step_dir, journal, 2, save_time=1.5)
        started = time.monotonic()
        with pytest.raises(IntegrityError, match="step 7 will not be committed: node 0's file"):
            handle.wait(timeout=60)
        assert time.monotonic() - started < 30 and not handle.done()


def test_a_running_drain_tells_its_ranks_that_another_nodes_file_is_damaged(tmp_path):
    from bbio.checkpoint.checkpointer import SaveHandle

    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    damaged = tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000007" / "node-00000.h5"
    damaged.write_bytes(b"not an HDF5 file" * 100)
    background = threading.Thread(target=drain.run, args=(j1, os.getpid(), False, None))
    background.start()  # node 1's drain, as a job runs it: copies, then awaits node 0
    try:
        deadline = time.monotonic() + 60
        while drain.read_status(j1).get("awaiting") != [7] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert drain.run(j0, None, finish=True, timeout=60) == 1
        handle = SaveHandle(
            "run", 7, tmp_path / "pfs" / layout.step_dirname(7), j1, 2, save_time=1.5
        )
        with pytest.raises(IntegrityError, match="node 0's file is damaged"):
            handle.wait(timeout=60)
        assert drain.read_status(j1)["awaiting"] == []  # it no longer looks for that commit
    finally:
        (j1 / drain.STOP).write_text("{}")
        background.join(timeout=60)


def test_a_running_drain_that_finds_the_marker_before_copying_tells_its_ranks(tmp_path):
    from bbio.checkpoint.checkpointer import SaveHandle

    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    damaged = tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000007" / "node-00000.h5"
    damaged.write_bytes(b"not an HDF5 file" * 100)
    assert drain.run(j0, None, finish=True, timeout=60) == 1  # node 0's marker on the PFS
    background = threading.Thread(target=drain.run, args=(j1, os.getpid(), False, None))
    background.start()  # node 1's drain, as a job runs it: sets its task aside, stays up
    try:
        handle = SaveHandle(
            "run", 7, tmp_path / "pfs" / layout.step_dirname(7), j1, 2, save_time=1.5
        )
        started = time.monotonic()
        with pytest.raises(IntegrityError, match="node 0's file is damaged"):
            handle.wait(timeout=60)
        assert time.monotonic() - started < 30
    finally:
        (j1 / drain.STOP).write_text("{}")
        background.join(timeout=60)


@pytest.mark.parametrize("damage", ["{garbage", '{"size": "ten", "crc32c": 123}'])
def test_a_damaged_record_keeps_its_copy_and_does_not_stop_trimming(tmp_path, damage):
    """Also a record of the wrong fields, which ``verify`` names (before, it was trimmed)."""
    bb, pfs = tmp_path / "bb" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    journal = drain.journal_dir(bb)
    journal.mkdir(parents=True)
    _drained_copies(bb, pfs, {1: None, 2: None, 3: None})
    (bb / layout.step_dirname(1) / layout.node_record_name(0)).write_text(damage)
    assert drain.trim_bb(bb, 0, 1, pfs, journal, recycle=False) == 1  # step 1 kept
    assert sorted(p.name for p in bb.glob("step-*")) == [
        layout.step_dirname(1),
        layout.step_dirname(3),
    ]


def _brute_overlap(boxes):
    cells = {}
    for i, (start, shape) in enumerate(boxes):
        for cell in np.ndindex(*shape):
            cells.setdefault(tuple(s + c for s, c in zip(start, cell, strict=True)), set()).add(
                boxes[i]
            )
    return any(len(held) > 1 for held in cells.values())


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_the_overlap_sweep_agrees_with_brute_force(ndim):
    rng = np.random.default_rng(ndim)
    for _ in range(300):
        boxes = []
        for _ in range(int(rng.integers(1, 7))):
            start = tuple(int(x) for x in rng.integers(0, 5, ndim))
            shape = tuple(int(x) for x in rng.integers(0, 3, ndim))
            boxes.extend([(start, shape)] * int(rng.integers(1, 3)))  # replicas too
        pair = layout.first_overlap(boxes)
        assert (pair is not None) == _brute_overlap(boxes), boxes
        if pair is not None:
            i, j = pair
            assert i < j and boxes[i] != boxes[j]
            assert layout.intersect(boxes[i], boxes[j]) is not None


def test_a_task_of_a_save_withdrawn_meanwhile_is_dropped_not_set_aside(tmp_path):
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    (task,) = drain.pending(j0)  # taken by the drain; then the save fails on another node
    shutil.rmtree(task.source.parent)  # and is withdrawn: file, record and task removed
    drain.task_path(j0, 7).unlink()
    (tmp_path / "pfs" / layout.step_dirname(7)).mkdir(parents=True)  # another node copied
    assert drain._begin(j0, task) is None
    assert not drain.set_aside_path(j0, 7).exists()
    assert drain.read_damaged(tmp_path / "pfs" / layout.step_dirname(7)) is None


def test_a_task_whose_save_was_killed_before_it_recorded_its_copy_is_dropped(tmp_path):
    """A save queues its task, then writes its node's record: a job killed in between
    leaves a node file no restore takes, so the drain drops the task without copying."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    (task,) = drain.pending(j0)
    (task.source.parent / layout.node_record_name(0)).unlink()
    assert drain.run(j0, None, finish=True, timeout=30) == 0
    assert drain.pending(j0) == [] and not drain.set_aside_path(j0, 7).exists()
    assert not (tmp_path / "pfs" / layout.step_dirname(7)).exists()  # nothing copied
    assert 7 not in restore.bb_copies(task.source.parent.parent, 0)


def test_a_drain_that_finds_a_task_before_its_record_waits_for_the_saving_node(tmp_path):
    """Between the task and the record, the saving node holds the records' lock: a drain
    taking the task then waits for the record instead of dropping the task."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    (task,) = drain.pending(j0)
    record_path = task.source.parent / layout.node_record_name(0)
    record = files.read_json(record_path)
    began = []
    with drain.records_locked(j0):  # as the saving node's leader holds it
        record_path.unlink()
        taking = threading.Thread(target=lambda: began.append(drain._begin(j0, task)))
        taking.start()
        taking.join(0.5)
        assert taking.is_alive(), "the drain decided without the saving node's lock"
        files.write_json_atomic(record_path, record)
    taking.join(30)
    (copying,) = began
    assert copying is not None and drain.pending(j0) == [task]
    copying.abandon()


def test_a_task_without_its_copy_is_set_aside_unless_its_save_is_committed(tmp_path):
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    task = drain.pending(j0)[0]
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert drain.run(j1, None, finish=True, timeout=60) == 0  # committed
    drain.add_task(j0, task)  # as if a crash came between the commit and the task's removal
    shutil.rmtree(tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000007")
    assert drain.run(j0, None, finish=True, timeout=60) == 0  # committed: the task just goes
    assert drain.pending(j0) == [] and not drain.set_aside_path(j0, 7).exists()
    two_node_save(tmp_path / "bb", 8, 2.5)
    shutil.rmtree(tmp_path / "bb" / "0" / layout.CKPT_DIR / "run" / "step-00000008")
    result = drain.run(j0, None, finish=True, timeout=60)
    assert result == 1 and drain.pending(j0) == []  # never drainable: set aside, said
    assert "burst-buffer copy is gone" in drain.read_status(j0)["damaged"]["8"]["why"]


def test_damaged_leftovers_of_an_older_checkpoint_do_not_fail_the_finish(tmp_path, capfd):
    """An epilog's finish commits what is ready on the PFS too; a record there that is
    not JSON (an older checkpoint's, damaged) is said, not a failure of this drain."""
    journals = two_node_save(tmp_path / "bb", 5, 1.5)
    for journal in journals:  # where a checkpointer says its checkpoints go
        drain.set_target(journal, tmp_path / "pfs", nodes=2, keep_pfs=5)
    old = tmp_path / "pfs" / layout.step_dirname(1)
    old.mkdir(parents=True)
    (old / layout.node_record_name(0)).write_text("{not json")
    drained_here = {"size": 8, "crc32c": 1, "node": 0, "time": 0.5, "complete": True}
    bb_old = journals[0].parent / layout.step_dirname(1) / layout.node_record_name(0)
    files.write_json_atomic(bb_old, drained_here)  # node 0 drained step 1 (an older job)
    assert admin.finish_journals(journals, 60) == []
    assert drain.read_manifest(tmp_path / "pfs" / layout.step_dirname(5))["time"] == 1.5
    assert "not committed" in capfd.readouterr().err


def test_a_step_counts_on_every_node_only_from_one_save():
    nodes = [
        {1: {"time": 1.0}, 2: {"time": 2.0}, 3: {"time": 3.0}, 4: {"time": 4.0}},
        {1: {"time": 1.0}, 2: {"time": 2.5}, 3: {"time": 3.0}, 4: {"time": 4.0}},
    ]
    committed = {3: 3.5, 4: 4.0}  # step 3 saved again since, on other burst buffers
    assert restore.one_save_on_every_node(nodes, committed) == {1, 4}
    assert restore.one_save_on_every_node([], committed) == set()


def test_a_step_in_the_burst_buffers_is_usable_of_another_layout_partial_or_set_aside():
    def copy(time, same_layout=True, nodes=3, set_aside=None):
        return {"time": time, "same_layout": same_layout, "nodes": nodes, "set_aside": set_aside}

    nodes = [  # this job: 3 nodes
        {1: copy(1.0), 2: copy(2.0), 3: copy(3.0, False, 2), 4: copy(4.0, False, 2)},
        {1: copy(1.0), 2: copy(2.5), 3: copy(3.0, False, 2), 4: copy(4.5, False, 2)},
        {1: copy(1.0), 5: copy(5.0, False, 4), 6: copy(6.0, set_aside="node file")},
    ]
    for node in nodes[:2]:  # saved by another layout on nodes 0 and 1, set aside on node 1
        node[7] = copy(7.0, False, 2, set_aside="node file" if node is nodes[1] else None)
        node[8] = copy(8.0, False, 2, set_aside="task file" if node is nodes[1] else None)
    for node in nodes:  # whole in this layout: only a task file was damaged
        node[9] = copy(9.0, set_aside="task file" if node is nodes[2] else None)
    assert restore.bb_states(nodes, {}) == {
        1: restore.USABLE,
        2: restore.PARTIAL,  # two saves
        3: restore.OTHER_LAYOUT,  # saved on nodes 0 and 1, both in this job
        4: restore.PARTIAL,  # two saves, of another layout
        5: restore.PARTIAL,  # saved on 4 nodes: this job has 3
        6: restore.SET_ASIDE,  # on one node: the save's drain there found it damaged
        7: restore.SET_ASIDE,  # complete, but never committed
        8: restore.SET_ASIDE,  # its node files whole, but never committed: not readable here
        9: restore.USABLE,  # its node files whole, in this layout
    }
    assert restore.bb_states(nodes[:1], {}) == {  # a job of node 0 alone
        1: restore.USABLE,
        2: restore.USABLE,
        3: restore.PARTIAL,  # node 1 of the save is not in the job
        4: restore.PARTIAL,
        7: restore.PARTIAL,
        8: restore.PARTIAL,
        9: restore.USABLE,  # node 0's copy: its task file was damaged on node 2
    }
    assert restore.bb_states([], {}) == {}


def _release_fifo(fifo, payload, until):
    """Open ``fifo`` for writing once a reader waits on it, write ``payload``; False if no
    reader came before ``until`` (time.monotonic())."""
    while time.monotonic() < until:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.01)
            continue
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        return True
    return False


@contextlib.contextmanager
def commit_held_up(journal, pfs, step):
    """Node 0's foreground drain of ``journal`` in a thread, while its commit of ``step``
    is held up: it reads node 1's record of the step, here a FIFO nobody writes until
    the block ends.  Yields the drain's exit statuses (one once it ended)."""
    held = pfs / layout.step_dirname(step) / layout.node_record_name(1)
    held.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(held)
    exits = []
    draining = threading.Thread(
        target=lambda: exits.append(drain.run(journal, None, True, 60)), daemon=True
    )
    draining.start()
    try:
        yield exits
    finally:
        released = _release_fifo(held, b'{"time": 0.5}', time.monotonic() + 10)
        draining.join(30)
        while draining.is_alive() and _release_fifo(held, b"{}", time.monotonic() + 5):
            draining.join(5)  # it read the FIFO again: let it through
        held.unlink()
    assert released and not draining.is_alive()


def _wait_for(condition, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
    return condition()


def test_the_next_checkpoint_is_copied_while_the_previous_one_finishes(tmp_path):
    """Draining is a pipeline: step 8's bytes are copied while step 7's commit is held up."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    two_node_save(tmp_path / "bb", 8, 2.5)
    pfs = tmp_path / "pfs"
    (task8,) = [t for t in drain.pending(j0) if t.step == 8]
    copy8 = task8.target  # no file there: copied in place
    with commit_held_up(j0, pfs, 7) as exits:
        copied = _wait_for(
            lambda: copy8.exists() and copy8.stat().st_size == task8.source.stat().st_size
        )
        assert copied, "step 8 was not copied while step 7's commit was held up"
        assert drain.read_manifest(pfs / layout.step_dirname(7)) is None
    assert exits == [0]
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    for step, when in ((7, 1.5), (8, 2.5)):
        assert drain.read_manifest(pfs / layout.step_dirname(step))["time"] == when


def test_another_nodes_commit_is_seen_while_the_next_checkpoint_is_copied(tmp_path):
    """Node 0 drained step 7 and is held up copying step 8 (its temporary file on the PFS
    is a FIFO nobody reads) when node 1 commits step 7: node 0's status says so at once,
    not once the copy ends."""
    j0, j1 = two_node_save(tmp_path / "bb", 7, 1.5)
    two_node_save(tmp_path / "bb", 8, 2.5)
    pfs = tmp_path / "pfs"
    (task8,) = [t for t in drain.pending(j0) if t.step == 8]
    copy8 = files.temp_path(task8.target)
    copy8.parent.mkdir(parents=True)
    task8.target.touch()  # a file there: copied under the temporary name
    os.mkfifo(copy8)
    exits = []
    draining = threading.Thread(target=lambda: exits.append(drain.run(j0, None, True, 60)))
    draining.start()
    try:
        assert _wait_for(lambda: drain.read_status(j0).get("awaiting") == [7])
        assert drain.run(j1, None, finish=True, timeout=60) == 0  # commits 7; 8 awaits node 0
        assert drain.read_manifest(pfs / layout.step_dirname(7)) is not None
        assert _wait_for(lambda: drain.step_committed(j0, 7) is True, seconds=5)
        assert copy8.is_fifo() and drain.read_status(j0)["state"] == "copying"
    finally:
        with contextlib.suppress(OSError):  # the copy's open returns, its write fails: retried
            os.close(os.open(copy8, os.O_RDONLY | os.O_NONBLOCK))
        draining.join(60)
    assert exits == [0]
    assert drain.read_manifest(pfs / layout.step_dirname(8))["time"] == 2.5


def test_the_status_says_copying_while_a_step_finishes_after_another_was_set_aside(tmp_path):
    """Step 7's node file is damaged (set aside once copied), step 8's commit is held up:
    meanwhile the drain reports step 8 in progress, not idle."""
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    two_node_save(tmp_path / "bb", 8, 2.5)
    (task7,) = [t for t in drain.pending(j0) if t.step == 7]
    task7.source.write_bytes(b"not an HDF5 file" * 100)
    with commit_held_up(j0, tmp_path / "pfs", 8) as exits:
        assert _wait_for(lambda: "7" in drain.read_status(j0).get("damaged", {}))
        time.sleep(0.2)  # step 8 is still held
        status = drain.read_status(j0)
        assert (status["state"], status["step"]) == ("copying", 8), status
    assert exits == [1]  # step 7 set aside: said
    status = drain.read_status(j0)
    assert (status["state"], status["error"]) == (drain.STOPPED, None), status


def test_a_step_saved_again_while_its_older_save_is_recorded_keeps_the_new_save(tmp_path):
    """Node 0's drain has renamed save 1.5's copy of step 7 onto the PFS when the step is
    saved again (2.5), holding the records lock as a saving node leader does.  Before the
    lock, the drain then wrote 1.5's record over 2.5's: save 2.5 was set aside as damaged
    and a restore took the old state."""
    bb, pfs = tmp_path / "bb", tmp_path / "pfs"
    j0, j1 = two_node_save(bb, 7, 1.5)
    (task,) = drain.pending(j0)
    exits = []
    draining = threading.Thread(
        target=lambda: exits.append(drain.run(j0, None, True, 60)), daemon=True
    )
    with drain.records_locked(j0):
        draining.start()
        assert _wait_for(lambda: task.target.exists()), "node 0's copy was not renamed"
        time.sleep(0.1)  # the drain now waits for the lock to record its copy
        bb_record = task.source.parent / layout.node_record_name(0)
        assert files.read_json(bb_record)["crc32c"] is None  # not recorded as drained yet
        for n in (0, 1):  # what saving the step again does: uncommit it on the PFS ...
            (pfs / layout.step_dirname(7) / layout.node_record_name(n)).unlink(missing_ok=True)
        for journal in (j0, j1):  # ... drop each node's copy and task, then save anew
            drain.task_path(journal, 7).unlink()
        for path in (bb_record, task.source):
            path.unlink()
        two_node_save(bb, 7, 2.5)
    draining.join(60)
    assert exits == [0] and not draining.is_alive()
    assert files.read_json(bb_record)["time"] == 2.5
    assert not drain.read_status(j0).get("damaged")  # the new save was not set aside
    assert drain.run(j1, None, finish=True, timeout=60) == 0
    assert drain.read_manifest(pfs / layout.step_dirname(7))["time"] == 2.5
    with h5py.File(task.target, "r") as f:  # the new save's bytes on the PFS
        assert f["w/r00000"][()].tolist() == [2.5] * 5


def test_a_retry_of_a_step_retention_deleted_since_is_done_not_copied_again(tmp_path):
    """keep_pfs=1: step 7 is committed, then step 8, and retention deletes step 7.  Node
    1's task of step 7 comes back (its first try failed after its renames, say on a full
    burst buffer).  Before, the drain made step 7's directory again, copied the file into
    it, and waited for ever for a commit that could not come."""
    bb, pfs = tmp_path / "bb", tmp_path / "pfs"
    j0, j1 = two_node_save(bb, 7, 1.5, keep_pfs=1)
    two_node_save(bb, 8, 2.5, keep_pfs=1)
    (task7,) = [t for t in drain.pending(j1) if t.step == 7]
    for journal in (j0, j1, j0):
        assert drain.run(journal, None, finish=True, timeout=60) == 0
    assert drain.committed_steps(pfs) == [8] and not (pfs / layout.step_dirname(7)).exists()
    drain.add_task(j1, dataclasses.replace(task7, keep_bb=1))  # the retry
    record = task7.source.parent / layout.node_record_name(1)
    files.write_json_atomic(record, {**files.read_json(record), "crc32c": None})
    start = time.monotonic()
    assert drain.run(j1, None, finish=True, timeout=20) == 0
    assert time.monotonic() - start < 10
    assert not (pfs / layout.step_dirname(7)).exists() and drain.pending(j1) == []
    assert drain.committed_steps(pfs) == [8]
    # Node 1's copy of step 7, beyond keep_bb=1 and never to drain, is trimmed too
    # (before, it stayed in the burst buffer for good); step 8's stays.
    assert not record.exists() and not task7.source.exists()
    assert (bb / "1" / layout.CKPT_DIR / "run" / layout.step_dirname(8)).is_dir()


def test_a_retry_is_found_retired_though_this_node_holds_no_newer_copy(tmp_path):
    """As above, but step 8 went to the PFS without passing through node 1's burst buffer
    (written straight there when the burst buffer was full; here: by other nodes' drains).
    Before, the drain looked at the PFS only when it held a drained newer copy, so it made
    step 7's directory again and copied into it a file that could never commit."""
    bb, pfs = tmp_path / "bb", tmp_path / "pfs"
    j0, j1 = two_node_save(bb, 7, 1.5, keep_pfs=1)
    (task7,) = drain.pending(j1)
    for journal in (j0, j1):
        assert drain.run(journal, None, finish=True, timeout=60) == 0
    for journal in two_node_save(tmp_path / "elsewhere", 8, 2.5, pfs_root=pfs, keep_pfs=1):
        assert drain.run(journal, None, finish=True, timeout=60) == 0
    assert drain.committed_steps(pfs) == [8] and not (pfs / layout.step_dirname(7)).exists()
    drain.add_task(j1, task7)  # the retry
    record = task7.source.parent / layout.node_record_name(1)
    files.write_json_atomic(record, {**files.read_json(record), "crc32c": None})
    assert drain.run(j1, None, finish=True, timeout=20) == 0
    assert not (pfs / layout.step_dirname(7)).exists() and drain.pending(j1) == []
    assert drain.read_status(j1)["awaiting"] == [] and drain.committed_steps(pfs) == [8]


def test_the_finish_commits_what_this_node_drained_after_a_dead_committer_s_lock(tmp_path):
    """Step 7's node files and records are all on the PFS, but node 0's committer died on
    its host holding the commit lock.  Node 1's epilog waits until the lock is stale and
    commits (before, it gave up at once and the step stayed uncommitted); a later job's
    epilog, whose node never drained step 7, leaves it alone (before, it committed an
    earlier job's step, newer than its own, and retention then deleted its own)."""
    bb, pfs = tmp_path / "bb", tmp_path / "pfs"
    j0, j1 = two_node_save(bb, 7, 1.5)
    for journal in (j0, j1):
        drain.start_copy(drain.pending(journal)[0]).finish(journal)
        drain.set_target(journal, pfs, nodes=2, keep_pfs=5)
    later_job = bb / "later" / "0" / layout.CKPT_DIR / "run"
    drain.journal_dir(later_job).mkdir(parents=True)
    drain.set_target(drain.journal_dir(later_job), pfs, nodes=2, keep_pfs=5)
    assert drain.commit_ready(drain.journal_dir(later_job)) == []
    assert drain.read_manifest(pfs / layout.step_dirname(7)) is None
    lock = pfs / layout.step_dirname(7) / drain.COMMIT_LOCK
    os.symlink(json.dumps({"host": "a-dead-node", "pid": 1}), lock)
    nearly_stale = time.time() - drain.STALE_LOCK_SECONDS + 2
    os.utime(lock, (nearly_stale, nearly_stale), follow_symlinks=False)
    start = time.monotonic()
    assert drain.commit_ready(j1) == [7]
    assert 1 <= time.monotonic() - start < 30
    assert drain.read_manifest(pfs / layout.step_dirname(7))["time"] == 1.5


def test_a_commit_lock_names_its_owner_and_one_that_names_none_is_judged_by_its_age(tmp_path):
    """The lock is a symbolic link whose target names the committer; a file there that
    names no owner (not a lock bbio made) is held until it is stale by its age."""
    step_dir = tmp_path / "step"
    step_dir.mkdir()
    lock = step_dir / drain.COMMIT_LOCK
    lock.write_text("")
    assert drain._take_commit_lock(step_dir) is None
    old = time.time() - drain.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    mine = drain._take_commit_lock(step_dir)
    assert mine == lock and mine.is_symlink()
    assert json.loads(os.readlink(mine))["pid"] == os.getpid()


def test_a_stale_commit_lock_is_removed_only_while_it_is_the_one_judged_stale(tmp_path):
    """Two committers judged one stale lock at once: the first removed it and took its own,
    then the second removed that one (it removed by name) and took the lock too, and both
    committed.  Now a lock is moved aside first, and put back unless it is the one judged
    stale."""
    lock = tmp_path / drain.COMMIT_LOCK
    os.symlink('{"host": "gone", "pid": 1, "time": 0}', lock)
    judged = os.readlink(lock)
    lock.unlink()  # the first committer removed it and took its own
    os.symlink('{"host": "here", "pid": 2, "time": 1}', lock)
    assert drain._remove_if_still(lock, judged) is False
    assert os.readlink(lock) == '{"host": "here", "pid": 2, "time": 1}'
    assert drain._remove_if_still(lock, os.readlink(lock)) is True
    assert not os.path.lexists(lock) and os.listdir(tmp_path) == []
    assert drain._remove_if_still(lock, judged) is True  # gone already


def test_a_commit_lock_whose_pid_a_later_process_reuses_is_stale(tmp_path):
    """Node 0's committer died holding step 7's commit lock, and its PID now belongs to
    another process of the host (here: this one).  The lock says when its owner started,
    so node 1's epilog takes it over at once; before, the live PID kept it for good and
    the step never committed.  A lock of the live owner itself is still respected."""
    bb, pfs = tmp_path / "bb", tmp_path / "pfs"
    j0, j1 = two_node_save(bb, 7, 1.5)
    for journal in (j0, j1):
        drain.start_copy(drain.pending(journal)[0]).finish(journal)
        drain.set_target(journal, pfs, nodes=2, keep_pfs=5)
    step_dir = pfs / layout.step_dirname(7)
    mine = drain._take_commit_lock(step_dir)
    assert mine is not None and drain._take_commit_lock(step_dir) is None  # alive: held
    owner = json.loads(os.readlink(mine))
    assert owner["pid"] == os.getpid() and owner["started"]
    mine.unlink()
    os.symlink(json.dumps({**owner, "started": "an-earlier-boot:12345"}), mine)
    start = time.monotonic()
    assert drain.commit_ready(j1) == [7]
    assert time.monotonic() - start < 10
    assert drain.read_manifest(step_dir)["time"] == 1.5


def test_a_drain_never_removes_the_task_of_a_later_save_of_its_step(tmp_path):
    journal = tmp_path / ".journal"
    journal.mkdir()
    first = drain.Task(
        "run", 5, 0, 1, str(tmp_path / "bb"), str(tmp_path / "pfs"), 2, 2, "cache", 1.0
    )
    again = dataclasses.replace(first, save_time=2.0)
    drain.add_task(journal, again)  # the step saved again while the first save committed
    drain._remove_task(journal, first)  # the first save's drain is done with its task
    assert drain.pending(journal) == [again]
    assert drain.step_committed(journal, 5) is False  # the later save still waits
    drain._remove_task(journal, again)
    assert drain.pending(journal) == []


def test_one_drain_started_while_another_holds_the_journal_waits_and_then_drains(tmp_path):
    j0, _ = two_node_save(tmp_path / "bb", 7, 1.5)
    record = tmp_path / "pfs" / layout.step_dirname(7) / layout.node_record_name(0)
    held = os.open(j0 / drain.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)  # another drain, leaving: it will not look at the queue again
    started = subprocess.Popen(
        [sys.executable, "-m", "bbio.checkpoint.drainer", "--journal", str(j0)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(1.0)
        assert started.poll() is None, "a drain that finds the journal held must wait for it"
        assert drain.pending(j0) and not record.exists()
        assert drain.has_waiting_drain(j0)
        for _ in range(3):  # before, each waited too: one more per Checkpointer of a new job
            more = subprocess.run(
                [sys.executable, "-m", "bbio.checkpoint.drainer", "--journal", str(j0)],
                capture_output=True,
                timeout=60,
            )
            assert more.returncode == 0, more.stderr
        assert started.poll() is None
        os.close(held)  # the other drain has left
        held = None
        deadline = time.monotonic() + 60
        while drain.pending(j0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not drain.pending(j0) and record.exists()
    finally:
        if held is not None:
            os.close(held)
        (j0 / drain.STOP).touch()
        try:
            started.wait(30)
        finally:
            started.kill()
    assert started.returncode == 0, started.stderr.read()


def test_a_handle_reports_a_save_committed_after_retention_removed_it(tmp_path):
    from bbio.checkpoint.checkpointer import SaveHandle

    pfs = tmp_path / "pfs"
    for step, when in ((7, 1.5), (8, 2.5)):
        for journal in two_node_save(tmp_path / "bb", step, when, keep_pfs=1):
            assert drain.run(journal, None, finish=True, timeout=60) == 0
    assert drain.committed_steps(pfs) == [8]  # step 7 removed by retention
    fresh = tmp_path / "journal-of-a-restarted-drain"
    fresh.mkdir()  # knows of neither step: only the PFS can tell
    for step, when in ((7, 1.5), (8, 2.5)):
        handle = SaveHandle("run", step, pfs / layout.step_dirname(step), fresh, 2, save_time=when)
        assert handle.done()
        handle.wait(timeout=5)
    unsaved = SaveHandle("run", 9, pfs / layout.step_dirname(9), fresh, 2, save_time=3.5)
    assert not unsaved.done()


def test_a_drain_killed_while_retention_deletes_leaves_no_step_behind(tmp_path, monkeypatch):
    """Retention renames a checkpoint's directory away before it deletes anything in it:
    a drain killed while deleting leaves a hidden directory, not a step listed as
    draining for good (before, the step stayed without its manifest, and no retention
    ever removed it); the next retention that removes a step deletes the leftover."""
    ckpt_dir = tmp_path / "pfs"
    for step in (1, 2, 3):
        step_dir = ckpt_dir / layout.step_dirname(step)
        step_dir.mkdir(parents=True)
        (step_dir / "node-00000.h5").write_bytes(b"x")
        files.write_json_atomic(drain.manifest_path(step_dir), sound_manifest(step))
    remove_tree = drain._remove_tree

    def killed(path):
        raise KeyboardInterrupt  # the drain dies before it deletes anything

    monkeypatch.setattr(drain, "_remove_tree", killed)
    with pytest.raises(KeyboardInterrupt):
        drain.apply_pfs_retention(ckpt_dir, 2)
    assert drain.steps_in(ckpt_dir) == [2, 3] and drain.committed_steps(ckpt_dir) == [2, 3]
    left = [p.name for p in ckpt_dir.iterdir() if p.name.startswith(drain.RETIRING)]
    assert len(left) == 1 and left[0].startswith(f"{drain.RETIRING}{layout.step_dirname(1)}.")
    monkeypatch.setattr(drain, "_remove_tree", remove_tree)
    assert drain.apply_pfs_retention(ckpt_dir, 1) == [2]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [layout.step_dirname(3)]


def test_two_drains_applying_retention_at_once_both_succeed(tmp_path):
    ckpt_dir = tmp_path / "pfs"
    for step in range(40):
        step_dir = ckpt_dir / layout.step_dirname(step)
        (step_dir / "deeper").mkdir(parents=True)
        for i in range(30):
            (step_dir / f"node-{i}.h5").write_bytes(b"x")
            (step_dir / "deeper" / f"{i}").write_bytes(b"y")
        files.write_json_atomic(drain.manifest_path(step_dir), sound_manifest(step))
    start = threading.Barrier(2)
    outcomes: list[BaseException | list[int]] = []

    def apply() -> None:
        start.wait()
        try:
            outcomes.append(drain.apply_pfs_retention(ckpt_dir, 1))
        except BaseException as exc:
            outcomes.append(exc)

    both = [threading.Thread(target=apply) for _ in range(2)]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join(60)
    assert all(isinstance(o, list) for o in outcomes) and len(outcomes) == 2, outcomes
    assert drain.steps_in(ckpt_dir) == [39]


def test_a_burst_buffer_record_that_cannot_be_read_passes_its_copy_over(tmp_path):
    """An I/O error on one node record (here: a directory in its place) makes that copy
    not count, as a damaged record does, and is named for `bbio ckpt verify`; before, it
    failed every restore and list, although the PFS held the step."""
    bb = tmp_path / "bb"
    two_node_save(bb, 7, 1.5)
    two_node_save(bb, 8, 2.5)
    bb_ckpt_dir = bb / "0" / layout.CKPT_DIR / "run"
    record = bb_ckpt_dir / layout.step_dirname(7) / layout.node_record_name(0)
    record.unlink()
    record.mkdir()
    assert sorted(restore.bb_copies(bb_ckpt_dir, 0)) == [8]
    (problem,) = restore.damaged_bb_records(bb_ckpt_dir, 0)
    assert isinstance(problem, BBIOError) and str(record) in str(problem)


def test_a_damaged_task_file_replaced_by_a_new_save_is_not_set_aside(tmp_path):
    """The drain read a damaged task file; a new save of the step then queued its own task
    before the drain set the save aside.  Before, that new save was set aside (its record
    named it), and every node's wait for it raised."""
    journal = two_node_save(tmp_path / "bb", 5, 2.0)[0]
    why = IntegrityError("the file is damaged")
    assert drain._set_aside_damaged_task(journal, 5, why) is None  # the task reads well now
    assert drain.set_aside(journal) == {} and [t.step for t in drain.pending(journal)] == [5]
    drain.task_path(journal, 5).write_text("{not json")
    assert drain._set_aside_damaged_task(journal, 5, why) == "set aside"
    assert drain.set_aside(journal)[5][drain.TASK_DAMAGED] is True
    assert drain.read_queue(journal) == ([], {})


def test_files_of_a_save_killed_before_its_record_are_deleted_in_both_tiers(tmp_path):
    """Step 6's save was killed on node 0 after its file got its final name, before its
    task and record; node 1 recorded and queued its own.  Before, node 0's file stayed in
    its burst buffer for ever, and node 1's copy on the PFS was listed as draining for
    ever: no retention removed a step that was never committed."""
    bb, pfs = tmp_path / "bb", tmp_path / "pfs"
    for step, when in ((5, 1.5), (6, 2.5), (7, 3.5), (8, 4.5)):
        j0, j1 = two_node_save(bb, step, when, keep_pfs=1)
    bb0 = bb / "0" / layout.CKPT_DIR / "run"
    killed = bb0 / layout.step_dirname(6)
    (killed / layout.node_record_name(0)).unlink()
    drain.task_path(j0, 6).unlink()
    files.temp_path(killed / layout.node_filename(0)).write_bytes(b"a rank's part")
    assert drain.run(j0, None, finish=True, timeout=60) == 0
    assert drain.run(j1, None, finish=True, timeout=60) == 0  # copies step 6: never commits
    assert drain.committed_steps(pfs) == [8]
    assert drain.steps_in(pfs) == [8]  # before: [6, 8], 6 "draining" for ever
    assert (killed / layout.node_filename(0)).exists()  # node 0 saw no commit yet
    saving = bb0 / layout.step_dirname(9) / layout.node_filename(0)  # not recorded yet
    saving.parent.mkdir()
    saving.write_bytes(b"a save in progress")
    drain.trim_bb(bb0, 0, 2, pfs, j0)  # its next trim, after its next task
    assert drain.steps_in(bb0) == [7, 8, 9] and saving.exists()
    kept_for_the_admin = pfs / layout.step_dirname(3)
    kept_for_the_admin.mkdir()
    drain.damaged_on_pfs(kept_for_the_admin).write_text("{}")
    draining = pfs / layout.step_dirname(9)  # newer than the newest commit: still draining
    draining.mkdir()
    (pfs / layout.step_dirname(2)).write_text("not bbio's")  # named like steps: not theirs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("outside the checkpoint")
    (pfs / layout.step_dirname(4)).symlink_to(elsewhere)
    drain.apply_pfs_retention(pfs, 1)
    assert drain.steps_in(pfs) == [2, 3, 4, 8, 9]
    assert (elsewhere / "keep").exists() and not list(pfs.glob(".retiring*"))
    (bb0 / layout.step_dirname(1)).write_text("not bbio's")  # a file: no step directory
    drain.trim_bb(bb0, 0, 2, pfs, j0)  # before these fixes: NotDirectoryError
    assert (bb0 / layout.step_dirname(1)).read_text() == "not bbio's"


def test_reading_a_damaged_node_file_names_it(tmp_path):
    """Before, h5py's own error ("file signature not found"), with no path, reached the
    warning of the copy restore skipped."""
    path = tmp_path / layout.node_filename(0)
    write_node_file(path, 7, 0, [0, 1], state)
    assert restore.read_rank(path, 1)["weights"][0, 0] == 1
    with open(path, "r+b") as f:
        f.write(bytes(8))  # the HDF5 signature
    manifest = {"nodes": 1}
    for read in (
        lambda: restore.read_rank(path, 1),
        lambda: restore.saved_boxes(manifest, tmp_path),
    ):
        with pytest.raises(IntegrityError, match="cannot be read") as info:
            read()
        assert str(path) in str(info.value)


def test_a_look_at_whether_a_drain_runs_does_not_see_another_look(tmp_path):
    """Both ranks of a node look at once when their waits time out together.  Before,
    each look took the lock exclusive for an instant, so one could see the other's and
    blame a drain that was not running (a flaky failure under load)."""
    journal = tmp_path / "journal"
    journal.mkdir()
    for name, is_held in (
        (drain.LOCK, drain.is_draining),
        (drain.NEXT_LOCK, drain.has_waiting_drain),
    ):
        fd = os.open(journal / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # another look, under way
            assert not is_held(journal)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a drain
            assert is_held(journal)
        finally:
            os.close(fd)
        assert not is_held(journal)


@pytest.mark.timeout(60)
def test_a_background_drain_whose_parent_pid_was_reused_leaves_once_idle(tmp_path):
    """A background drain tells its training process from a later process given the same
    PID (the parent's start time, read when the drain starts).  Before, a reused PID kept
    an idle drain, and its spares, waiting for ever."""
    journal = tmp_path / "bb" / layout.CKPT_DIR / "run" / drain.JOURNAL
    journal.mkdir(parents=True)
    me = os.getpid()
    assert drain.run(journal, me, finish=False, timeout=None, parent_started="other:0") == 0
    results: list[int] = []
    alive_parent = threading.Thread(
        target=lambda: results.append(
            drain.run(journal, me, finish=False, timeout=None, parent_started=drain._started(me))
        )
    )
    alive_parent.start()
    time.sleep(0.5)
    assert alive_parent.is_alive(), "the drain left while its training process runs"
    (journal / drain.STOP).touch()
    alive_parent.join(30)
    assert results == [0]
