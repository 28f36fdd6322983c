"""Checkpoint naming and array geometry: pure functions of plain data.

On disk, in a tier root (a node's burst buffer, or the PFS root)::

    ckpt/<name>/step-00000042/node-00000.h5    one HDF5 file per node
    ckpt/<name>/step-00000042/node-00000.json  its record: size, CRC32C (after the copy)
    ckpt/<name>/step-00000042/global.h5        PFS only: virtual datasets over the node files
    ckpt/<name>/step-00000042/manifest.json    PFS only: the commit, written last
    ckpt/<name>/spare-node-00000-<key>.h5      BB only: a drained node file kept to be
                                               rewritten by the next save of its layout

Inside a node file, the array of state key ``k`` saved by rank ``r`` is the
dataset ``/k/r00007`` (N-D, its own shape and dtype), with attributes, for
slices of global arrays, ``start`` and ``global_shape``.  The file's root
attributes hold the step, the time, the rank and node counts, the layout
(``per-rank`` or ``global``), the global shapes, the bbio version and
``crc32c``: a JSON object mapping each dataset (``k/r00007``) to the CRC32C of
its bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from bbio.arguments import integer_argument
from bbio.errors import UsageError

CKPT_DIR = "ckpt"
MAX_STEP = 2**64 - 1  # a node file's "step" attribute is a 64-bit HDF5 integer
MAX_EXTENT = 2**63 - 1  # NumPy's largest dimension
MAX_DIMENSIONS = 32  # HDF5's largest rank (H5S_MAX_RANK)
MAX_KEY_PARTS = 64  # a key's '/'-joined parts: the groups it nests in a node file
NAME_MAX = 255  # bytes in a file name: a checkpoint's name is a directory's
CRC_ATTR = "crc32c"  # root attribute of a node file: {dataset: CRC32C of its bytes}, JSON
PER_RANK, GLOBAL = "per-rank", "global"
_STEP = re.compile(r"^step-(\d{8,})$")


@dataclasses.dataclass(frozen=True)
class Shard:
    """A rank's slice of a global array: ``data`` sits at ``start`` in ``global_shape``.

    ``start`` and ``global_shape`` are tuples or lists of integers of at least 0
    (``int`` or NumPy integers, not booleans), one per dimension of ``data``.  Not
    collective: bad arguments raise a :class:`UsageError` on the building rank
    alone; ``Checkpointer.save`` checks its Shards again, on every rank at once.
    """

    data: np.ndarray
    start: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        data, start, shape = shard_parts(self.data, self.start, self.global_shape)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "global_shape", shape)


def shard_parts(
    data: object, start: object, global_shape: object
) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """A :class:`Shard`'s arguments as an array and two int tuples, or the
    :class:`UsageError` saying which one is wrong and how."""
    array = as_array("a Shard's data", data)
    start, shape = _coordinates("start", start), _coordinates("global_shape", global_shape)
    if not (len(start) == len(shape) == array.ndim):
        raise UsageError(
            f"a Shard needs start and global_shape with one entry per dimension of its "
            f"data ({array.ndim}), got {start} and {shape}"
        )
    if any(s + n > g for s, n, g in zip(start, array.shape, shape, strict=True)):
        raise UsageError(
            f"a Shard of shape {array.shape} at {start} does not fit in {shape}",
            hint="give start + data.shape of at most global_shape in every dimension",
        )
    return array, start, shape


def _coordinates(name: str, value: object) -> tuple[int, ...]:
    """A Shard's ``start`` or ``global_shape``: a tuple or list of integers of at least 0."""
    if not isinstance(value, (tuple, list)):
        raise UsageError(
            f"a Shard's {name} must be a tuple or list of integers, not {value!r} "
            f"({type(value).__name__})",
            hint=f"pass {name} as a tuple with one int per dimension of the data",
        )
    coordinates = tuple(integer_argument(f"each entry of a Shard's {name}", n, 0) for n in value)
    if any(n > MAX_EXTENT for n in coordinates):
        raise UsageError(
            f"a Shard's {name} {coordinates} has an entry above 2**63 - 1, the largest "
            "extent an array can have",
            hint=f"pass {name} within the global array's real extent",
        )
    return coordinates


def step_dirname(step: int) -> str:
    """``step-00000042``."""
    if not 0 <= step <= MAX_STEP:
        raise UsageError(f"checkpoint steps are integers from 0 to 2**64 - 1, got {step}")
    return f"step-{step:08d}"


