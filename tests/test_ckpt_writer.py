"""The node file's root attributes, set anew on a recycled file (serial, real HDF5 files)."""

from __future__ import annotations

import json

import h5py
import numpy as np

from bbio.checkpoint import layout
from bbio.checkpoint.writer import _set_root_attrs, file_attrs


def read_root_attrs(path) -> dict:
    with h5py.File(path, "r") as f:
        return {name: f.attrs[name] for name in f.attrs}


def test_root_attributes_are_rewritten_in_place_or_replaced_when_their_type_changed(tmp_path):
    """A recycled file's attributes of the same type and shape are overwritten (strings
    of another length too); one whose shape or type changed, or that is missing, is set
    as h5py would set it; the file holds exactly the new values."""
    path = tmp_path / "node.h5"
    old = file_attrs(3, 1.5, 4, 2, 0, [0, 1], layout.PER_RANK, {}, {"lr": 0.1})
    with h5py.File(path, "w") as f:
        f.attrs.update(old)
        f.attrs["user_attrs"] = 7  # a number where a string goes now
        del f.attrs["bbio"]  # missing: created
    new = file_attrs(4, 2.25, 6, 2, 0, [0, 1, 2], layout.PER_RANK, {}, {"lr": 0.05, "epoch": 2})
    crcs = {"w/r00000": 1, "w/r00001": 2**32 - 1}
    with h5py.File(path, "r+") as f:
        _set_root_attrs(h5py, f, new, crcs)
    back = read_root_attrs(path)
    assert set(back) == set(new) | {layout.CRC_ATTR}
    for name, value in new.items():
        assert np.array_equal(back[name], value), (name, back[name], value)
        assert isinstance(back[name], str) == isinstance(value, str), name
    assert json.loads(back[layout.CRC_ATTR]) == crcs
    assert back["node_ranks"].shape == (3,)  # was (2,): replaced, not cut to fit
    assert back["time"] == 2.25 and back["step"] == 4
