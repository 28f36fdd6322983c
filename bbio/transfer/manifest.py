"""Manifests: what a directory holds, with sizes and CRC32C (pure data, no I/O).

A manifest is the commit record of a transfer.  It lives at
``<root>/.bbio/<name>.json`` and lists entries by path relative to the root.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from bbio._version import __version__
from bbio.errors import IntegrityError

FORMAT = "bbio-manifest/1"
META_DIR = ".bbio"

FILE, SYMLINK, DIR = "file", "symlink", "dir"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One path of a tree.  ``crc32c`` is known once the bytes were read or copied."""

    path: str
    kind: str
    size: int = 0
    mtime_ns: int = 0
    mode: int = 0o644
    crc32c: int | None = None
    target: str | None = None
    node: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The compact JSON form (fields at their default are left out)."""
        data = {"path": self.path, "kind": self.kind}
        for name, default in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value != default:
                data[name] = value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        """Parse the JSON form; fields this version does not know (a newer one's) are ignored."""
        return cls(**{name: value for name, value in data.items() if name in _FIELD_NAMES})

    def committed(self, crc32c: int | None, node: int | None) -> Entry:
        """This entry with its CRC32C and (shard mode) holding node filled in."""
        return Entry(
            path=self.path,
            kind=self.kind,
            size=self.size,
            mtime_ns=self.mtime_ns,
            mode=self.mode,
            crc32c=crc32c,
            target=self.target,
            node=node,
        )

    def same_version(self, other: Entry) -> bool:
        """True if both describe the same version of a path: kind, size and mtime, or for
        symlinks their target (two links to one target are one version, whenever made)."""
        if self.kind == SYMLINK or other.kind == SYMLINK:
            return (self.kind, self.target) == (other.kind, other.target)
        return (self.kind, self.size, self.mtime_ns, self.target) == (
            other.kind,
            other.size,
            other.mtime_ns,
            other.target,
        )


_OPTIONAL_FIELDS = tuple((f.name, f.default) for f in dataclasses.fields(Entry)[2:])
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Entry))


@dataclasses.dataclass
class Manifest:
    """A committed set of entries plus free-form attributes (source, mode, node...)."""

    kind: str
    entries: list[Entry]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def by_path(self) -> dict[str, Entry]:
        """Entries keyed by path."""
        return {e.path: e for e in self.entries}

    @property
    def total_bytes(self) -> int:
        """Bytes of all file entries."""
        return sum(e.size for e in self.entries if e.kind == FILE)

    def to_json(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "format": FORMAT,
            "kind": self.kind,
            "bbio": __version__,
            "created": time.time(),
            "attrs": self.attrs,
            "entries": [e.to_json() for e in self.entries],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> Manifest:
        """Parse a manifest document; ``source`` names it in errors.  Fields this version
        does not know (a newer one's) are ignored."""
        found = data.get("format") if isinstance(data, dict) else None
        if found != FORMAT:
            raise IntegrityError(
                f"not a bbio manifest (format {found!r}, expected {FORMAT!r})",
                path=source,
                hint="delete it, or rerun the command that wrote it",
            )
        try:
            kind = data["kind"]
            entries = [Entry.from_json(e) for e in data["entries"]]
            attrs = dict(data.get("attrs", {}))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise IntegrityError(
                f"damaged manifest: {what}",
                path=source,
                hint="delete it, or rerun the command that wrote it",
            ) from None
        return cls(kind, entries, attrs)


def sorted_entries(entries: Iterable[Entry]) -> list[Entry]:
    """Entries in path order, the order every plan uses."""
    return sorted(entries, key=lambda e: e.path)
