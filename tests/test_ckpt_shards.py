"""Shards of global arrays: their arguments are integers in tuples or lists, and the
ranks' Shards of a key cover the whole global array.  A bad Shard or a gap is one
clear ``UsageError``, the same on every rank, at save.  Serial checks of the pure
functions, then saves on 2 or 4 ranks in 2 virtual nodes."""

from __future__ import annotations

import numpy as np
import pytest

import bbio
from bbio.checkpoint import layout
from bbio.checkpoint.writer import describe, global_shapes
from tests.test_checkpoint import config_for
from tests.test_checkpoint_usage import same_everywhere


def specs(*shards: bbio.Shard) -> list[dict[str, dict]]:
    """What save gathers from ranks holding ``shards`` of the state key ``w``."""
    return [describe({"w": shard}) for shard in shards]


def tampered(shard: bbio.Shard, **fields: object) -> bbio.Shard:
    """``shard`` with ``fields`` set behind its constructor's back (as unpickling does)."""
    for name, value in fields.items():
        object.__setattr__(shard, name, value)
    return shard


@pytest.mark.parametrize(
    ("start", "global_shape", "expected"),
    [
        ((1.9, 0), (4, 4), "each entry of a Shard's start must be an integer, not 1.9 (float)"),
        ((0, 0), (4.99, 4), "each entry of a Shard's global_shape must be an integer, not 4.99"),
        ((True, 0), (4, 4), "each entry of a Shard's start must be an integer, not True (bool)"),
        (("3", 0), (4, 4), "each entry of a Shard's start must be an integer, not '3' (str)"),
        ((np.float64(1), 0), (4, 4), "a Shard's start must be an integer, not np.float64(1.0)"),
        ((-1, 0), (4, 4), "each entry of a Shard's start must be at least 0, not -1"),
        (0, (4, 4), "a Shard's start must be a tuple or list of integers, not 0 (int)"),
        ((0, 0), 4.99, "a Shard's global_shape must be a tuple or list of integers, not 4.99"),
        ("00", (4, 4), "a Shard's start must be a tuple or list of integers, not '00' (str)"),
    ],
)
def test_a_shard_takes_integers_only_and_says_what_is_wrong(start, global_shape, expected):
    with pytest.raises(bbio.UsageError) as info:
        bbio.Shard(np.zeros((2, 2)), start, global_shape)
    assert expected in str(info.value), info.value


def test_shards_hold_int_tuples_and_describe_checks_them_again():
    """NumPy integers and lists become int tuples; a Shard changed after it was built
    (unpickled, or set with object.__setattr__) is checked again when save describes it."""
    shard = bbio.Shard(np.zeros((2, 3)), [np.int64(2), np.uint8(0)], [np.int32(4), 3])
    assert shard.start == (2, 0) and shard.global_shape == (4, 3)
    assert all(type(n) is int for n in (*shard.start, *shard.global_shape))
    assert describe({"w": shard})["w"]["start"] == [2, 0]
    with pytest.raises(bbio.UsageError) as info:
        describe({"w": tampered(shard, start=(1.9, 0))})
    message = str(info.value)
    assert "state 'w': each entry of a Shard's start must be an integer, not 1.9" in message


