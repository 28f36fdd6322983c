"""Reading checkpoints back: finding complete copies, verifying them, resharding.

Not collective by themselves: :class:`bbio.Checkpointer` calls these on the
ranks that need them and agrees on the outcome.  A damaged or missing copy
raises :class:`IntegrityError` or an I/O error (the checkpointer then tries the
previous checkpoint); a request the checkpoint cannot serve raises
:class:`RequestError` (the checkpointer raises it on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bbio import _native
from bbio.checkpoint import layout
from bbio.checkpoint.drain import read_manifest, record_problem
from bbio.checkpoint.globalview import decode_root_attrs, recorded_crc, recorded_crcs
from bbio.errors import BBIOError, IntegrityError, NotFoundError, UsageError, from_oserror
from bbio.transfer import files


class RequestError(UsageError):
    """A restore request (``want``, ``from_rank``) that the checkpoint's layout cannot
    serve: the caller's mistake, not a damaged copy."""


def bb_copies(bb_ckpt_dir: Path, node: int | None) -> dict[int, dict[str, Any]]:
    """Steps whose node file is complete in this burst buffer: {step: record}.

    ``node`` None accepts any node's file (a shell on a real node does not know
    its node index).
    """
    found = {}
    for step, n, record in _bb_records(bb_ckpt_dir, node):
        node_file = bb_ckpt_dir / layout.step_dirname(step) / layout.node_filename(n)
        complete = isinstance(record, dict) and record.get("complete")
        if complete and step not in found and node_file.exists():
            found[step] = {**record, "node": n}
    return found


def one_save_on_every_node(
    per_node: list[dict[int, dict[str, Any]]], committed: Mapping[int, Any]
) -> set[int]:
    """The steps every node holds a copy of (``per_node``: each node's
    :func:`bb_copies`) from one save: the same save time on every node, and the
    committed one's (``committed``: {step: time}) when the step is committed.  A copy
    an earlier job left, of a save of the step made again since, does not count.  Pure."""
    if not per_node:
        return set()
    alike = set()
    for step in set.intersection(*(set(copies) for copies in per_node)):
        times = {copies[step].get("time") for copies in per_node}
        if len(times) == 1 and (step not in committed or times == {committed[step]}):
            alike.add(step)
    return alike


USABLE, OTHER_LAYOUT, PARTIAL, SET_ASIDE = "usable", "other layout", "partial", "set aside"


def bb_states(
    per_node: list[dict[int, dict[str, Any]]], committed: Mapping[int, Any]
) -> dict[int, str]:
    """What a restore by this job can make of each step some node holds a burst-buffer
    copy of.  ``per_node``: for each node of this job, in node order, {step: {"time":
    the save's, "same_layout": saved by this job's layout of ranks (or not known),
    "nodes": the saving job's node count (or None), "set_aside": None, or why its
    drain set the save aside, "node file" or "task file" damaged}}; ``committed``:
    {step: time} on the PFS.  A step is :data:`SET_ASIDE` when a node's drain set
    its save aside, so that it is never committed, and this job cannot read its
    copies either (a node file is damaged, or they are of another layout of ranks);
    :data:`USABLE` when every node holds a copy of one save (see
    :func:`one_save_on_every_node`) in this layout; :data:`OTHER_LAYOUT` when it was
    saved by another layout of ranks and each of the saving job's nodes (all among
    this job's) holds a copy of that save: complete, but readable here only once
    drained; else :data:`PARTIAL` (a save killed half way, or on nodes not all in
    this job).  Pure."""
    usable = one_save_on_every_node(per_node, committed)
    states = {}
    for step in set().union(*per_node):
        held = [copies[step] for copies in per_node if step in copies]
        reasons = {copy["set_aside"] for copy in held} - {None}
        if "node file" in reasons:
            states[step] = SET_ASIDE
        elif all(copy["same_layout"] for copy in held):
            states[step] = USABLE if step in usable else PARTIAL
        elif reasons:
            states[step] = SET_ASIDE
        else:
            states[step] = _of_another_layout(step, held, per_node, committed)
    return states


def _of_another_layout(
    step: int,
    held: list[dict[str, Any]],
    per_node: list[dict[int, dict[str, Any]]],
    committed: Mapping[int, Any],
) -> str:
    """:data:`OTHER_LAYOUT` if the copies ``held`` of ``step`` say one node count, those
    nodes are all among this job's (``per_node``, see :func:`bb_states`), and each holds
    a copy of one save; else :data:`PARTIAL`.  Pure."""
    counts = {copy["nodes"] for copy in held}
    count = counts.pop() if len(counts) == 1 else 0
    if not 0 < count <= len(per_node):
        return PARTIAL
    return OTHER_LAYOUT if step in one_save_on_every_node(per_node[:count], committed) else PARTIAL


