"""What ``bbio info`` reports: the stack bbio runs on, gathered without initialising MPI."""

from __future__ import annotations

import dataclasses

from bbio import _native
from bbio._version import __version__
from bbio.config import Config
from bbio.errors import BBIOError, ConfigError
from bbio.mpi import library_version
from bbio.transfer.files import free_bytes


@dataclasses.dataclass(frozen=True)
class RootInfo:
    """A configured directory and the free space of the file system that holds it."""

    template: str
    path: str | None
    free_bytes: int | None
    problem: str | None = None  # why the path or its free space is unknown


@dataclasses.dataclass(frozen=True)
class StackInfo:
    """Versions and capabilities of everything bbio depends on."""

    bbio_version: str
    mpi_library: str
    mpi4py_version: str
    h5py_version: str | None
    hdf5_version: str | None
    h5py_mpi: bool
    native_loaded: bool
    native_error: str | None
    crc32c_hardware: bool
    bb: RootInfo
    pfs: RootInfo
    ranks_per_node: int | None
    job_id: str


def _root(template: str | None, resolve) -> RootInfo:
    if not template:
        return RootInfo("(not set)", None, None)
    try:
        path = resolve()
    except ConfigError as exc:
        return RootInfo(template, None, None, str(exc))
    try:
        return RootInfo(template, str(path), free_bytes(path))
    except BBIOError as exc:  # a stale or forbidden mount: the other rows still matter
        return RootInfo(template, str(path), None, str(exc))


def collect(config: Config) -> StackInfo:
    """Gather versions and capabilities.  Not collective, and leaves MPI uninitialised."""
    import mpi4py

    try:
        mpi_library = library_version()  # first: it tells mpi4py not to initialise MPI
    except (ImportError, RuntimeError) as exc:  # mpi4py there, its MPI library not loadable
        mpi_library = f"NOT loadable: {exc}"
    try:
        import h5py
    except ImportError:
        h5py_version = hdf5_version = None
        h5py_mpi = False
    else:
        h5py_version = h5py.version.version
        hdf5_version = h5py.version.hdf5_version
        h5py_mpi = bool(h5py.get_config().mpi)
    return StackInfo(
        bbio_version=__version__,
        mpi_library=mpi_library,
        mpi4py_version=mpi4py.__version__,
        h5py_version=h5py_version,
        hdf5_version=hdf5_version,
        h5py_mpi=h5py_mpi,
        native_loaded=_native.available(),
        native_error=_native.LOAD_ERROR,
        crc32c_hardware=_native.available() and _native.hw_crc32c(),
        bb=_root(config.bb_root, lambda: config.bb_dir(0)),
        pfs=_root(config.pfs_root, config.pfs_dir),
        ranks_per_node=config.ranks_per_node,
        job_id=config.job_id,
    )
