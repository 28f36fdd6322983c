#!/bin/bash
# Slurm Prolog (runs as root on each node before a job): create the job's burst-buffer
# directory, owned by the job's user.  slurm.conf:  Prolog=/path/to/bbio/jobscripts/slurm-prolog.sh
# Set BBIO_HOME (the bbio checkout) below; bb_root (with {job}, e.g. /local/nvme/bbio/{job}) in
# /etc/bbio/bbio.toml, which the epilog reads too.  Slurm runs prologs without PATH: every path
# here is absolute.
BBIO_HOME=${BBIO_HOME:-/opt/bbio}
exec "$BBIO_HOME/.venv/bin/bbio" slurm prolog
