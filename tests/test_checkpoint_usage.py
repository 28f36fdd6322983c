"""Restore requests a checkpoint cannot serve, and a closed checkpointer: the same clear
``UsageError`` on every rank, never an older checkpoint or a raw MPI error.  On 2 or 4
ranks in 2 virtual nodes."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import time

import numpy as np
import pytest

import bbio
from bbio.checkpoint import drain, layout
from tests.test_checkpoint import config_for, same, state, stop_idle_drains

pytestmark = pytest.mark.mpi(min_size=2)


def same_everywhere(comm, error: BaseException) -> str:
    message = str(error)
    assert comm.allgather(message) == [message] * comm.Get_size()
    return message


def test_a_from_rank_not_saved_is_a_usage_error_and_damage_falls_back(comm, shared_tmp, caplog):
    """Step 1 saved by every rank, step 2 by half of them: from_rank of a rank that saved
    only step 1 raises instead of restoring step 1; a damaged step 2 falls back to it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "r", config=config) as ckpt:
        ckpt.save(1, state(1, rank))
    half = comm.Split(0 if rank < size // 2 else 1, rank)  # a run on half the ranks
    if rank < size // 2:
        small = config_for(
            half, shared_tmp, ranks_per_node=1, bb_root=str(shared_tmp / "bb2/{node}")
        )
        with bbio.Checkpointer(half, "r", config=small) as again:
            again.save(2, state(2, rank))
    half.Free()
    with bbio.Checkpointer(comm, "r", config=config) as ckpt:
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(from_rank=size - 1)
        message = same_everywhere(comm, info.value)
        assert f"from_rank {size - 1} is not a saved rank" in message, message
        assert f"step 2 was saved by {size // 2} ranks" in message, message
        assert "step-00000002" in message, message
        with pytest.raises(bbio.UsageError) as info:  # not step 1: step 2 is newer
            ckpt.restore()
        message = same_everywhere(comm, info.value)
        assert f"checkpoint 2 was saved by {size // 2} ranks, not {size}" in message, message
        assert f"step= a checkpoint saved by {size} ranks" in message, message
        step, arrays, _ = ckpt.restore(step=1)
        assert step == 1 and same(arrays, state(1, rank))
        step, arrays, _ = ckpt.restore(step=1, from_rank=size - 1)
        assert step == 1 and same(arrays, state(1, size - 1))
        step, arrays, _ = ckpt.restore(from_rank=size // 2 - 1)
        assert step == 2 and same(arrays, state(2, size // 2 - 1))
        victim = shared_tmp / "pfs" / "ckpt" / "r" / "step-00000002" / "node-00000.h5"
        comm.Barrier()
        if rank == 0:  # one byte of an array: a copy that fails verification
            with open(victim, "r+b") as f:
                f.seek(victim.stat().st_size - 100)
                byte = f.read(1)
                f.seek(victim.stat().st_size - 100)
                f.write(bytes([byte[0] ^ 0x01]))
        comm.Barrier()
        with caplog.at_level(logging.WARNING, logger="bbio"):
            step, arrays, _ = ckpt.restore(from_rank=0)
        assert step == 1 and same(arrays, state(1, 0))
        if rank == 0:
            assert "step 2 (pfs) skipped" in caplog.text and "node-00000.h5" in caplog.text


def test_a_want_the_checkpoint_cannot_give_is_a_usage_error(comm, shared_tmp, caplog):
    size, rank = comm.Get_size(), comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "local", config=config) as ckpt:  # per-rank arrays
        ckpt.save(1, state(1, rank)).wait(timeout=60)
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(want={"model/w": ((0, 0), (1, 8))})
        message = same_everywhere(comm, info.value)
        assert "step 1 holds per-rank arrays" in message and "from_rank=" in message, message
    with bbio.Checkpointer(comm, "global", config=config) as ckpt:
        for step, rows in ((1, 6), (2, 4)):  # step 2's array is smaller than step 1's
            full = np.arange(size * rows * 5, dtype=np.float64).reshape(size * rows, 5)
            mine = full[rank * rows : (rank + 1) * rows]
            ckpt.save(step, {"w": bbio.Shard(mine, (rank * rows, 0), full.shape)}).wait(timeout=60)
        beyond = ((size * 4, 0), (2, 5))  # rows step 1 has, step 2 has not
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(want={"w": beyond})
        message = same_everywhere(comm, info.value)
        assert "restoring checkpoint global step 2 failed" in message, message
        assert "not inside its global shape (" in message, message
        empty_beyond = ((size * 4 + 1, 0), (0, 5))  # no element, but not inside either
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(want={"w": empty_beyond})
        assert "not inside its global shape" in same_everywhere(comm, info.value)
        _, edge, _ = ckpt.restore(want={"w": ((size * 4, 0), (0, 5))})  # as numpy slices it
        assert edge["w"].shape == (0, 5)
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(want={"w": ((0, 0), (1, 5)), "nope": ((0,), (1,))})
        assert "no state 'nope'" in same_everywhere(comm, info.value)
        last = size - 1
        box = beyond if rank == last else ((0, 0), (1, 5))  # one rank's box alone is bad
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(want={"w": box})
        assert f"failed on rank {last}:" in same_everywhere(comm, info.value)
        step, back, _ = ckpt.restore(step=1, want={"w": beyond})
        assert step == 1 and back["w"].shape == (2, 5)
        for bad, expected in (  # before: each step "skipped" as if damaged, or a float truncated
            ({"want": {"w": "bad"}}, "want= box of 'w' is 'bad', not (start, shape)"),
            ({"want": [((0, 0), (1, 5))]}, "want= maps state keys to (start, shape) boxes"),
            ({"want": {"w": ((0.5, 0), (1, 5))}}, "want= start of 'w' must be an integer"),
            ({"want": {"w": ((0, 0), (-1, 5))}}, "want= shape of 'w' must be at least 0"),
            ({"from_rank": "0"}, "from_rank must be an integer, not '0' (str)"),
        ):
            good = {"want": {"w": ((0, 0), (1, 5))}} if "want" in bad else {"from_rank": 0}
            with (
                caplog.at_level(logging.WARNING, logger="bbio"),
                pytest.raises(bbio.UsageError) as info,
            ):
                ckpt.restore(**(bad if rank == last else good))
            message = same_everywhere(comm, info.value)
            assert f"restore failed on rank {last}: {expected}" in message, message
            assert "skipped" not in caplog.text  # no checkpoint was looked at
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(step="2")
        assert "step must be an integer, not '2' (str)" in same_everywhere(comm, info.value)


def test_a_closed_checkpointer_says_so_on_every_rank(comm, shared_tmp):
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "shut", config=config_for(comm, shared_tmp)) as ckpt:
        ckpt.save(1, state(1, rank))
        ckpt.close()  # and once more by the with statement: nothing happens
    for call in (
        lambda: ckpt.save(2, state(2, rank)),
        lambda: ckpt.restore(),
        lambda: ckpt.list(),
    ):
        with pytest.raises(bbio.UsageError) as info:
            call()
        message = same_everywhere(comm, info.value)
        assert "checkpointer shut is closed" in message and "new Checkpointer" in message


@pytest.mark.timeout(60)  # before the fix these hung, or took one call's messages for another's
def test_a_checkpointer_closed_on_some_ranks_is_one_usage_error_not_a_hang(comm, shared_tmp):
    """The last rank closes while the others save, then lists while they restore: every
    rank raises the same error naming both calls, nothing is closed, and the checkpointer
    still works."""
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    with bbio.Checkpointer(comm, "some", config=config_for(comm, shared_tmp)) as ckpt:
        ckpt.save(1, state(1, rank))
        with pytest.raises(bbio.UsageError) as info:
            ckpt.close() if rank == last else ckpt.save(2, state(2, rank))
        message = same_everywhere(comm, info.value)
        assert (
            "the ranks are in different collective calls: rank 0 in checkpoint some: save, "
            f"rank {last} in checkpoint some: close" in message
        ), message
        assert "close a checkpointer or a dataset on every rank" in message
        with pytest.raises(bbio.UsageError) as info:
            ckpt.list() if rank == last else ckpt.restore()
        message = same_everywhere(comm, info.value)
        assert f"rank 0 in checkpoint some: restore, rank {last} in checkpoint some: list" in (
            message
        )
        ckpt.save(2, state(2, rank)).wait(timeout=30)
        step, back, _ = ckpt.restore()
        assert step == 2 and same(back, state(2, rank))
        assert [(i.step, i.pfs) for i in ckpt.list()] == [(1, "committed"), (2, "committed")]


def test_a_different_step_on_one_rank_is_a_usage_error_everywhere(comm, shared_tmp):
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "s", config=config_for(comm, shared_tmp)) as ckpt:
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(3 + (rank == 1), state(3, rank))
        assert "step: rank 0 3, rank 1 4" in same_everywhere(comm, info.value)
        comm.Barrier()
        assert not list((shared_tmp / "bb").glob("*/ckpt/s/step-*"))  # refused before any is made
        comm.Barrier()  # every rank looked before the next save
        ckpt.save(5, state(5, rank))  # the checkpointer still works
        assert [i.step for i in ckpt.list()] == [5]


def test_a_bad_close_timeout_on_one_rank_is_a_usage_error_everywhere(comm, shared_tmp):
    rank = comm.Get_rank()
    ckpt = bbio.Checkpointer(comm, "c", config=config_for(comm, shared_tmp))
    ckpt.save(1, state(1, rank))
    with pytest.raises(bbio.UsageError) as info:
        ckpt.close(timeout=-1 if rank == 1 else 30)
    assert "close: timeout must be at least 0" in same_everywhere(comm, info.value)
    ckpt.close(timeout=60)  # nothing was closed: it closes now


def test_a_damaged_task_file_sets_its_save_aside_on_every_node(comm, shared_tmp):
    """A task file that is not JSON on the last node: its save is set aside as one whose
    node file is damaged.  Its handle's wait raises at once on every rank (before: it
    waited for ever), ``close`` ends, and a new job's Checkpointer starts and restores
    (before: it raised the task file's error)."""
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    ckpt = bbio.Checkpointer(comm, "j", config=config)
    ckpt.save(1, state(1, rank)).wait(timeout=60)
    drains = stop_idle_drains(comm, ckpt)
    try:
        handle = ckpt.save(2, state(2, rank))  # queued; no drain has looked at it
        damaged = drain.task_path(ckpt.journal, 2)
        if rank == comm.Get_size() - 1:  # on the last node
            damaged.write_text("{not json")
        comm.Barrier()
    finally:
        for pid in drains:
            os.kill(pid, signal.SIGCONT)
    started = time.monotonic()
    with pytest.raises(bbio.IntegrityError) as info:
        handle.wait(timeout=60)
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "step 2 will not be committed: node 1's drain task file is damaged" in message
    assert "task-00000002.json" in message, message
    ckpt.close(timeout=60)  # set aside: nothing to wait for
    with bbio.Checkpointer(comm, "j", config=config) as again:  # a later job, same nodes
        step, arrays, _ = again.restore()  # step 2 is whole in every node's burst buffer
        assert step == 2 and same(arrays, state(2, rank)) and again.last_restore_tier == "bb"


def test_different_arguments_to_the_constructor_or_restore_are_a_usage_error(comm, shared_tmp):
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with pytest.raises(bbio.UsageError) as info:
        bbio.Checkpointer(comm, "t", keep_bb=1 + (rank == 1), config=config)
    assert "keep_bb: rank 0 1, rank 1 2" in same_everywhere(comm, info.value)
    with bbio.Checkpointer(comm, "t", config=config) as ckpt:
        ckpt.save(1, state(1, rank))
        ckpt.save(2, state(2, rank))
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(step=1 + (rank == 1))
        assert "step: rank 0 1, rank 1 2" in same_everywhere(comm, info.value)
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(from_rank=1 if rank == 1 else None)
        assert "from_rank given: rank 0 False, rank 1 True" in same_everywhere(comm, info.value)
        step, arrays, _ = ckpt.restore(step=np.int64(1) if rank == 0 else 1)  # equal steps
        assert step == 1 and same(arrays, state(1, rank))
    for arguments, expected in (  # before: raw TypeErrors
        ({"name": 7}, "invalid checkpoint name 7"),
        ({"keep_bb": "2"}, "keep_bb must be an integer, not '2' (str)"),
        ({"keep_pfs": 0}, "keep_pfs must be at least 1, not 0"),
        ({"bb_root": 3}, "Checkpointer: bb_root must be a str or a path, not int"),
    ):
        with pytest.raises(bbio.UsageError) as info:
            bbio.Checkpointer(comm, **{"name": "t", "config": config, **arguments})
        assert expected in same_everywhere(comm, info.value), info.value


def test_overlapping_shards_are_refused_and_replicas_are_restored(comm, shared_tmp):
    size, rank = comm.Get_size(), comm.Get_rank()
    config = config_for(comm, shared_tmp)
    full = np.arange(size * 3 * 2, dtype=np.float32).reshape(size * 3, 2)
    with bbio.Checkpointer(comm, "shards", config=config) as ckpt:
        overlapping = bbio.Shard(full[rank * 3 : rank * 3 + 4], (rank * 3, 0), full.shape)
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(1, {"w": overlapping})
        message = same_everywhere(comm, info.value)
        assert "the Shards of 'w' of ranks 0 and 1 overlap: [0:4, 0:2] and [3:" in message
        own = bbio.Shard(full[rank * 3 : rank * 3 + 3], (rank * 3, 0), full.shape)
        replica = bbio.Shard(full, (0, 0), full.shape)  # every rank holds all of it
        ckpt.save(2, {"w": own, "everyone": replica}).wait(timeout=60)
        whole = ((0, 0), full.shape)
        step, arrays, _ = ckpt.restore(want={"w": whole, "everyone": whole})
        assert step == 2 and np.array_equal(arrays["w"], full)
        assert np.array_equal(arrays["everyone"], full)
        part = ((1, 1), (size * 3 - 2, 1))
        step, arrays, _ = ckpt.restore(want={"everyone": part})
        assert np.array_equal(arrays["everyone"], full[1:-1, 1:2])


def test_steps_are_integers_after_the_newest_and_attrs_are_json(comm, shared_tmp):
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "order", config=config) as ckpt:
        handle = ckpt.save(np.int64(5), state(5, rank))  # NumPy's integers too
        for bad, expected in (("60", "a number of seconds or None, not '60'"), (-1, "at least 0")):
            with pytest.raises(bbio.UsageError, match=f"wait: timeout must be {expected}"):
                handle.wait(timeout=bad)
        handle.wait(timeout=60)
        for bad in (4.5, "6", True):
            with pytest.raises(bbio.UsageError) as info:
                ckpt.save(bad, state(6, rank))
            assert "checkpoint steps are integers" in same_everywhere(comm, info.value)
        with pytest.raises(bbio.UsageError) as info:  # before: HDF5's error, as a CollectiveError
            ckpt.save(2**64, state(6, rank))
        assert "from 0 to 2**64 - 1, got 18446744073709551616" in same_everywhere(comm, info.value)
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(6, state(6, rank), attrs={"lr": np.float32(0.1)})
        assert "the attrs of checkpoint 6 are not JSON" in same_everywhere(comm, info.value)
    if rank == 0:  # a later step its job never finished draining: no reason to refuse
        (shared_tmp / "pfs" / "ckpt" / "order" / "step-00000009").mkdir()
    comm.Barrier()
    with bbio.Checkpointer(comm, "order", config=config) as ckpt:  # a later job: from the PFS
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(3, state(3, rank))
        message = same_everywhere(comm, info.value)
        assert "already has step 5, later than step 3" in message, message
        assert not (shared_tmp / "bb" / "0" / "ckpt" / "order" / "step-00000003").exists()
        ckpt.save(5, state(50, rank), replace=True).wait(timeout=60)  # the same step again
        step, arrays, _ = ckpt.restore()
        assert step == 5 and same(arrays, state(50, rank))
        ckpt.save(6, state(6, rank)).wait(timeout=60)  # below the uncommitted step 9


