"""Collective reads refuse, with one clear error on every rank, what used to give raw MPI
errors, hangs, errors from deep inside or silently wrong sizes: a direct read while a
prefetching loader is mid-iteration, a bad setting on one rank at open, records whose
size overflows int64, and ``read_planned`` of something that is not a list.  On 2 or 4
ranks in 2 virtual nodes; every test is bounded by a timeout (the cases that hung
before the fixes are tested through the error raised on every rank, not reproduced)."""

from __future__ import annotations

import numpy as np
import pytest

import bbio
from tests.test_read import MODES, config_for
from tests.test_read_usage import same_everywhere

pytestmark = pytest.mark.mpi(min_size=2)

RECORDS = 400  # int64 records of 16 bytes: record i holds i twice
HINT = "close the loader (or iterate it to its end) before reading the dataset directly"


@pytest.fixture
def raw(comm, shared_tmp):
    """A raw file of RECORDS 16-byte records, record i holding the int64 i twice."""
    path = shared_tmp / "pfs" / "x.raw"
    if comm.Get_rank() == 0:
        path.parent.mkdir(parents=True)
        np.arange(RECORDS, dtype=np.int64).repeat(2).tofile(path)
    comm.Barrier()
    return path


def values(batch: np.ndarray) -> list[int]:
    return batch.view(np.int64)[:, 0].tolist()


def direct_read(ds, call: str, ids: np.ndarray, comm):
    """ds.read of this rank's ``ids``, or ds.read_planned of every rank's."""
    if call == "read":
        return ds.read(ids)
    return ds.read_planned(comm.allgather(ids))


# ------------------------------------------------ a read while a loader prefetches


@pytest.mark.timeout(60)  # before the fix: raw MPI errors (MPI_ERR_IN_STATUS) or a hang
@pytest.mark.parametrize("mode", ["aggregated", "alone"])
@pytest.mark.parametrize("call", ["read", "read_planned"])
def test_a_read_inside_the_loop_of_a_prefetching_loader_is_one_usage_error(
    comm, shared_tmp, raw, call, mode
):
    """A validation read inside the training loop: refused on every rank, the loader goes on
    undisturbed to its end, and then the dataset reads again."""
    config = config_for(comm, shared_tmp, **MODES[mode])
    ids = np.arange(comm.Get_rank(), 40, comm.Get_size())
    with bbio.open_dataset(comm, raw, record_bytes=16, config=config) as ds:
        loader = bbio.Loader(comm, ds, batch_size=8, seed=3, prefetch=3)
        steps = 0
        for batch in loader:
            assert values(batch) == loader.indices.tolist()  # its own reads are not blocked
            if steps == 1:
                with pytest.raises(bbio.UsageError) as info:
                    direct_read(ds, call, ids, comm)
                message = same_everywhere(comm, info.value)
                assert f"{call} of the dataset {raw} while a prefetching Loader" in message
                assert HINT[1:] in message, message
            steps += 1
        assert steps == len(loader)  # at its end: reading is allowed again, before close()
        assert values(direct_read(ds, call, ids, comm)) == ids.tolist()
        loader.close()


@pytest.mark.timeout(60)  # before the fix: raw MPI errors or a hang
@pytest.mark.parametrize("call", ["read", "read_planned"])
def test_a_read_after_break_before_close_is_one_usage_error(comm, shared_tmp, raw, call):
    """A loop left with ``break`` (a max_steps limit): the loader still prefetches until it
    is closed; a read is refused until then, and correct after."""
    config = config_for(comm, shared_tmp, **MODES["aggregated"])
    ids = np.arange(comm.Get_rank(), 64, comm.Get_size())
    with bbio.open_dataset(comm, raw, record_bytes=16, config=config) as ds:
        loader = bbio.Loader(comm, ds, batch_size=4, seed=1, epochs=3, prefetch=4)
        for step, _ in enumerate(loader):
            if step == 1:
                break
        for _ in range(2):  # refused each time, and the communicator stays usable
            with pytest.raises(bbio.UsageError) as info:
                direct_read(ds, call, ids, comm)
            message = same_everywhere(comm, info.value)
            assert "mid-iteration" in message and HINT[1:] in message, message
        loader.close()
        assert values(direct_read(ds, call, ids, comm)) == ids.tolist()