def parse_step(dirname: str) -> int | None:
    """The step of a ``step-NNNNNNNN`` directory name, else None."""
    match = _STEP.match(dirname)
    return int(match.group(1)) if match else None


def node_filename(node: int) -> str:
    """``node-00003.h5``."""
    return f"node-{node:05d}.h5"


def node_record_name(node: int) -> str:
    """``node-00003.json``: the record of a node file (size and CRC32C)."""
    return f"node-{node:05d}.json"


def node_copy_names(node: int) -> tuple[str, str]:
    """A node's copy of a step in one tier: its record, then its file."""
    return node_record_name(node), node_filename(node)


def spare_filename(node: int, key: str) -> str:
    """``spare-node-00003-<key>.h5``: a drained node file of layout ``key``, kept for reuse."""
    return f"spare-node-{node:05d}-{key}.h5"


def spare_pattern(node: int | None = None) -> str:
    """The glob of ``node``'s spare files (of every node's, for None)."""
    return f"spare-node-{'*' if node is None else f'{node:05d}'}-*.h5"


def layout_key(node_specs: Sequence[tuple[int, Mapping[str, object]]], version: str) -> str:
    """A short digest of a node file's structure: its ranks' datasets (name, shape, dtype,
    placement) and the bbio version that wrote it.  A file of one key can be rewritten in
    place as a save of that key: it already holds every dataset, allocated."""
    text = json.dumps([version, [[rank, spec] for rank, spec in node_specs]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def nodes_in(step_dir) -> list[int]:
    """The node indexes whose records are in a step directory."""
    found = []
    for path in step_dir.glob("node-*.json"):
        match = re.match(r"^node-(\d+)\.json$", path.name)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def rank_dataset(key: str, rank: int) -> str:
    """Path of rank ``rank``'s array of ``key`` inside a node file."""
    return f"{key}/r{rank:05d}"


def layout_of(arrays: Mapping[str, object]) -> str:
    """``global`` if every value is a :class:`Shard`, ``per-rank`` if none is."""
    shards = [isinstance(v, Shard) for v in arrays.values()]
    if shards and all(shards):
        return GLOBAL
    if not any(shards):
        return PER_RANK
    raise UsageError(
        "a checkpoint's arrays are either all per-rank arrays or all Shards of global arrays"
    )


_RANK_PART = re.compile(r"r\d{5,}")  # the last part of a rank's dataset (rank_dataset)


def check_key(key: str) -> str:
    """A state key usable as an HDF5 group name, as it is written (HDF5 does not
    rewrite it: no empty, ``.`` or ``..`` part, no NUL, UTF-8) and apart from the ranks'
    datasets."""
    parts = key.split("/") if is_text_name(key) else [""]
    if len(parts) > MAX_KEY_PARTS:
        raise UsageError(
            f"state key {key[:60]!r}... has {len(parts)} parts joined by '/': at most "
            f"{MAX_KEY_PARTS} (HDF5's walk of a file, which the drain and restore do, slows "
            "with the cube of the depth)",
            hint="join some parts with another character, e.g. '.'",
        )
    if any(p in ("", ".", "..") or _RANK_PART.fullmatch(p) for p in parts):
        raise UsageError(
            f"invalid state key {key!r}",
            hint="use strings like 'model/layer1.weight': parts joined by single '/', none "
            "empty, '.' or '..', nor 'r' and five or more digits (bbio's per-rank names)",
        )
    return key


def is_text_name(name: object) -> bool:
    """Whether ``name`` is a ``str`` that files and HDF5 can hold as written: UTF-8 (no
    lone surrogate) and without NUL."""
    if not isinstance(name, str) or "\0" in name:
        return False
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def as_array(what: str, value: object) -> np.ndarray:
    """``value`` (an array, a CPU tensor, a number or a list) as a NumPy array, or the
    :class:`UsageError` saying why ``what`` cannot be stored (a nested dict, a GPU or
    bfloat16 tensor, a ragged list)."""
    if isinstance(value, Mapping):
        raise UsageError(
            f"{what} is a {type(value).__name__}, not an array: bbio saves one flat dict of arrays",
            hint="pass an array; flatten nested state into keys joined by '/' (such as "
            "'optimizer/state/0')",
        )
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(
            f"{what} ({type(value).__name__}) cannot be made a NumPy array: {exc}",
            hint="pass NumPy arrays or CPU tensors (tensor.detach().cpu()); save a bfloat16 tensor "
            "as its bits, tensor.view(torch.int16), and view them back after restore",
        ) from None


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)


def wanted_boxes(want: object) -> dict[str, Box]:
    """``restore``'s ``want`` (state key -> (start, shape)) with integer tuples, or the
    :class:`UsageError` saying what is wrong with it (not a dict, a box that is not two
    sequences of integers of at least 0)."""
    example = "want={'model/w': ((0, 0), (128, 64))}: (start, shape) of each key's box"
    if not isinstance(want, Mapping):
        raise UsageError(
            f"want= maps state keys to (start, shape) boxes, not a {type(want).__name__}",
            hint=f"pass {example}",
        )
    boxes = {}
    for key, box in want.items():
        try:
            start, shape = (list(part) for part in box)
        except (TypeError, ValueError):
            raise UsageError(
                f"want= box of {key!r} is {box!r}, not (start, shape)", hint=f"pass {example}"
            ) from None
        boxes[key] = (
            tuple(integer_argument(f"want= start of {key!r}", n, 0) for n in start),
            tuple(integer_argument(f"want= shape of {key!r}", n, 0) for n in shape),
        )
    return boxes


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes (start, shape), or None if they do not overlap."""
    start = tuple(max(s1, s2) for s1, s2 in zip(a[0], b[0], strict=True))
    end = tuple(
        min(s1 + n1, s2 + n2) for s1, n1, s2, n2 in zip(a[0], a[1], b[0], b[1], strict=True)
    )
    if any(e <= s for s, e in zip(start, end, strict=True)):
        return None
    return start, tuple(e - s for s, e in zip(start, end, strict=True))


def first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """The indexes of two boxes that overlap and differ, or None when the boxes are
    disjoint but for identical ones (replicas) and empty ones.

    Identical boxes are compared once; the others are swept in order of their
    start along the axis where their starts differ most (the axis a global array
    is split on), each against the boxes that start before it ends there, at
    once (NumPy): 4096 shards in a 64 x 64 grid take milliseconds.
    """
    first: dict[Box, int] = {}
    for i, box in enumerate(boxes):
        if all(n > 0 for n in box[1]):
            first.setdefault(box, i)
    distinct = list(first.values())
    ndim = len(boxes[distinct[0]][0]) if distinct else 0
    if ndim == 0:
        return None  # no box, or scalars: every one is the same box
    starts = np.array([boxes[i][0] for i in distinct], dtype=np.int64)
    ends = starts + np.array([boxes[i][1] for i in distinct], dtype=np.int64)
    axis = max(range(ndim), key=lambda a: len(np.unique(starts[:, a])))
    order = np.argsort(starts[:, axis], kind="stable")
    starts, ends = starts[order], ends[order]
    # box p can only meet the boxes after it that start before it ends along the axis
    stops = np.searchsorted(starts[:, axis], ends[:, axis], side="left")
    for p in np.flatnonzero(stops > np.arange(1, len(order) + 1)):  # a box in its window
        window = slice(p + 1, stops[p])
        meets = np.all(
            np.maximum(starts[p], starts[window]) < np.minimum(ends[p], ends[window]), axis=1
        )
        if meets.any():
            i, j = distinct[order[p]], distinct[order[p + 1 + int(np.argmax(meets))]]
            return (i, j) if i < j else (j, i)
    return None


def covers(wanted: Box, pieces: Sequence[Box]) -> bool:
    """True if ``pieces`` together cover all of ``wanted`` (disjoint but for identical
    ones, as :func:`first_overlap` checks at save time)."""
    return uncovered(wanted, pieces) == 0


def uncovered(wanted: Box, pieces: Sequence[Box]) -> int:
    """How many elements of ``wanted`` no piece covers (the pieces disjoint but for
    identical ones, as :func:`first_overlap` checks at save time)."""
    covered = 0
    for piece in set(pieces):
        overlap = intersect(wanted, piece)
        if overlap is not None:
            covered += math.prod(overlap[1])
    return math.prod(wanted[1]) - covered


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """The slices that select ``box`` inside an array that holds ``within``."""
    return tuple(slice(s - w, s - w + n) for s, n, w in zip(box[0], box[1], within[0], strict=True))
