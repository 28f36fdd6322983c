"""bbio: MPI I/O middleware for training and simulation jobs on Slurm clusters.

Importing bbio never initialises MPI (Slurm prolog and epilog hooks import it
without mpirun).  Calls that need MPI take a communicator explicitly.
"""

from bbio._version import __version__
from bbio.checkpoint.checkpointer import Checkpointer, CheckpointInfo, SaveHandle
from bbio.checkpoint.layout import Shard
from bbio.config import Config, load_config
from bbio.errors import (
    AlreadyExistsError,
    BBIOError,
    BBIOTimeoutError,
    CollectiveError,
    ConfigError,
    DependencyError,
    IntegrityError,
    IOFailure,
    IsDirectoryError,
    NoSpaceError,
    NotDirectoryError,
    NotFoundError,
    OutOfMemoryError,
    PermissionDeniedError,
    UsageError,
)
from bbio.read.datasets import Dataset, ReadStats, open_dataset
from bbio.read.loader import Loader
from bbio.stage.pack import PackSummary, pack
from bbio.stage.run import StageSummary, stage_in, stage_out
from bbio.stage.verify import VerifyReport, verify

__all__ = [
    "AlreadyExistsError",
    "BBIOError",
    "BBIOTimeoutError",
    "CheckpointInfo",
    "Checkpointer",
    "CollectiveError",
    "Config",
    "ConfigError",
    "Dataset",
    "DependencyError",
    "IOFailure",
    "IntegrityError",
    "IsDirectoryError",
    "Loader",
    "NoSpaceError",
    "NotDirectoryError",
    "NotFoundError",
    "OutOfMemoryError",
    "PackSummary",
    "PermissionDeniedError",
    "ReadStats",
    "SaveHandle",
    "Shard",
    "StageSummary",
    "UsageError",
    "VerifyReport",
    "__version__",
    "load_config",
    "open_dataset",
    "pack",
    "stage_in",
    "stage_out",
    "verify",
]