@pytest.mark.timeout(60)
def test_a_read_inside_the_loop_of_a_loader_without_prefetch_is_allowed(comm, shared_tmp, raw):
    """Such a loader reads in the foreground: nothing runs beside the read."""
    config = config_for(comm, shared_tmp, **MODES["aggregated"])
    ids = np.arange(comm.Get_rank(), 40, comm.Get_size())
    with (
        bbio.open_dataset(comm, raw, record_bytes=16, config=config) as ds,
        bbio.Loader(comm, ds, batch_size=8, seed=3, prefetch=0) as loader,
    ):
        for step, batch in enumerate(loader):
            assert values(batch) == loader.indices.tolist()
            assert values(ds.read(ids + step)) == (ids + step).tolist()


# ------------------------------------------------ a bad setting on one rank at open


@pytest.mark.timeout(60)  # before the fix the other ranks hung in comm.Dup()
def test_a_bad_setting_on_one_rank_is_one_config_error_at_open(comm, shared_tmp, raw, monkeypatch):
    monkeypatch.setenv("BBIO_BB_ROOT", str(shared_tmp / "bb" / "{node}"))
    if comm.Get_rank() == comm.Get_size() - 1:
        monkeypatch.setenv("BBIO_READ_MAX_HOLE", "64k")  # a typo in one node's environment
    with pytest.raises(bbio.ConfigError) as info:
        bbio.open_dataset(comm, raw, record_bytes=16)
    message = same_everywhere(comm, info.value)
    assert f"on rank {comm.Get_size() - 1}" in message, message
    assert "BBIO_READ_MAX_HOLE" in message and "read_max_hole" in message, message
    monkeypatch.delenv("BBIO_READ_MAX_HOLE", raising=False)
    with bbio.open_dataset(comm, raw, record_bytes=16) as ds:  # in step again
        assert len(ds) == RECORDS


# ------------------------------------------------ records too large for int64


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [
        {"sample_shape": (2**40, 2**24), "dtype": "u1"},  # 2**64 bytes: wrapped to 0
        {"sample_shape": (2**62 + 1, 4), "dtype": "u1"},  # wrapped to 4: opened as 16 records
        {"sample_shape": (2**31, 2**31), "dtype": "f8"},  # 2**65 bytes
        {"sample_shape": (2**60 + 1,), "dtype": "i4"},
        {"record_bytes": 2**62 + 1},
    ],
)
def test_records_larger_than_2_to_the_62_bytes_are_one_usage_error(comm, shared_tmp, raw, options):
    config = config_for(comm, shared_tmp)
    with pytest.raises(bbio.UsageError) as info:
        bbio.open_dataset(comm, raw, config=config, **options)
    message = same_everywhere(comm, info.value)
    assert "bytes is too large: records may be at most 4611686018427387904 bytes" in message
    assert str(raw) in message and "record_bytes=" in message, message


@pytest.mark.timeout(60)
def test_a_record_of_exactly_2_to_the_62_bytes_is_checked_against_the_file(comm, shared_tmp, raw):
    """The limit itself is allowed: the file's size then refuses it, with its own message."""
    config = config_for(comm, shared_tmp)
    with pytest.raises(bbio.UsageError) as info:
        bbio.open_dataset(comm, raw, sample_shape=(2**59,), dtype="f8", config=config)
    message = same_everywhere(comm, info.value)
    assert f"not a whole number of {2**62}-byte records" in message, message


# ------------------------------------------------ read_planned of something not a list


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("given", ["None", "generator", "dict", "set", "0-d array", "str"])
def test_read_planned_of_something_not_a_list_is_one_usage_error(
    comm, shared_tmp, raw, mode, given
):
    size = comm.Get_size()
    requests = {
        "None": lambda: None,
        "generator": lambda: ([r] for r in range(size)),
        "dict": lambda: {r: [r] for r in range(size)},  # before: its keys were read as ids
        "set": lambda: set(range(size)),
        "0-d array": lambda: np.array(5),
        "str": lambda: "0" * size,
    }[given]()
    config = config_for(comm, shared_tmp, **MODES[mode])
    with bbio.open_dataset(comm, raw, record_bytes=16, config=config) as ds:
        with pytest.raises(bbio.UsageError) as info:
            ds.read_planned(requests)
        message = same_everywhere(comm, info.value)
        assert f"read_planned needs every rank's ids as one sequence per rank ({size})" in message
        assert "Pass a list or numpy array of requests" in message, message
        assert str(raw) in message, message
        everyone = [np.array([r, r + 1]) for r in range(size)]  # still in step
        assert values(ds.read_planned(everyone)) == everyone[comm.Get_rank()].tolist()
        assert values(ds.read_planned(np.stack(everyone))) == everyone[comm.Get_rank()].tolist()
