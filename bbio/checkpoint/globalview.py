"""The global view of a committed checkpoint: one HDF5 file of virtual datasets.

``global.h5`` maps every state key onto the node files of the same directory
(HDF5 virtual datasets, sources named relative to it), so plain h5py or
``h5dump`` reads the whole state without bbio: a global array under its key,
or, for per-rank state, ``/<key>/r00007`` for rank 7.

Building it needs only what each node file holds, not its bytes: each node's
drain describes its file from the burst-buffer copy (:func:`describe_node_file`)
and puts that description in the node's record on the PFS.  The committer
merges the records (:func:`merge_descriptions`), builds the file in memory
(:func:`global_view`) and writes it with one write: no HDF5 reads or small
writes on the PFS.  The virtual datasets of a layout are built once per
process, and each commit adds its save's attributes to a copy.

HDF5 reads ``%`` in the source file and dataset names of a virtual dataset as a
printf-style specifier (``%b``, a block number; ``%%``, a ``%``): every source
name is given to it escaped (:func:`vds_source_name`), so any state key maps.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from bbio import _native
from bbio.checkpoint import layout
from bbio.errors import IntegrityError


def describe_node_file(path: Path, node: int) -> dict[str, Any]:
    """Not collective: the root attributes and every rank's datasets of one node file.

    Empty datasets (a zero in their shape) carry their bytes (hex, none): the
    view holds a copy of them, not a mapping.
    """
    import h5py

    datasets: list[dict[str, Any]] = []
    with h5py.File(path, "r") as f:
        attrs = dict(f.attrs)
        crcs = recorded_crcs(f, path)

        def visit(name: str, obj) -> None:
            if isinstance(obj, h5py.Dataset):
                key, _, rank = name.rpartition("/r")
                entry = {
                    "node": node,
                    "key": key,
                    "rank": int(rank),
                    "shape": list(obj.shape),
                    "dtype": obj.dtype.str,
                    "start": [int(s) for s in obj.attrs.get("start", [])],
                    "crc32c": recorded_crc(crcs, name, path),
                }
                if not all(obj.shape):
                    entry["value"] = np.asarray(obj[()]).tobytes().hex()
                datasets.append(entry)

        f.visititems(visit)
    return {"node": node, **decode_root_attrs(attrs), "datasets": datasets}


def decode_root_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """Not collective: a node file's root attributes (``dict(f.attrs)``), decoded.
    Raises KeyError, TypeError or ValueError for attributes that are not a node file's."""
    return {
        "step": int(attrs["step"]),
        "time": float(attrs["time"]),
        "ranks": int(attrs["ranks"]),
        "nodes": int(attrs["nodes"]),
        "node_ranks": [int(r) for r in attrs["node_ranks"]],
        "layout": str(attrs["layout"]),
        "global_shapes": json.loads(attrs["global_shapes"]),
        "user_attrs": json.loads(attrs["user_attrs"]),
        "bbio": str(attrs["bbio"]),
    }


def recorded_crcs(f, path: Path) -> dict[str, int]:
    """Not collective: the CRC32C of every dataset of the open node file ``f`` (at
    ``path``), by dataset path, from its root attribute ``crc32c``.  Files of
    earlier bbio builds kept a ``crc32c`` attribute on each dataset instead:
    those are read."""
    import h5py

    if layout.CRC_ATTR not in f.attrs:
        crcs: dict[str, int] = {}

        def visit(name: str, obj) -> None:
            if isinstance(obj, h5py.Dataset) and layout.CRC_ATTR in obj.attrs:
                crcs[name] = int(obj.attrs[layout.CRC_ATTR])

        f.visititems(visit)
        return crcs
    try:
        return {name: int(crc) for name, crc in json.loads(f.attrs[layout.CRC_ATTR]).items()}
    except (TypeError, ValueError, AttributeError):
        raise IntegrityError(
            f"node file has an invalid {layout.CRC_ATTR!r} attribute (JSON: each dataset's CRC32C)",
            path=path,
            hint="it is damaged or not a bbio checkpoint file",
        ) from None


def recorded_crc(crcs: dict[str, int], dataset: str, path: Path) -> int:
    """Not collective: the CRC32C ``crcs`` (:func:`recorded_crcs`) holds for ``dataset``."""
    if dataset not in crcs:
        raise IntegrityError(f"dataset {dataset} has no recorded CRC32C", path=path)
    return crcs[dataset]