def damaged_bb_records(bb_ckpt_dir: Path, node: int | None) -> list[BBIOError]:
    """The errors of this burst buffer's node records that are damaged (not a JSON
    object) or cannot be read (an I/O error): :func:`bb_copies` passes over their copies.
    Not collective."""
    return [r for _, _, r in _bb_records(bb_ckpt_dir, node) if isinstance(r, BBIOError)]


def _bb_records(bb_ckpt_dir: Path, node: int | None) -> Iterator[tuple[int, int, Any]]:
    """(step, node, record or why it cannot be read) of each node record in the burst
    buffer."""
    if not bb_ckpt_dir.is_dir():
        return
    for entry in bb_ckpt_dir.iterdir():
        step = layout.parse_step(entry.name)
        if step is None:
            continue
        for n in [node] if node is not None else layout.nodes_in(entry):
            path = entry / layout.node_record_name(n)
            try:
                record = files.read_json(path)
            except BBIOError as exc:  # damaged or unreadable: that copy does not count
                yield step, n, exc
                continue
            problem = None if record is None else record_problem(record)
            if problem is not None:
                record = IntegrityError(
                    f"the burst-buffer record is damaged: {problem}",
                    path=path,
                    hint="bbio writes it whole, so something else changed it; that copy "
                    "does not count: remove its step directory, or save the step again",
                )
            yield step, n, record


def bb_file_crc(record: Mapping[str, Any]) -> int | None:
    """The CRC32C a burst-buffer copy must have: its PFS copy's once drained, else the
    one its save recorded (None for a save by a bbio that did not record one)."""
    crc = record.get("crc32c")
    return crc if crc is not None else record.get("file_crc32c")


def verify_file(path: Path, size: int | None, crc: int | None) -> None:
    """Raise IntegrityError unless ``path`` has ``size`` bytes and CRC32C ``crc`` (when known)."""
    if crc is None:
        return
    got_size, got_crc = files.checksum_file(path, drop_cache=True)
    if got_size != size or got_crc != crc:
        raise IntegrityError(
            f"checkpoint file has {got_size} bytes, CRC32C {got_crc:08x}; expected {size} bytes, "
            f"{crc:08x}",
            path=path,
        )


def file_meta(path: Path) -> dict[str, Any]:
    """The root attributes of a node file, decoded.  Not collective.

    Raises :class:`IntegrityError` naming ``path`` when HDF5 cannot open it or
    its attributes are not a node file's (damaged metadata), and
    :class:`NotFoundError` when it is missing.
    """
    import h5py

    if not path.exists():
        raise NotFoundError("checkpoint file is missing", path=path)
    with _named_after(path), h5py.File(path, "r") as f:
        return decode_root_attrs(dict(f.attrs))


def check_request(
    manifest: Mapping[str, Any],
    step_dir: Path,
    want: Mapping[str, Any] | None,
    from_rank: int | None,
) -> None:
    """Raise RequestError unless the checkpoint of ``manifest`` (in ``step_dir``) holds
    global arrays for ``want`` and was saved by rank ``from_rank`` (when given)."""
    step, ranks = manifest["step"], manifest["ranks"]
    if want is not None and manifest["layout"] != layout.GLOBAL:
        raise RequestError(
            f"want= asks for boxes of global arrays, but step {step} holds per-rank arrays "
            f"(keys {sorted(want)})",
            path=step_dir,
            hint="restore it with from_rank= (whose arrays to read), or with no arguments on "
            f"{ranks} ranks",
        )
    if from_rank is not None and not 0 <= from_rank < ranks:
        raise RequestError(
            f"from_rank {from_rank} is not a saved rank: step {step} was saved by {ranks} ranks",
            path=step_dir,
            hint=f"pass a from_rank from 0 to {ranks - 1}",
        )


@contextlib.contextmanager
def _named_after(path: Path) -> Iterator[None]:
    """Errors reading the checkpoint file at ``path`` as :class:`BBIOError` naming it:
    an I/O error as such, and what HDF5 or a damaged layout raise (no errno) as
    :class:`IntegrityError`."""
    try:
        yield
    except BBIOError:
        raise
    except OSError as exc:
        if exc.errno is not None:
            raise from_oserror(exc, "read", path) from None
        raise _unreadable(path, exc) from None
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: Exception) -> IntegrityError:
    return IntegrityError(
        f"checkpoint file cannot be read as a bbio node file ({type(exc).__name__}: {exc})",
        path=path,
        hint="its HDF5 metadata or root attributes are damaged; restore uses another copy",
    )


