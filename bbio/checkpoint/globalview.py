"""The global view of a committed checkpoint: one HDF5 file of virtual datasets.

``global.h5`` maps every state key onto the node files of the same directory
(HDF5 virtual datasets, sources named relative to it), so plain h5py or
``h5dump`` reads the whole state without bbio: a global array under its key,
or, for per-rank state, ``/<key>/r00007`` for rank 7.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bbio.checkpoint import layout
from bbio.errors import IntegrityError
from bbio.transfer import files


def describe_node_files(step_dir: Path, nodes: int) -> dict[str, Any]:
    """What the node files of a checkpoint hold: attributes and every rank's datasets."""
    import h5py

    meta: dict[str, Any] = {"datasets": [], "rank_nodes": {}}
    for node in range(nodes):
        path = step_dir / layout.node_filename(node)
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
            if node == 0:
                meta.update(
                    step=int(attrs["step"]),
                    time=float(attrs["time"]),
                    ranks=int(attrs["ranks"]),
                    layout=str(attrs["layout"]),
                    global_shapes=json.loads(attrs["global_shapes"]),
                    user_attrs=json.loads(attrs["user_attrs"]),
                    bbio=str(attrs["bbio"]),
                )
            elif int(attrs["step"]) != meta["step"]:
                raise IntegrityError(
                    f"node file is of step {int(attrs['step'])}, expected {meta['step']}", path=path
                )

            def visit(name: str, obj, node=node) -> None:
                if isinstance(obj, h5py.Dataset):
                    key, _, rank = name.rpartition("/r")
                    meta["datasets"].append(
                        {
                            "node": node,
                            "key": key,
                            "rank": int(rank),
                            "shape": list(obj.shape),
                            "dtype": obj.dtype.str,
                            "start": [int(s) for s in obj.attrs.get("start", [])],
                            "crc32c": int(obj.attrs["crc32c"]),
                        }
                    )
                    meta["rank_nodes"][int(rank)] = node

            f.visititems(visit)
    meta["rank_nodes"] = [meta["rank_nodes"].get(r) for r in range(meta["ranks"])]
    return meta


def write_global_view(path: Path, meta: dict[str, Any]) -> None:
    """Write ``global.h5`` (temporary name, fsync, rename) from :func:`describe_node_files`."""
    import h5py

    temp = files.temp_path(path)
    with h5py.File(temp, "w") as f:
        for name in ("step", "time", "ranks", "layout", "bbio"):
            f.attrs[name] = meta[name]
        f.attrs["user_attrs"] = json.dumps(meta["user_attrs"])
        if meta["layout"] == layout.GLOBAL:
            by_key: dict[str, list[dict]] = {}
            for d in meta["datasets"]:
                by_key.setdefault(d["key"], []).append(d)
            for key, parts in by_key.items():
                shape = tuple(meta["global_shapes"][key])
                vlayout = h5py.VirtualLayout(shape=shape, dtype=parts[0]["dtype"])
                for d in parts:
                    source = h5py.VirtualSource(
                        layout.node_filename(d["node"]),
                        layout.rank_dataset(key, d["rank"]),
                        shape=tuple(d["shape"]),
                    )
                    box = (tuple(d["start"]), tuple(d["shape"]))
                    vlayout[layout.local_slices(box, ((0,) * len(shape), shape))] = source
                f.create_virtual_dataset(key, vlayout)
        else:
            for d in meta["datasets"]:
                name = layout.rank_dataset(d["key"], d["rank"])
                shape = tuple(d["shape"])
                if not all(shape):  # scalars and empty arrays: copied, not mapped
                    with h5py.File(path.parent / layout.node_filename(d["node"]), "r") as node:
                        f.create_dataset(name, data=node[name][()])
                    continue
                vlayout = h5py.VirtualLayout(shape=shape, dtype=d["dtype"])
                vlayout[...] = h5py.VirtualSource(
                    layout.node_filename(d["node"]), name, shape=shape
                )
                f.create_virtual_dataset(name, vlayout)
    files.commit([files.Commit(path, 0o644, time.time_ns())])
