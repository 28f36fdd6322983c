"""MPI helpers: real and virtual node topology, agreement on errors, no hangs."""

from __future__ import annotations

import time

import numpy as np
import pytest

import bbio
from bbio.mpi import agreed, all_agree, same_arguments, topology, wait_all_ranks, wait_quietly

pytestmark = pytest.mark.mpi(min_size=2)


def test_virtual_nodes_group_consecutive_ranks(comm):
    topo = topology(comm, ranks_per_node=2)
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        assert topo.virtual
        assert topo.node == rank // 2
        assert topo.nodes == (size + 1) // 2
        assert topo.node_comm.Get_size() == min(2, size - 2 * topo.node)
        assert topo.is_leader == (rank % 2 == 0)
        if topo.is_leader:
            assert topo.leader_comm.Get_size() == topo.nodes
            assert topo.leader_comm.Get_rank() == topo.node
        else:
            assert topo.leader_comm is None
        assert topo.node_of_rank() == [r // 2 for r in range(size)]
    finally:
        topo.free()


def test_real_nodes_are_hosts(comm):
    topo = topology(comm, ranks_per_node=None)
    try:
        assert not topo.virtual
        assert topo.nodes == 1  # one machine
        assert topo.node == 0
        assert topo.node_comm.Get_size() == comm.Get_size()
    finally:
        topo.free()


def test_all_agree(comm):
    assert all_agree(comm, True)
    assert not all_agree(comm, comm.Get_rank() != 1)


def test_different_arguments_on_one_rank_are_the_same_usage_error_everywhere(comm):
    rank = comm.Get_rank()
    ids = np.arange(10)
    same_arguments(comm, "the loader", {"batch_size": 4, "ids": ids, "path": "/pfs/x"})
    with pytest.raises(bbio.UsageError) as info:
        same_arguments(comm, "the loader", {"batch_size": 4, "ids": ids + (rank == 1), "seed": 0})
    message = str(info.value)
    assert "the loader: the ranks passed different arguments (ids: rank 0 array(" in message
    assert "rank 1 array(" in message and "seed" not in message
    assert comm.allgather(message) == [message] * comm.Get_size()


def test_one_failing_rank_makes_every_rank_raise_the_same_error(comm):
    with pytest.raises(bbio.NotFoundError) as info, agreed(comm, "opening the dataset"):
        if comm.Get_rank() == 1:
            raise bbio.NotFoundError("no such dataset", path="/pfs/data")
    message = str(info.value)
    assert message.startswith("opening the dataset failed on rank 1: no such dataset")
    assert "/pfs/data" in message
    assert comm.allgather(message) == [message] * comm.Get_size()


def test_foreign_exceptions_become_collective_errors(comm):
    with pytest.raises(bbio.CollectiveError) as info, agreed(comm, "planning"):
        if comm.Get_rank() >= 1:
            raise KeyError("sample 7")
    message = str(info.value)
    assert message.startswith("planning failed on rank 1")
    assert message.endswith(": KeyError: 'sample 7'")
    if comm.Get_size() > 2:
        assert "(ranks 2" in message
    assert comm.allgather(message) == [message] * comm.Get_size()


def test_the_same_failure_on_every_rank_names_no_rank(comm):
    with pytest.raises(bbio.ConfigError) as info, agreed(comm, "reading settings"):
        raise bbio.ConfigError("bad value")
    assert str(info.value) == "reading settings failed: bad value"


def test_agreed_passes_when_all_succeed(comm):
    with agreed(comm, "nothing"):
        value = comm.Get_rank()
    assert value == comm.Get_rank()


def test_agreed_sums_the_counters_the_block_fills_in(comm):
    totals = np.zeros(2, dtype=np.int64)
    with agreed(comm, "counting", totals):
        totals[:] = 1, comm.Get_rank()
    assert totals.tolist() == [comm.Get_size(), sum(range(comm.Get_size()))]
    with pytest.raises(bbio.UsageError), agreed(comm, "counting", totals):
        totals[:] = 1, 1
        if comm.Get_rank() == 0:
            raise bbio.UsageError("bad id")


@pytest.mark.parametrize("late_seconds", [0.0005, 0.05])  # while yielding; once sleeping
def test_wait_quietly_returns_once_the_requests_are_complete(comm, late_seconds):
    from mpi4py import MPI

    comm.Barrier()
    if comm.Get_rank() == 0:
        time.sleep(late_seconds)
    total = np.array([comm.Get_rank() + 1], dtype=np.int64)
    wait_quietly(comm.Iallreduce(MPI.IN_PLACE, total, op=MPI.SUM))
    assert total[0] == sum(range(1, comm.Get_size() + 1))


def test_wait_all_ranks_times_out_instead_of_hanging(comm):
    if comm.Get_rank() == 0:
        with pytest.raises(bbio.BBIOTimeoutError, match="other ranks did not arrive"):
            wait_all_ranks(comm, 0.5, "late barrier")
        for other in range(1, comm.Get_size()):
            comm.send("timed out", dest=other)  # only now may the others arrive
    else:
        assert comm.recv(source=0) == "timed out"
        comm.Ibarrier().Wait()  # matches rank 0's abandoned barrier, which then completes


def test_a_subclass_of_a_bbio_error_keeps_its_bbio_class_and_errno(comm):
    class RequestProblem(bbio.UsageError):
        pass

    with pytest.raises(bbio.UsageError) as info, agreed(comm, "restoring"):
        if comm.Get_rank() == 1:
            raise RequestProblem("no such slice")
    assert "no such slice" in str(info.value)
    with pytest.raises(bbio.NotFoundError) as missing, agreed(comm, "opening"):
        if comm.Get_rank() == 0:
            raise bbio.NotFoundError("gone", path="/pfs/x", errno=2)
    assert missing.value.errno == 2