def test_a_rank_with_nothing_to_save_does_not_keep_the_checkpoint_from_committing(comm, shared_tmp):
    size, rank = comm.Get_size(), comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "empty", config=config) as ckpt:
        mine = {} if rank == size - 1 else state(1, rank)
        ckpt.save(1, mine).wait(timeout=60)
        step, arrays, _ = ckpt.restore(from_rank=size - 1)  # from the PFS
        assert step == 1 and arrays == {}
        step, arrays, _ = ckpt.restore(from_rank=0)
        assert same(arrays, state(1, 0))


@pytest.mark.timeout(120)  # before the fix: the save under "block" waited for ever
def test_a_task_an_earlier_job_left_without_its_copy_blocks_nothing(comm, shared_tmp):
    rank, size = comm.Get_rank(), comm.Get_size()
    config = config_for(comm, shared_tmp)
    node = rank // (size // 2)
    if rank % (size // 2) == 0:  # each node's journal holds step 3, its copy gone
        bb_dir = shared_tmp / "bb" / str(node) / layout.CKPT_DIR / "stale"
        journal = drain.journal_dir(bb_dir)
        journal.mkdir(parents=True)
        step = layout.step_dirname(3)
        pfs_step = shared_tmp / "pfs" / layout.CKPT_DIR / "stale" / step
        drain.add_task(
            journal, drain.Task("stale", 3, node, 2, str(bb_dir / step), str(pfs_step), 5)
        )
    comm.Barrier()
    with bbio.Checkpointer(comm, "stale", backpressure="block", config=config) as ckpt:
        ckpt.save(2, state(2, rank)).wait(timeout=60)  # below 3: that step does not count
        step, arrays, _ = ckpt.restore()
        assert step == 2 and same(arrays, state(2, rank))


def test_global_arrays_that_cannot_be_one_view_are_refused_at_save(comm, shared_tmp):
    """Shards of one key in different dtypes (restored truncated before), a key that is
    also another's group (its drain retried for ever), datetimes (a raw HDF5 error), a
    want= box of the wrong rank (every checkpoint looked damaged)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "views", config=config) as ckpt:
        dtype = np.float64 if rank == size - 1 else np.int32
        mixed = bbio.Shard(np.full(2, 3, dtype=dtype), (2 * rank,), (2 * size,))
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(1, {"w": mixed})
        assert "ranks disagree on the dtype of 'w'" in same_everywhere(comm, info.value)
        part = bbio.Shard(np.ones(2), (2 * rank,), (2 * size,))
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(1, {"layer": part, "layer/bias": part})
        assert "'layer' to be both an array and the group" in same_everywhere(comm, info.value)
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(1, {"when": np.array(["2026-12-01"], dtype="datetime64[s]")})
        assert "which bbio cannot store" in same_everywhere(comm, info.value)
        ckpt.save(1, {"w": part}).wait(timeout=60)
        box = ((0, 0), (1, 1)) if rank == size - 1 else ((0,), (1,))
        with pytest.raises(bbio.UsageError) as info:
            ckpt.restore(want={"w": box})
        message = same_everywhere(comm, info.value)
        assert "is not a box of its 1 dimension(s)" in message, message


def unstorable(rank: int) -> dict:
    """What training codes hold besides arrays, by rank: a nested optimizer state, a ragged
    list, and where torch is installed a bfloat16 tensor (NumPy has no such dtype)."""
    values: list = [{"state": {"0": np.ones(2)}}, [[1, 2], [3]]]
    if importlib.util.find_spec("torch") is not None:
        import torch

        values.append(torch.ones(3, dtype=torch.bfloat16))
    return {"opt": values[rank % len(values)]}


def test_state_that_cannot_be_an_array_is_one_usage_error_not_a_raw_one(comm, shared_tmp):
    """Before, a nested dict was "dtype object", a list of arrays an AttributeError, and a
    bfloat16 tensor or a ragged list a CollectiveError carrying NumPy's TypeError or
    ValueError."""
    rank = comm.Get_rank()
    expected = [
        "state 'opt' is a dict, not an array: bbio saves one flat dict of arrays",
        "state 'opt' (list) cannot be made a NumPy array",
        "state 'opt' (Tensor) cannot be made a NumPy array",
    ]
    with bbio.Checkpointer(comm, "kinds", config=config_for(comm, shared_tmp)) as ckpt:
        for bad_rank in range(comm.Get_size()):
            arrays = unstorable(bad_rank) if rank == bad_rank else {"opt": np.ones(2)}
            with pytest.raises(bbio.UsageError) as info:
                ckpt.save(1, arrays)
            message = same_everywhere(comm, info.value)
            kind = bad_rank % (2 + (importlib.util.find_spec("torch") is not None))
            assert f"failed on rank {bad_rank}: step 1: {expected[kind]}" in message, message
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(1, [np.ones(2)] if rank == 0 else {"opt": np.ones(2)})
        message = same_everywhere(comm, info.value)  # before: AttributeError, no .items()
        assert "failed on rank 0: step 1: the state to save is a list, not a dict" in message
        ckpt.save(1, {"opt/state/0": np.ones(2)}).wait(timeout=60)  # flattened, as the hint says
        assert ckpt.restore()[0] == 1
    with pytest.raises(bbio.UsageError, match=r"a Shard's data \(list\) cannot be made a NumPy"):
        bbio.Shard([[1, 2], [3]], (0,), (2,))


class FailsOnItsSecondRead:
    """State whose bytes cannot be read a second time: the save's check reads it, its
    write fails (as a device error would)."""

    def __init__(self) -> None:
        self.reads = 0

    def __array__(self, dtype=None, copy=None):
        self.reads += 1
        if self.reads == 2:
            raise OSError(5, "the state's device failed")
        return np.arange(4.0)


def test_a_save_that_failed_on_one_rank_refuses_no_lower_step(comm, shared_tmp):
    """Before, the withdrawn step 10 still refused step 9 ("already has step 10")."""
    rank = comm.Get_rank()
    with bbio.Checkpointer(comm, "withdrawn", config=config_for(comm, shared_tmp)) as ckpt:
        ckpt.save(5, state(5, rank)).wait(timeout=60)
        flaky = FailsOnItsSecondRead() if rank == 1 else np.arange(4.0)
        with pytest.raises(bbio.BBIOError) as info:
            ckpt.save(10, {"w": flaky})
        assert "the state's device failed" in same_everywhere(comm, info.value)
        assert [info.step for info in ckpt.list()] == [5]
        ckpt.save(9, state(9, rank)).wait(timeout=60)
        step, arrays, _ = ckpt.restore()
        assert step == 9 and same(arrays, state(9, rank))


def test_values_that_would_not_come_back_as_saved_are_refused(comm, shared_tmp):
    """Before: bfloat16 restored as raw bytes (|V2), int attrs keys as strings, NaN written
    into the manifest; a NUL in a key, a 33-dimension array, a Shard at 2**63 and a name
    of 256 bytes failed inside HDF5, NumPy or mkdir."""
    import ml_dtypes

    rank, size = comm.Get_rank(), comm.Get_size()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "odd", config=config) as ckpt:
        refused = [
            ({"w": np.ones(3, ml_dtypes.bfloat16)}, None, "has dtype bfloat16, which NumPy"),
            ({"w": np.zeros((1,) * 33)}, None, "has 33 dimensions; HDF5 stores at most 32"),
            ({"w": np.zeros(2, "V0")}, None, "has dtype |V0, which bbio cannot store"),
            ({"w\0": np.ones(2)}, None, "invalid state key 'w\\x00'"),
            ({"a\ud800": np.ones(2)}, None, "invalid state key 'a\\ud800'"),
            (state(1, rank), {"schedule": {10: 0.1}}, "the key 10 is not a string"),
            (state(1, rank), {"loss": float("nan")}, "Out of range float values"),
        ]
        for bad_rank in range(size):
            for arrays, attrs, expected in refused:
                mine = arrays if rank == bad_rank else state(1, rank)
                with pytest.raises(bbio.UsageError) as info:
                    ckpt.save(1, mine, attrs=attrs)
                assert expected in same_everywhere(comm, info.value), info.value
        with pytest.raises(bbio.UsageError) as info:
            bbio.Shard(np.ones(1), (2**63,), (2**63 + 1,))
        assert "has an entry above 2**63 - 1" in str(info.value)
        bits = np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16)
        saved = {"bits": bits.view(np.uint16)}  # as the hint says
        ckpt.save(1, saved, attrs={"betas": (0.9, 0.999)}).wait(timeout=60)
        _, arrays, attrs = ckpt.restore()
        assert np.array_equal(arrays["bits"].view(ml_dtypes.bfloat16), bits)
        assert attrs["betas"] == [0.9, 0.999]  # JSON: a tuple comes back as a list
    for name in ("a\0b", "x" * 256):
        with pytest.raises(bbio.UsageError) as info:
            bbio.Checkpointer(comm, name, config=config)
        assert "invalid checkpoint name" in same_everywhere(comm, info.value)
    keep = np.int64(2) if rank == 0 else 2  # equal arguments: before, "different arguments"
    bbio.Checkpointer(comm, "x" * 255, keep_bb=keep, config=config).close()


def test_a_second_open_checkpointer_of_the_same_directories_is_refused(comm, shared_tmp):
    """Before, the second one's save of step 5 went below the first one's step 10, and
    both were committed."""
    rank = comm.Get_rank()
    config = config_for(comm, shared_tmp)
    with bbio.Checkpointer(comm, "twice", config=config) as first:
        first.save(10, state(10, rank))
        with pytest.raises(bbio.UsageError) as info:
            bbio.Checkpointer(comm, "twice", config=config)
        assert "checkpointer twice is already open" in same_everywhere(comm, info.value)
        other_bb = config_for(comm, shared_tmp, bb_root=str(shared_tmp / "bb2" / "{node}"))
        with pytest.raises(bbio.UsageError):  # the same PFS directory
            bbio.Checkpointer(comm, "twice", config=other_bb)
    with bbio.Checkpointer(comm, "twice", config=config) as again:  # once closed: a new one
        assert [info.step for info in again.list()] == [10]
        with pytest.raises(bbio.UsageError, match="already has step 10, later than step 5"):
            again.save(5, state(5, rank))
