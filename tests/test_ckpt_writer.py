"""A recycled node file's checks and root attributes (serial, real HDF5 files)."""

from __future__ import annotations

import json
import tracemalloc

import h5py
import numpy as np
import pytest

from bbio.checkpoint import layout
from bbio.checkpoint.writer import (
    _create_datasets,
    _set_root_attrs,
    _spare_offsets,
    _write_raw,
    describe,
    file_attrs,
)
from bbio.errors import IntegrityError


def read_root_attrs(path) -> dict:
    with h5py.File(path, "r") as f:
        return {name: f.attrs[name] for name in f.attrs}


def test_root_attributes_are_rewritten_in_place_or_replaced_when_their_type_changed(
    tmp_path, monkeypatch
):
    """A recycled file's attributes stored as h5py stores the new values are overwritten
    in place (a string of another length too); one whose shape or type changed, or
    that is missing, is set anew through h5py's attribute manager; the file then holds
    exactly the new values."""
    path = tmp_path / "node.h5"
    old = file_attrs(3, 1.5, 4, 2, 0, [0, 1], layout.PER_RANK, {}, {"lr": 0.1})
    with h5py.File(path, "w") as f:
        f.attrs.update(old)
        f.attrs["nodes"] = "2"  # a string where a number goes now
        del f.attrs["bbio"]  # missing: created
    new = file_attrs(4, 2.25, 6, 2, 0, [0, 1, 2], layout.PER_RANK, {}, {"lr": 0.05, "epoch": 2})
    crcs = {"w/r00000": 1, "w/r00001": 2**32 - 1}
    set_anew = []
    setitem = h5py.AttributeManager.__setitem__

    def recording_setitem(self, name, value):
        set_anew.append(name)
        setitem(self, name, value)

    monkeypatch.setattr(h5py.AttributeManager, "__setitem__", recording_setitem)
    with h5py.File(path, "r+") as f:
        _set_root_attrs(h5py, f, new, {name: (crc, 4096) for name, crc in crcs.items()})
    monkeypatch.undo()
    assert sorted(set_anew) == ["bbio", "crc32c", "node_ranks", "nodes"]  # the rest in place
    back = read_root_attrs(path)
    assert set(back) == set(new) | {layout.CRC_ATTR}
    for name, value in new.items():
        assert np.array_equal(back[name], value), (name, back[name], value)
        assert isinstance(back[name], str) == isinstance(value, str), name
    assert json.loads(back[layout.CRC_ATTR]) == crcs
    assert json.loads(back["user_attrs"]) == {"lr": 0.05, "epoch": 2}  # longer than before
    assert back["node_ranks"].shape == (3,)  # was (2,): replaced, not cut to fit
    assert back["time"] == 2.25 and back["step"] == 4


def node_specs(shape=(3, 4)) -> list:
    return [
        (rank, describe({"w": np.zeros(shape, np.float32), "e": np.zeros(0, np.int8)}))
        for rank in (0, 1)
    ]


def test_a_spare_gives_its_datasets_offsets_only_if_it_holds_exactly_the_saved_arrays(
    tmp_path,
):
    """The offsets read through the low-level API are HDF5's own; a spare whose dataset
    has another shape, or that holds a dataset the save does not have, is refused."""
    path = tmp_path / "spare.h5"
    with h5py.File(path, "w") as f:
        _create_datasets(h5py, f, node_specs())
        expected = {name: f[name].id.get_offset() for name in ("w/r00000", "w/r00001", "e/r00000")}
    with h5py.File(path, "r") as f:
        offsets = _spare_offsets(h5py, f, node_specs())
        assert {name: offsets[name] for name in expected} == expected
        assert offsets["e/r00000"] is None and offsets["e/r00001"] is None  # no bytes
        with pytest.raises(IntegrityError, match=r"w/r00000 is \(3, 4\)"):
            _spare_offsets(h5py, f, node_specs(shape=(4, 3)))
    with h5py.File(path, "r+") as f:
        f.create_dataset("extra", data=np.ones(2))
    with h5py.File(path, "r") as f, pytest.raises(IntegrityError, match="extra"):
        _spare_offsets(h5py, f, node_specs())


def test_arrays_not_contiguous_are_copied_one_at_a_time_as_they_are_written(tmp_path):
    """Eight column slices of 4 MiB each: each needs a contiguous copy to be written,
    and the copies are made one by one (before, all eight were held at once)."""
    each, count = 4 << 20, 8
    arrays = {f"a{i}": np.full((512, 2 * each // 512), i, np.uint8)[:, ::2] for i in range(count)}
    assert not arrays["a0"].flags.c_contiguous and arrays["a0"].nbytes == each
    offsets = {layout.rank_dataset(key, 0): i * each for i, key in enumerate(arrays)}
    path = tmp_path / "node.h5"
    path.write_bytes(bytes(count * each))
    tracemalloc.start()
    try:
        written = _write_raw(path, 0, arrays, offsets.__getitem__)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * each  # two at most: the next copy is made before the last is freed
    data = path.read_bytes()
    for i, key in enumerate(arrays):
        assert written[layout.rank_dataset(key, 0)][1] == i * each
        assert data[i * each : (i + 1) * each] == bytes([i]) * each
