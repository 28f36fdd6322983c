"""State keys with ``%`` in them, without MPI: HDF5 reads ``%`` in the source names of
virtual datasets as a printf-style specifier, so ``global.h5`` must escape it and
still map every key onto its saved arrays, for both layouts."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from bbio import _native
from bbio.checkpoint import drain, layout
from bbio.checkpoint.globalview import describe_node_file, global_view, merge_descriptions
from bbio.checkpoint.writer import file_attrs
from bbio.transfer import files

PERCENT_KEYS = ("acc%b", "top5%", "p%%q", "50%/x", "a%d%%%s", "grad_Δ%")
KEYS = (*PERCENT_KEYS, "weights")
NODE_RANKS = ((0, [0, 1]), (1, [2, 3]))
RANKS = 4
ROWS = 3  # of each rank's slice of a global array


def rank_array(key: str, rank: int) -> np.ndarray:
    """What ``rank`` saved under ``key``: per-rank, or its rows of the global array."""
    seed = KEYS.index(key) * 100 + rank + 1
    return np.arange(ROWS * 4, dtype=np.float64).reshape(ROWS, 4) + seed


def global_array(key: str) -> np.ndarray:
    return np.concatenate([rank_array(key, rank) for rank in range(RANKS)])


def write_node_files(step_dir: Path, arrays_layout: str, keys: tuple[str, ...]) -> None:
    """The node files of one save of ``keys`` by 4 ranks on 2 nodes, with plain h5py."""
    global_shapes = {key: [ROWS * RANKS, 4] for key in keys}
    for node, ranks in NODE_RANKS:
        attrs = file_attrs(7, 1.5, RANKS, 2, node, ranks, arrays_layout, global_shapes, {"lr": 0.1})
        with h5py.File(step_dir / layout.node_filename(node), "w") as f:
            f.attrs.update(attrs)
            crcs = {}
            for rank in ranks:
                for key in keys:
                    name = layout.rank_dataset(key, rank)
                    value = rank_array(key, rank)
                    dataset = f.create_dataset(name, data=value)
                    if arrays_layout == layout.GLOBAL:
                        dataset.attrs["start"] = [rank * ROWS, 0]
                        dataset.attrs["global_shape"] = global_shapes[key]
                    crcs[name] = _native.crc32c(value.view(np.uint8))
            f.attrs[layout.CRC_ATTR] = json.dumps(crcs)


def assert_view_holds_the_save(view: Path, arrays_layout: str, keys: tuple[str, ...]) -> None:
    with h5py.File(view, "r") as f:
        for key in keys:
            if arrays_layout == layout.GLOBAL:
                np.testing.assert_array_equal(f[key][()], global_array(key), err_msg=key)
            else:
                for rank in range(RANKS):
                    np.testing.assert_array_equal(
                        f[layout.rank_dataset(key, rank)][()],
                        rank_array(key, rank),
                        err_msg=f"{key} of rank {rank}",
                    )


@pytest.mark.parametrize("arrays_layout", [layout.PER_RANK, layout.GLOBAL])
@pytest.mark.parametrize("key", PERCENT_KEYS)
def test_a_key_with_percent_signs_reads_back_from_the_global_view(tmp_path, arrays_layout, key):
    keys = (layout.check_key(key), "weights")
    write_node_files(tmp_path, arrays_layout, keys)
    descriptions = [describe_node_file(tmp_path / layout.node_filename(n), n) for n in (0, 1)]
    image, _ = global_view(merge_descriptions(descriptions, tmp_path))
    (tmp_path / drain.GLOBAL_VIEW).write_bytes(image)
    assert_view_holds_the_save(tmp_path / drain.GLOBAL_VIEW, arrays_layout, keys)


@pytest.mark.parametrize("arrays_layout", [layout.PER_RANK, layout.GLOBAL])
def test_a_save_of_keys_with_percent_signs_commits_with_a_readable_global_view(
    tmp_path, arrays_layout
):
    # The node records as a save straight to the PFS leaves them: the commit
    # builds global.h5 from the contents they carry.
    write_node_files(tmp_path, arrays_layout, KEYS)
    for node, _ in NODE_RANKS:
        node_file = tmp_path / layout.node_filename(node)
        size, crc = files.checksum_file(node_file)
        files.write_json_atomic(
            tmp_path / layout.node_record_name(node),
            {
                "size": size,
                "crc32c": crc,
                "node": node,
                "time": 1.5,
                "contents": describe_node_file(node_file, node),
            },
        )
    assert drain.try_commit(tmp_path, 2)
    assert drain.committed_save(tmp_path, 1.5)
    assert_view_holds_the_save(tmp_path / drain.GLOBAL_VIEW, arrays_layout, KEYS)
