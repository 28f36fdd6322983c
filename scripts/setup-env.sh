#!/usr/bin/env bash
# Set up everything bbio needs, skipping what is already there:
#   1. MPI and parallel HDF5: the ones on PATH / in HDF5_DIR (cluster modules),
#      else Debian's Open MPI packages when running as root with apt-get;
#   2. .venv with the Python dependencies;
#   3. h5py built against the parallel HDF5 (the wheel is cached in
#      $BBIO_WHEEL_CACHE, default ~/.cache/bbio/wheels, and never rebuilt);
#   4. bbio itself, editable, with its C extension compiled.
# Environment: PYTHON (default python3), VENV (default .venv), HDF5_DIR,
# BBIO_WHEEL_CACHE, BBIO_EXTRAS (default "test").
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${BBIO_EXTRAS:-test}
CACHE=${BBIO_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bbio/wheels}
APT_PACKAGES="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

is_parallel_hdf5() {  # $1: an HDF5 prefix
    grep -Eqs '#define H5_HAVE_PARALLEL 1' "$1/include/H5pubconf.h"
}

find_hdf5_dir() {
    if [ -n "${HDF5_DIR:-}" ]; then echo "$HDF5_DIR"; return; fi
    local multiarch debian
    multiarch=$(gcc -print-multiarch 2>/dev/null || true)
    debian=/usr/lib/$multiarch/hdf5/openmpi
    if [ -n "$multiarch" ] && is_parallel_hdf5 "$debian"; then echo "$debian"; return; fi
    if command -v h5pcc >/dev/null 2>&1; then
        dirname "$(dirname "$(command -v h5pcc)")"
    fi
}

# ---- 1. MPI and parallel HDF5 -------------------------------------------------
hdf5_dir=$(find_hdf5_dir)
if ! command -v mpicc >/dev/null 2>&1 || [ -z "$hdf5_dir" ] || ! is_parallel_hdf5 "$hdf5_dir"; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing Open MPI and parallel HDF5 from Debian packages"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q $APT_PACKAGES >/dev/null
        hdf5_dir=$(find_hdf5_dir)
    else
        die "need mpicc and a parallel HDF5 (found mpicc: $(command -v mpicc || echo none), HDF5: ${hdf5_dir:-none}).
  On a cluster: load the modules first (e.g. 'module load openmpi hdf5/parallel') and
  set HDF5_DIR to the parallel HDF5 prefix if h5pcc is not on PATH.
  On Debian as root, this script installs: $APT_PACKAGES"
    fi
fi
# h5dump (tests read checkpoints with it); optional where it cannot be installed
if ! command -v h5dump >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing h5dump (hdf5-tools)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q hdf5-tools || { apt-get update -q && apt-get install -y -q hdf5-tools; }; } >/dev/null \
        || say "hdf5-tools unavailable; the h5dump test will be skipped"
fi
# bindfs (a FUSE file system: a test leaves one dead in a job's directory); optional too
if ! command -v bindfs >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing bindfs (a FUSE file system for the epilog's tests)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q bindfs || { apt-get update -q && apt-get install -y -q bindfs; }; } >/dev/null \
        || say "bindfs unavailable; the epilog's test of a dead FUSE mount will be skipped"
fi
is_parallel_hdf5 "$hdf5_dir" || die "HDF5 at '$hdf5_dir' is not built with MPI (H5_HAVE_PARALLEL missing in include/H5pubconf.h); set HDF5_DIR to a parallel HDF5"
say "MPI: $(command -v mpicc); parallel HDF5: $hdf5_dir"

# ---- 2. the virtual environment ----------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$PYTHON is $("$PYTHON" --version 2>&1); bbio needs Python 3.10 or newer (set PYTHON=...)"
    if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            apt-get install -y -q python3-venv >/dev/null
            rm -rf "$VENV"; "$PYTHON" -m venv "$VENV"
        else
            die "'$PYTHON -m venv' failed; install the venv module (Debian: python3-venv)"
        fi
    fi
fi
VPY=$VENV/bin/python
pip() { "$VPY" -m pip --disable-pip-version-check -q "$@"; }
say "Python dependencies into $VENV"
pip install 'setuptools>=77' wheel 'cffi>=1.16' Cython pkgconfig numpy mpi4py

# ---- 3. h5py against the parallel HDF5 ------------------------------------------
h5py_has_mpi() { "$VPY" -c 'import h5py, sys; sys.exit(not h5py.get_config().mpi)' 2>/dev/null; }
if ! h5py_has_mpi; then
    key=$(printf '%s' "$hdf5_dir" | sha1sum | cut -c1-12)
    wheels=$CACHE/$key
    tag=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheel=$(ls "$wheels"/h5py-*-"$tag"-*.whl 2>/dev/null | tail -n 1 || true)
    if [ -z "$wheel" ]; then
        say "building h5py against $hdf5_dir (about 4 minutes, once per machine; cached in $wheels)"
        mkdir -p "$wheels"
        CC=mpicc HDF5_MPI=ON HDF5_DIR=$hdf5_dir \
            pip wheel --no-deps --no-binary=h5py --no-build-isolation -w "$wheels" h5py
        wheel=$(ls "$wheels"/h5py-*-"$tag"-*.whl | tail -n 1)
    fi
    say "installing $wheel"
    pip install --no-deps --force-reinstall "$wheel"
    h5py_has_mpi || die "h5py in $VENV has no MPI support (h5py.get_config().mpi is False); remove $wheels and rerun"
fi

# ---- 4. bbio, with its C extension -----------------------------------------------
say "installing bbio (editable) with extras [$EXTRAS] and building csrc/"
pip install --no-build-isolation -e ".[$EXTRAS]"
"$VPY" -c 'from bbio import _native; import sys; sys.exit(not _native.available())' \
    || die "bbio's native extension did not load; see the build output above"
say "ready: . $VENV/bin/activate"
