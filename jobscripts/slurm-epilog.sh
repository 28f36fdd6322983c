#!/bin/bash
# Slurm Epilog (runs as root on each node after a job): as the job's user, finish draining
# the job's checkpoints from the burst buffer to the PFS, then remove the burst-buffer
# directory.  If something cannot be drained, the data is kept and this exits non-zero,
# which drains the node so an admin can recover it.  slurm.conf:  Epilog=/path/to/slurm-epilog.sh
BBIO_HOME=${BBIO_HOME:-/opt/bbio}
exec /usr/sbin/runuser -u "$SLURM_JOB_USER" -- /usr/bin/env \
    SLURM_JOB_ID="$SLURM_JOB_ID" ${BBIO_BB_ROOT:+BBIO_BB_ROOT="$BBIO_BB_ROOT"} \
    ${BBIO_CONFIG:+BBIO_CONFIG="$BBIO_CONFIG"} \
    "$BBIO_HOME/.venv/bin/bbio" slurm epilog --timeout "${BBIO_EPILOG_TIMEOUT:-3600}"
