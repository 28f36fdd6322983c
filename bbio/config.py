"""All of bbio's settings, in one place.

Precedence, lowest first: built-in defaults, then a TOML file, then ``BBIO_*``
environment variables, then explicit arguments to :func:`load_config`.
The file is the one named by the ``config_file`` argument or ``BBIO_CONFIG``,
else ``/etc/bbio/bbio.toml`` when that exists.  ``docs/configuration.md`` lists
every setting.  Nothing here touches MPI.
"""

from __future__ import annotations

import dataclasses
import getpass
import numbers
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bbio.arguments import integer_argument
from bbio.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SITE_CONFIG_FILE = Path("/etc/bbio/bbio.toml")
ENV_PREFIX = "BBIO_"
COUNT_MAXIMUM = 2**31 - 1  # threads, ranks, files in flight: a C int
BYTES_MAXIMUM = 2**62  # sizes: far above any machine's, below what C's 64-bit sizes hold


def _setting(
    default: Any,
    help: str,
    choices: tuple[str, ...] = (),
    minimum: int = 1,
    maximum: int = BYTES_MAXIMUM,
) -> Any:
    metadata = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved settings.  Build one with :func:`load_config`."""

    bb_root: str = _setting(
        "/tmp/bbio-{user}/bb/{node}",
        "Node-local burst buffer directory. {node}, {job} and {user} are replaced.",
    )
    pfs_root: str | None = _setting(
        None, "Parallel file system directory for bbio's shared files. {job} and {user} apply."
    )
    ranks_per_node: int | None = _setting(
        None,
        "Virtual nodes: group this many consecutive ranks into one node. "
        "Unset: nodes are real hosts (MPI_COMM_TYPE_SHARED).",
        maximum=COUNT_MAXIMUM,
    )
    job_id: str = _setting(
        "local", "Job identifier; defaults to SLURM_JOB_ID when that is set, else 'local'."
    )
    user: str | None = _setting(
        None,
        "User name for {user}; defaults to SLURM_JOB_USER when that is set (the job's user, "
        "also in a prolog or epilog running as root), else the login name.",
    )
    copy_buffer_size: int = _setting(
        2 << 20,
        "Bytes of scratch buffer per copy; each copying thread reads and writes at most 256 KiB "
        "at a time.  Copies of 8 MiB or more run on two threads, one per half (the drain's copy "
        "to the PFS: one thread, in file order).",
    )
    io_threads: int = _setting(
        8,
        "Collective reads: requests the native batched reader keeps in flight per process.",
        maximum=COUNT_MAXIMUM,
    )
    stage_files_in_flight: int = _setting(
        32,
        "Staging and pack: files (or pieces) copied or read at once per node, shared out "
        "among the node's ranks.",
        maximum=COUNT_MAXIMUM,
    )
    progress: str = _setting(
        "auto",
        "Progress line of transfers: auto (only on a terminal), always (stderr) or never.",
        choices=("auto", "always", "never"),
    )
    chunk_size: int = _setting(
        64 << 20, "Staging splits files larger than this into pieces copied by different ranks."
    )
    aggregators_per_node: int = _setting(
        1,
        "Collective reads: ranks per node that read for everyone (the lowest node ranks).",
        maximum=COUNT_MAXIMUM,
    )
    stripe_size: int | None = _setting(
        None,
        "Collective reads: file domains are aligned to this many bytes.  Unset: the Lustre "
        "stripe size where it can be read, else the file system's block size.",
    )
    read_max_hole: int = _setting(
        64 << 10,
        "Collective reads: merge two extents into one read if at most this far apart.",
        minimum=0,
    )
    read_max_bytes: int = _setting(
        16 << 20, "Collective reads: the largest single read (larger samples take several)."
    )
    read_round_bytes: int = _setting(
        4 << 20,
        "Collective reads: an aggregator reads in rounds of about this many bytes (at most 8 "
        "per call), reading the next round while the ranks exchange the last one.",
    )
    read_min_saving: int = _setting(
        10,
        "Collective reads go through the aggregators when merging saves at least this many "
        "percent of the read requests (or another node's burst buffer holds the data); "
        "otherwise each rank reads its own samples directly.  0: always aggregate.",
        minimum=0,
        maximum=100,
    )
    read_direct_bytes: int = _setting(
        1 << 20,
        "Collective reads: when every sample of a dataset is at least this large, each rank "
        "reads its own samples and no requests are exchanged (one such read is already large "
        "for the PFS).  0: never.",
        minimum=0,
    )
    read_odirect_bytes: int = _setting(
        1 << 20,
        "Collective reads: reads of at least this many bytes bypass the page cache "
        "(O_DIRECT, where the file system allows it: FUSE clients such as GlusterFS's then "
        "send the whole read at once).  The page cache then keeps nothing for a later epoch.  "
        "0: never.",
        minimum=0,
    )
    ckpt_backpressure: str = _setting(
        "queue",
        "A save while earlier checkpoints still drain: queue (default, while the burst "
        "buffer has room), block (wait for the drain) or skip (do not save this one).",
        choices=("queue", "block", "skip"),
    )
    ckpt_verify: str = _setting(
        "cache",
        "How the drain verifies a PFS copy before committing it: cache (read it back "
        "through the file system client during the fsync, default) or device (after the "
        "fsync, cached pages dropped, so the bytes come from the servers' storage; one "
        "extra cold read).",
        choices=("cache", "device"),
    )
    ckpt_recycle: str = _setting(
        "on",
        "on (default): the burst buffer keeps the file of a trimmed checkpoint, and the "
        "node's next save of the same arrays rewrites it in place instead of writing a new "
        "file (on tmpfs about twice as fast, and faster again through the mapping of it "
        "each rank keeps); off: trimmed files are deleted.",
        choices=("on", "off"),
    )
    stage_round_bytes: int = _setting(
        4 << 30,
        "Staging: copy and commit the files in rounds of about this many bytes (each file "
        "counts 256 KiB more); a run killed midway keeps every round it finished.",
    )
    replicate_round_bytes: int = _setting(
        64 << 20,
        "Replicate mode: bytes each rank reads from the source per round before the "
        "ranks exchange them (memory per rank: this times the node count).",
    )

    def bb_dir(self, node: int) -> Path:
        """The burst buffer directory of virtual or real node ``node``."""
        return self.expand(self.bb_root, node=node)

    def stage_threads(self, node_ranks: int) -> int:
        """Files each of a node's ``node_ranks`` ranks keeps in flight: its share of
        ``stage_files_in_flight`` (at least one)."""
        return max(1, -(-self.stage_files_in_flight // max(1, node_ranks)))

    def expand(self, template: str | os.PathLike, node: int | None = None) -> Path:
        """``template`` with {job}, {user} and (given a node) {node} replaced.  Raises
        :class:`UsageError` for a node that is not an index (an int of at least 0)."""
        if node is not None:
            integer_argument("node", node, 0)
        return Path(self._expand(os.fspath(template), node=node))

    def node_dir(self, template: str | os.PathLike, node: int, nodes_on_host: int) -> Path:
        """``template`` expanded for ``node``: a directory of that node alone.

        ``nodes_on_host`` nodes share this machine (virtual nodes); with more
        than one, ``template`` must contain {node}, or they would all write
        into one directory.  Raises ConfigError (the same on every rank) then.
        """
        if nodes_on_host > 1 and "{node}" not in os.fspath(template):
            raise ConfigError(
                f"{nodes_on_host} virtual nodes (ranks_per_node={self.ranks_per_node}) would "
                f"share the node directory {os.fspath(template)}",
                hint="put {node} in it, e.g. /tmp/bb/{node}; each node needs its own",
            )
        return self.expand(template, node=node)

    def pfs_dir(self) -> Path:
        """The PFS root, or a ConfigError saying how to set it."""
        if not self.pfs_root:
            raise ConfigError(
                "no PFS root is configured",
                hint="set BBIO_PFS_ROOT or pfs_root in the config file (bbio ckpt commands "
                "also take --pfs-root; in Python, pfs_root=)",
            )
        return self.expand(self.pfs_root)

    def _expand(self, template: str, node: int | None) -> str:
        text = template.replace("{job}", self.job_id).replace("{user}", self.user or _user_name())
        if node is not None:
            text = text.replace("{node}", str(node))
        return os.path.expanduser(text)


def _user_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


SETTINGS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Config)}


def _convert(name: str, raw: Any, source: str) -> Any:
    """Coerce one raw value (TOML value or env string) to the setting's type."""
    kind = SETTINGS[name].type
    if raw is None or (isinstance(raw, str) and raw == "" and "None" in kind):
        return None
    if kind.startswith("int"):
        value = _integer(raw)
        if value is None:
            raise ConfigError(
                f"{source}: {name} must be an integer, got {raw!r}",
                hint=f"fix {name} in {source}",
            ) from None
        minimum, maximum = (SETTINGS[name].metadata[bound] for bound in ("minimum", "maximum"))
        if value < minimum:
            raise ConfigError(f"{source}: {name} must be at least {minimum}, got {value}")
        if value > maximum:
            raise ConfigError(f"{source}: {name} must be at most {maximum}, got {value}")
        return value
    if not isinstance(raw, str):
        raise ConfigError(f"{source}: {name} must be a string, got {raw!r}")
    if "\0" in raw:  # no path or name holds one: os calls raise ValueError on it
        raise ConfigError(f"{source}: {name} must not contain a NUL character, got {raw!r}")
    if raw == "":
        raise ConfigError(
            f"{source}: {name} must not be empty",
            hint=f"give {name} a value in {source}, or remove it there to get the default",
        )
    choices = SETTINGS[name].metadata["choices"]
    if choices and raw not in choices:
        raise ConfigError(f"{source}: {name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _integer(raw: Any) -> int | None:
    """``raw`` as an int if it is an integer (numpy's too) or a string of ASCII digits
    (``-`` first allowed, so that a negative number is refused as one); None for anything
    else (bool, float, ``"1_000"``, ``" 8"``, ``"+8"``)."""
    if isinstance(raw, str):
        return int(raw) if re.fullmatch(r"-?[0-9]+", raw) else None
    if isinstance(raw, (bool, np.bool_)) or not isinstance(raw, numbers.Integral):
        return None
    return int(raw)


def config_file_path(
    config_file: str | os.PathLike | None, env: Mapping[str, str]
) -> str | os.PathLike | None:
    """The TOML file :func:`load_config` reads: ``config_file``, else ``BBIO_CONFIG`` (empty:
    unset, as every setting), else :data:`SITE_CONFIG_FILE` if it exists; None: no file."""
    path = config_file or env.get("BBIO_CONFIG") or None
    if path is None and SITE_CONFIG_FILE.exists():
        return SITE_CONFIG_FILE
    return path


def _file_layer(config_file: str | os.PathLike | None, env: Mapping[str, str]) -> dict:
    path = config_file_path(config_file, env)
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            "the config file does not exist",
            path=path,
            hint="fix the path in BBIO_CONFIG or bbio --config (in Python, config_file=)",
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"the config file is not valid TOML: {exc}", path=path) from None
    except OSError as exc:
        raise ConfigError(
            f"the config file cannot be read: {exc.strerror or exc}",
            path=path,
            hint="BBIO_CONFIG or bbio --config must name a readable TOML file",
        ) from None
    unknown = sorted(set(data) - set(SETTINGS))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)} in config file {path}",
            hint=f"known settings: {', '.join(SETTINGS)}",
        )
    return {k: _convert(k, v, f"config file {path}") for k, v in data.items()}


def _env_layer(env: Mapping[str, str]) -> dict:
    values = {}
    if env.get("SLURM_JOB_ID"):
        values["job_id"] = env["SLURM_JOB_ID"]
    if env.get("SLURM_JOB_USER"):
        values["user"] = env["SLURM_JOB_USER"]
    for name in SETTINGS:
        key = ENV_PREFIX + name.upper()
        optional = "None" in SETTINGS[name].type
        if key in env and not (optional and env[key] == ""):  # empty: not set here
            values[name] = _convert(name, env[key], f"environment variable {key}")
    return values


def load_config(
    config_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Resolve settings: defaults < TOML file < ``BBIO_*`` env < ``overrides``.

    Not collective; reads only the process environment and one file.
    ``overrides`` whose value is None are ignored, so CLI flags can be passed
    through unconditionally.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    values.update(_file_layer(config_file, env))
    values.update(_env_layer(env))
    for name, raw in overrides.items():
        if name not in SETTINGS:
            raise ConfigError(
                f"unknown setting {name!r}", hint=f"known settings: {', '.join(SETTINGS)}"
            )
        if raw is not None:
            values[name] = _convert(
                name, os.fspath(raw) if isinstance(raw, Path) else raw, "argument"
            )
    return Config(**values)
