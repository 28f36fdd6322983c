#!/bin/bash
# Slurm Epilog (runs as root on each node after a job): finish draining the job's checkpoints
# from the burst buffer to the PFS (as the job's user), then remove the job's burst-buffer
# directory.  If something cannot be drained, the data is kept and this exits non-zero,
# which drains the node so an admin can recover it.  slurm.conf:  Epilog=/path/to/slurm-epilog.sh
# Set BBIO_HOME (the bbio checkout) below; bb_root (with {job}) in /etc/bbio/bbio.toml.
BBIO_HOME=${BBIO_HOME:-/opt/bbio}
exec "$BBIO_HOME/.venv/bin/bbio" slurm epilog --timeout "${BBIO_EPILOG_TIMEOUT:-3600}"
