"""Which PFS trees were staged into a node's burst buffer, and where.

Each node's ``<bb_root>/.bbio/staged.json`` maps a source directory (on the
PFS) to the directory it was staged into.  Stage-in records an entry once its
manifest is written; the collective reader looks up a dataset's path there to
read from the burst buffer instead of the PFS.  Not collective.
"""

from __future__ import annotations

import os
from pathlib import Path

from bbio.errors import IntegrityError
from bbio.transfer import files
from bbio.transfer.manifest import META_DIR

FORMAT = "bbio-staged/1"


def registry_path(bb_dir: Path) -> Path:
    """Where the registry of node directory ``bb_dir`` lives."""
    return bb_dir / META_DIR / "staged.json"


def _entries(bb_dir: Path) -> list[dict]:
    """The registry's entries, each a source and a destination (strings); none without a
    registry of this format.  Raises :class:`IntegrityError` for entries of other types."""
    path = registry_path(bb_dir)
    document = files.read_json(path)
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return []
    entries = document.get("entries", [])
    if not isinstance(entries, list) or not all(
        isinstance(e, dict)
        and isinstance(e.get("source"), str)
        and isinstance(e.get("destination"), str)
        for e in entries
    ):
        raise IntegrityError(
            "the registry of staged copies is damaged: its entries are not each a source "
            "and a destination path",
            path=path,
            hint="delete it and stage in again (it only tells readers where staged copies are)",
        )
    return entries


def record(bb_dir: Path, source: Path, destination: Path) -> None:
    """Remember that ``source`` is staged at ``destination`` (replacing older entries)."""
    source, destination = str(source.resolve()), str(destination.resolve())
    kept = [
        e for e in _entries(bb_dir) if e["source"] != source and e["destination"] != destination
    ]
    kept.append({"source": source, "destination": destination})
    files.write_json_atomic(registry_path(bb_dir), {"format": FORMAT, "entries": kept})


def lookup(bb_dir: Path, path: Path) -> tuple[Path, Path] | None:
    """(source, destination) of the staged tree that contains ``path``, if any."""
    target = os.path.realpath(path)
    best = None
    for e in _entries(bb_dir):
        source = e["source"]
        inside = target == source or target.startswith(source.rstrip("/") + "/")
        if inside and (best is None or len(source) > len(best[0])):
            best = (source, e["destination"])
    return None if best is None else (Path(best[0]), Path(best[1]))
