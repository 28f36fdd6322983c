"""The error hierarchy: one root, built-in bases, messages that say where and what to do."""

from __future__ import annotations

import errno
import pickle

import pytest

import bbio
from bbio.errors import CLASSES_BY_NAME, error_class_for_errno, from_oserror
from tests.conftest import run_python


def test_every_error_class_is_public_and_rooted_at_bbioerror():
    for name, cls in CLASSES_BY_NAME.items():
        assert issubclass(cls, bbio.BBIOError)
        assert getattr(bbio, name) is cls


@pytest.mark.parametrize(
    ("code", "cls", "builtin"),
    [
        (errno.ENOENT, bbio.NotFoundError, FileNotFoundError),
        (errno.EEXIST, bbio.AlreadyExistsError, FileExistsError),
        (errno.EACCES, bbio.PermissionDeniedError, PermissionError),
        (errno.EISDIR, bbio.IsDirectoryError, IsADirectoryError),
        (errno.ENOTDIR, bbio.NotDirectoryError, NotADirectoryError),
        (errno.ENOSPC, bbio.NoSpaceError, OSError),
        (errno.EIO, bbio.IOFailure, OSError),
    ],
)
def test_errno_table(code, cls, builtin):
    assert error_class_for_errno(code) is cls
    exc = from_oserror(OSError(code, "text"), "open for reading", "/some/path")
    assert isinstance(exc, cls)
    assert isinstance(exc, builtin)
    assert exc.errno == code
    assert exc.filename == "/some/path"
    assert str(exc) == "cannot open for reading: text [/some/path]"


def test_message_names_rank_node_path_and_hint():
    exc = bbio.NoSpaceError(
        "needs 10 GiB, 2 GiB free", path="/bb/0", rank=3, node=1, hint="free space on the BB"
    )
    assert str(exc) == "rank 3, node 1: needs 10 GiB, 2 GiB free [/bb/0]. Free space on the BB"
    assert exc.errno == errno.ENOSPC  # a refusal before writing, like a write that failed
    assert pickle.loads(pickle.dumps(exc)).errno == errno.ENOSPC


def test_errors_survive_pickling_between_ranks():
    exc = bbio.NotFoundError("missing", path="/p", rank=1, hint="h", errno=errno.ENOENT)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is bbio.NotFoundError
    assert str(back) == str(exc)
    assert back.errno == errno.ENOENT


@pytest.mark.parametrize(
    ("exit_with", "code", "printed"),
    [("None", 0, ""), ("0", 0, ""), ("3", 3, ""), ("'cannot go on'", 1, "cannot go on")],
)
def test_abort_on_error_keeps_what_sys_exit_means(exit_with, code, printed):
    program = (
        "import sys\n"
        "from mpi4py import MPI\n"
        "from bbio.mpi import abort_on_error\n"
        f"sys.exit(abort_on_error(MPI.COMM_SELF, lambda: sys.exit({exit_with})))\n"
    )
    done = run_python("-c", program)
    assert done.returncode == code, done.stderr
    assert printed in done.stderr