def test_gaps_are_refused_but_not_replicas_empty_shards_scalars_or_empty_arrays():
    top, bottom = np.zeros((3, 4)), np.zeros((2, 4))
    gap = specs(bbio.Shard(top, (0, 0), (6, 4)), bbio.Shard(bottom, (4, 0), (6, 4)))
    with pytest.raises(bbio.UsageError) as info:
        global_shapes(gap, layout.GLOBAL)
    message = str(info.value)
    assert "the Shards of 'w' leave 4 of the 24 elements of its global shape (6, 4)" in message
    assert "in no rank's Shard" in message and "per-rank arrays" in message, message
    alone = specs(bbio.Shard(top, (0, 0), (6, 4)), bbio.Shard(top, (0, 0), (6, 4)))
    with pytest.raises(bbio.UsageError, match="leave 12 of the 24 elements"):  # replicas count once
        global_shapes(alone, layout.GLOBAL)
    nothing = specs(bbio.Shard(np.zeros((0, 4)), (6, 0), (6, 4)))
    with pytest.raises(bbio.UsageError, match="leave 24 of the 24 elements"):
        global_shapes(nothing, layout.GLOBAL)
    full = np.zeros((6, 4))
    rows = specs(
        bbio.Shard(full[:3], (0, 0), full.shape),
        bbio.Shard(full[3:], (3, 0), full.shape),
        bbio.Shard(full[3:], (3, 0), full.shape),  # a replica
        bbio.Shard(full[:0], (2, 0), full.shape),  # empty
    )
    assert global_shapes(rows, layout.GLOBAL) == {"w": [6, 4]}
    scalar = specs(bbio.Shard(np.float64(1), (), ()), bbio.Shard(np.float64(1), (), ()))
    assert global_shapes(scalar, layout.GLOBAL) == {"w": []}
    flat = specs(bbio.Shard(np.zeros((0, 4)), (0, 0), (0, 4)))  # no element to cover
    assert global_shapes(flat, layout.GLOBAL) == {"w": [0, 4]}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_bad_shard_on_one_rank_is_the_same_usage_error_on_every_rank(comm, shared_tmp):
    size, rank = comm.Get_size(), comm.Get_rank()
    full = np.arange(size * 2 * 3, dtype=np.float64).reshape(size * 2, 3)
    with bbio.Checkpointer(comm, "bad", config=config_for(comm, shared_tmp)) as ckpt:
        for bad_rank in range(size):
            mine = bbio.Shard(full[2 * rank : 2 * rank + 2], (2 * rank, 0), full.shape)
            if rank == bad_rank:
                mine = tampered(mine, start=(2 * rank + 0.5, 0))
            with pytest.raises(bbio.UsageError) as info:
                ckpt.save(1, {"w": mine})
            message = same_everywhere(comm, info.value)
            assert f"failed on rank {bad_rank}: step 1: state 'w': each entry of a Shard's " in (
                message
            ), message
            assert f"start must be an integer, not {2 * bad_rank + 0.5} (float)" in message
        mine = bbio.Shard(full[2 * rank : 2 * rank + 2], (2 * rank, 0), full.shape)
        ckpt.save(1, {"w": mine}).wait(timeout=60)
        step, arrays, _ = ckpt.restore(want={"w": ((0, 0), full.shape)})
        assert step == 1 and np.array_equal(arrays["w"], full)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_gap_in_a_global_array_is_refused_on_every_rank(comm, shared_tmp):
    """Before, the gap read as zeros from global.h5 and a restore of the whole array failed."""
    size, rank = comm.Get_size(), comm.Get_rank()
    full = np.arange(size * 3 * 2, dtype=np.float32).reshape(size * 3, 2)
    with bbio.Checkpointer(comm, "gaps", config=config_for(comm, shared_tmp)) as ckpt:
        held = full[3 * rank : 3 * rank + (2 if rank == size - 1 else 3)]  # not the last row
        with pytest.raises(bbio.UsageError) as info:
            ckpt.save(1, {"w": bbio.Shard(held, (3 * rank, 0), full.shape)})
        message = same_everywhere(comm, info.value)
        expected = f"'w' leave 2 of the {full.size} elements of its global shape {full.shape}"
        assert expected in message, message
        assert not ckpt.list()
        owned = {
            "w": bbio.Shard(full[3 * rank : 3 * rank + 3], (3 * rank, 0), full.shape),
            "scalar": bbio.Shard(np.float64(2.5), (), ()),
            "none": bbio.Shard(np.zeros((0, 2)), (0, 0), (0, 2)),
        }
        ckpt.save(2, owned).wait(timeout=60)
        whole = {"w": ((0, 0), full.shape), "scalar": ((), ()), "none": ((0, 0), (0, 2))}
        step, arrays, _ = ckpt.restore(want=whole)
        assert step == 2 and np.array_equal(arrays["w"], full)
        assert arrays["scalar"] == 2.5 and arrays["none"].shape == (0, 2)