def _checked(dataset, recorded: int, path: Path) -> np.ndarray:
    data = dataset[...]  # an array in the stored byte order even when 0-d: [()] gives a scalar
    crc = _native.crc32c(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    if crc != recorded:
        raise IntegrityError(
            f"dataset {dataset.name} has CRC32C {crc:08x}, recorded {recorded:08x}", path=path
        )
    return data


def read_rank(path: Path, rank: int) -> dict[str, np.ndarray]:
    """Every array rank ``rank`` saved, from the node file at ``path``, CRC-checked."""
    import h5py

    arrays: dict[str, np.ndarray] = {}
    suffix = f"/r{rank:05d}"
    with _named_after(path), h5py.File(path, "r") as f:
        crcs = recorded_crcs(f, path)

        def visit(name: str, obj) -> None:
            if isinstance(obj, h5py.Dataset) and name.endswith(suffix):
                arrays[name[: -len(suffix)]] = _checked(obj, recorded_crc(crcs, name, path), path)

        f.visititems(visit)
    return arrays


def saved_boxes(manifest: Mapping[str, Any], step_dir: Path) -> dict[str, list[tuple]]:
    """For each key of a global checkpoint: [(node file, dataset, box, dtype)] of every slice."""
    import h5py

    boxes: dict[str, list[tuple]] = {}
    for n in range(manifest["nodes"]):
        path = step_dir / layout.node_filename(n)
        with _named_after(path), h5py.File(path, "r") as f:

            def visit(name: str, obj, path=path) -> None:
                if isinstance(obj, h5py.Dataset):
                    key = name.rpartition("/r")[0]
                    box = (tuple(int(s) for s in obj.attrs["start"]), tuple(obj.shape))
                    boxes.setdefault(key, []).append((path, name, box, obj.dtype.str))

            f.visititems(visit)
    return boxes


def read_boxes(
    boxes: Mapping[str, list[tuple]],
    want: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    global_shapes: Mapping[str, Sequence[int]],
) -> dict[str, np.ndarray]:
    """Assemble each wanted box (start, shape) of each key from the saved slices.

    Raises RequestError for a key the checkpoint lacks, or a box outside the key's
    global shape (an empty one too) or its slices do not cover.
    """
    import h5py

    out: dict[str, np.ndarray] = {}
    for key, (start, shape) in want.items():
        if key not in boxes:
            raise RequestError(
                f"the checkpoint has no state {key!r}", hint=f"ask want= for one of {sorted(boxes)}"
            )
        wanted = (tuple(int(s) for s in start), tuple(int(s) for s in shape))
        dims = len(boxes[key][0][2][0])
        if len(wanted[0]) != dims or len(wanted[1]) != dims or min(wanted[1], default=0) < 0:
            raise RequestError(
                f"the box {wanted} (start, shape) of {key!r} is not a box of its {dims} "
                "dimension(s)",
                hint=f"pass want= ((start,) * {dims}, (shape,) * {dims}), shape at least 0",
            )
        whole = tuple(int(n) for n in global_shapes.get(key, ()))
        if len(whole) != dims or any(
            s + n > g for s, n, g in zip(wanted[0], wanted[1], whole, strict=True)
        ):
            raise RequestError(
                f"the box {wanted} (start, shape) of {key!r} is not inside its global shape "
                f"{whole}",
                hint="ask want= for a box inside the array's global shape",
            )
        if not layout.covers(wanted, [b for _, _, b, _ in boxes[key]]):
            raise RequestError(
                f"the box {wanted} (start, shape) of {key!r} is not (all) inside the saved slices",
                hint="ask want= for a box inside the array's global shape (and its saved slices)",
            )
        result = np.empty(wanted[1], dtype=boxes[key][0][3])
        read: set[layout.Box] = set()  # a replica's box is read once
        for path, name, box, _ in boxes[key]:
            overlap = layout.intersect(wanted, box)
            if overlap is None or box in read:
                continue
            read.add(box)
            with _named_after(path), h5py.File(path, "r") as f:
                piece = f[name][layout.local_slices(overlap, box)]
            result[layout.local_slices(overlap, wanted)] = piece
        out[key] = result
    return out


def pfs_manifest(pfs_ckpt_dir: Path, step: int) -> dict[str, Any] | None:
    """The committed manifest of ``step`` on the PFS, if any."""
    return read_manifest(pfs_ckpt_dir / layout.step_dirname(step))