def merge_descriptions(descriptions: list[dict[str, Any]], where: Path) -> dict[str, Any]:
    """The whole checkpoint from its node files' descriptions (node order).

    Raises :class:`IntegrityError` (naming ``where``) if the nodes' files are
    not of one save (their step, time, rank or node count or layout differ), or
    do not hold every rank of it.
    """
    first = descriptions[0]
    for description in descriptions[1:]:
        for key in ("step", "time", "ranks", "nodes", "layout"):
            if description.get(key) != first.get(key):
                raise IntegrityError(
                    f"the node files are not of one save: node {description['node']}'s has "
                    f"{key} {description[key]}, node {first['node']}'s {first[key]}",
                    path=where,
                    hint="save the step again; its drain then copies every node's file anew",
                )
    rank_nodes: dict[int, int] = {}
    datasets = []
    for description in descriptions:
        for rank in description.get("node_ranks", ()):  # a rank may have saved nothing
            rank_nodes[rank] = description["node"]
        for entry in description["datasets"]:
            rank_nodes[entry["rank"]] = entry["node"]
            datasets.append(entry)
    shared = ("step", "time", "ranks", "layout", "global_shapes", "user_attrs", "bbio")
    meta = {k: first[k] for k in shared}
    meta["datasets"] = datasets
    meta["rank_nodes"] = [rank_nodes.get(r) for r in range(first["ranks"])]
    missing = [r for r, node in enumerate(meta["rank_nodes"]) if node is None]
    if missing:
        raise IntegrityError(
            f"the checkpoint was saved by {first['ranks']} ranks, but the files of nodes "
            f"{[d['node'] for d in descriptions]} are not those of ranks {missing[:10]}",
            path=where,
            hint="a node's file is missing: its drain has not copied it yet",
        )
    return meta


SAVE_ATTRS = ("step", "time", "user_attrs")  # what differs between saves of one layout
_layout_images: dict[str, bytes] = {}  # the last layout's image, by the digest of its layout


def global_view_image(meta: dict[str, Any]) -> bytes:
    """The bytes of ``global.h5`` for the merged description ``meta``, built in memory.

    The virtual datasets depend only on the layout, which the saves of a run
    share: the image without the save's attributes is built once per layout
    (in a drain, the process that commits) and each commit adds them to a copy.
    """
    import h5py

    structure = {k: v for k, v in meta.items() if k not in SAVE_ATTRS}
    structure["datasets"] = [
        {k: v for k, v in d.items() if k != "crc32c"} for d in meta["datasets"]
    ]
    digest = hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()
    if digest not in _layout_images:
        _layout_images.clear()
        _layout_images[digest] = _layout_image(structure)
    image = io.BytesIO(_layout_images[digest])
    with h5py.File(image, "r+") as f:
        f.attrs["step"] = meta["step"]
        f.attrs["time"] = meta["time"]
        f.attrs["user_attrs"] = json.dumps(meta["user_attrs"])
    return image.getvalue()


def _layout_image(structure: dict[str, Any]) -> bytes:
    """The image of ``global.h5`` for a layout (:func:`global_view_image`'s ``structure``),
    without the save's attributes."""
    import h5py

    name = f"global-view-{id(structure)}.h5"
    with h5py.File(name, "w", driver="core", backing_store=False) as f:
        for attr in ("ranks", "layout", "bbio"):
            f.attrs[attr] = structure[attr]
        if structure["layout"] == layout.GLOBAL:
            _map_global_arrays(f, structure)
        else:
            _map_rank_arrays(f, structure)
        f.flush()
        return f.id.get_file_image()


def vds_source_name(name: str) -> str:
    """``name`` as a virtual dataset's source file or dataset name: each ``%`` doubled, so
    that HDF5 reads it as itself, not as a printf-style specifier (see H5Pset_virtual)."""
    return name.replace("%", "%%")


def _map_global_arrays(f, meta: dict[str, Any]) -> None:
    import h5py

    by_key: dict[str, list[dict]] = {}
    for d in meta["datasets"]:
        by_key.setdefault(d["key"], []).append(d)
    for key, parts in by_key.items():
        shape = tuple(meta["global_shapes"][key])
        vlayout = h5py.VirtualLayout(shape=shape, dtype=parts[0]["dtype"])
        for d in parts:
            source = h5py.VirtualSource(
                vds_source_name(layout.node_filename(d["node"])),
                vds_source_name(layout.rank_dataset(key, d["rank"])),
                shape=tuple(d["shape"]),
            )
            box = (tuple(d["start"]), tuple(d["shape"]))
            vlayout[layout.local_slices(box, ((0,) * len(shape), shape))] = source
        f.create_virtual_dataset(key, vlayout)


def _map_rank_arrays(f, meta: dict[str, Any]) -> None:
    import h5py

    for d in meta["datasets"]:
        name = layout.rank_dataset(d["key"], d["rank"])
        shape = tuple(d["shape"])
        if not all(shape):  # empty arrays: copied, not mapped
            value = np.frombuffer(bytes.fromhex(d["value"]), dtype=d["dtype"]).reshape(shape)
            f.create_dataset(name, data=value)
            continue
        vlayout = h5py.VirtualLayout(shape=shape, dtype=d["dtype"])
        vlayout[...] = h5py.VirtualSource(
            vds_source_name(layout.node_filename(d["node"])), vds_source_name(name), shape=shape
        )
        f.create_virtual_dataset(name, vlayout)


def global_view(meta: dict[str, Any]) -> tuple[bytes, int]:
    """The bytes of ``global.h5`` for the merged description ``meta`` and their CRC32C,
    for the committer to write (:func:`global_view_image`)."""
    image = global_view_image(meta)
    return image, _native.crc32c(np.frombuffer(image, dtype=np.uint8))
