#!/usr/bin/env bash
# Runs jobs of bbio on a real two-node Slurm made on this one machine: each node is
# a slurmd in network, UTS and mount namespaces of its own (its own address, hostname and
# node-local /tmp), and the "PFS" is the file system they share (the state directory).
#
#   scripts/slurm-cluster-check.sh            # set up, run three jobs, tear down (about 1 min)
#   scripts/slurm-cluster-check.sh --keep     # leave the cluster running (state in $BBIO_CLUSTER_DIR)
#
# Needs root and a built bbio (make setup). apt-installs slurm-wlm and munge if slurmctld is
# missing. Everything lives under $BBIO_CLUSTER_DIR (default /var/tmp/bbio-cluster, not in /tmp,
# which each node replaces by its own): munge's key
# and socket, slurm.conf, the daemons' state and logs, each node's /tmp (nodes/NAME/tmp) and
# the job's output. The nodes n1 and n2 (10.79.0.11 and .12) hang off a bridge, bbio-br0
# (10.79.0.1), on which slurmctld listens; slurmctld and slurmd use TCP 6817 and 6818, so
# no other Slurm may run here.
#
# What it checks (docs/admin-slurm.md, "In job scripts"), with the site's prolog and epilog
# installed (bb_root = /tmp/bbio/{job}):
#   1. `sbatch jobscripts/demo.sbatch` (2 nodes x 2 ranks, srun as the launcher) passes: the
#      job is killed while a checkpoint drains, the demo's epilog drain runs on both nodes,
#      the restart finds the same state; nothing is left in either node's /tmp.
#   2. A checkpoint saved while the PFS refuses writes (chattr +i), its drains killed: Slurm's
#      epilog on each node drains that node's file, the last one commits; `bbio ckpt verify`.
#   3. A new job of 2 ranks (not 4) restores it from the PFS: the same rows.
set -euo pipefail

S=$(realpath -m -- "${BBIO_CLUSTER_DIR:-/var/tmp/bbio-cluster}")
REPO=$(realpath -- "$(dirname -- "${BASH_SOURCE[0]}")/..")
NODES=(n1 n2)
NET=10.79.0
KEEP=0
PATH=$PATH:/usr/sbin:/sbin
[ "${1:-}" = --keep ] && KEEP=1

say() { printf 'slurm-cluster-check: %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
case "$S/" in /tmp/*) die "$S is in /tmp, which each node replaces by its own: choose another BBIO_CLUSTER_DIR" ;; esac

# shellcheck source=scripts/slurm-common.sh
source "$REPO/scripts/slurm-common.sh"
check_prerequisites "namespaces, and Slurm's daemons"
MARK=$S/.bbio-slurm-cluster-check   # proves that $S was made by this script
teardown() {  # only what this script made: its PID files, namespaces, bridge and files
    [ -e "$MARK" ] || return 0
    local node pids
    for node in "${NODES[@]}"; do
        stop_pid "$S/run/slurmd-$node.pid"
        # what ran on the node and outlived its slurmd (job steps, ranks, drains): every
        # process in the node's network namespace
        pids=$(ip netns pids "bbio-$node" 2>/dev/null || true)
        [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
        ip netns del "bbio-$node" 2>/dev/null || true
        ip link del "bbio-$node" 2>/dev/null || true  # its peer may outlive the name
    done
    stop_pid "$S/run/slurmctld.pid"
    stop_pid "$S/munge/munged.pid"
    ip link del bbio-br0 2>/dev/null || true
    chattr -i "$S/pfs/root" 2>/dev/null || true
    rm -rf "$S"
}
claim_state_dir BBIO_CLUSTER_DIR
teardown
mkdir -p "$S"/{etc,state,spool,log,run,out,home,pfs}
touch "$MARK"
mkdir -p "$S/pfs/root"

# the network: a bridge in this namespace, one network namespace per node
ip link add bbio-br0 type bridge
ip addr add "$NET.1/24" dev bbio-br0
ip link set bbio-br0 up
HOSTS="127.0.0.1 localhost
$NET.1 $(hostname -s)"
for i in "${!NODES[@]}"; do
    node=${NODES[$i]}
    addr=$NET.$((11 + i))
    ip netns add "bbio-$node"
    ip link add "bbio-$node" type veth peer name eth0 netns "bbio-$node"
    ip link set "bbio-$node" master bbio-br0 up
    ip -n "bbio-$node" addr add "$addr/24" dev eth0
    ip -n "bbio-$node" link set eth0 up
    ip -n "bbio-$node" link set lo up
    ip -n "bbio-$node" route add default via "$NET.1"
    HOSTS+=$'\n'"$addr $node"
    mkdir -p "$S/nodes/$node/tmp/bbio"   # the node's /tmp; bb_root is /tmp/bbio/{job}
    chmod 1777 "$S/nodes/$node/tmp"
    chmod 755 "$S/nodes/$node/tmp/bbio"
done
printf '%s\n' "$HOSTS" > "$S/etc/hosts"

MSOCK=$(start_munge "$S")   # a socket file: reached from every namespace
install_hooks "$S" "$REPO" "/tmp/bbio/{job}" 60 '.$(hostname)'

CPUS=$(nproc)
NODE_LINES=""
for i in "${!NODES[@]}"; do
    NODE_LINES+="NodeName=${NODES[$i]} NodeAddr=$NET.$((11 + i)) CPUs=$CPUS State=UNKNOWN"$'\n'
done
{
    echo "ClusterName=bbiocluster"
    echo "SlurmctldHost=$(hostname -s)($NET.1)"
    echo "SlurmdSpoolDir=$S/spool/%n"
    echo "SlurmdPidFile=$S/run/slurmd-%n.pid"
    echo "SlurmdLogFile=$S/log/slurmd-%n.log"
    echo "MpiDefault=pmix"
    slurm_conf_common "$S" "$MSOCK"
    printf '%s' "$NODE_LINES"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} > "$S/etc/slurm.conf"
chmod 644 "$S/etc/slurm.conf"
export SLURM_CONF=$S/etc/slurm.conf
slurmctld -f "$SLURM_CONF"
for node in "${NODES[@]}"; do
    # its own network, hostname, /etc/hosts and /tmp; slurmd, its job steps and its epilog
    # see them (nsenter, not "ip netns exec", which would hide the cgroup file systems)
    mkdir -p "$S/spool/$node"
    unshare --uts --mount --propagation private nsenter --net="/run/netns/bbio-$node" sh -ec '
        hostname "$1"
        mount --bind "$2/etc/hosts" /etc/hosts
        mount --bind "$2/nodes/$1/tmp" /tmp
        exec slurmd -f "$3"' sh "$node" "$S" "$SLURM_CONF"
done
idle_nodes() { sinfo -h -t idle -o %D 2>/dev/null || true; }
for _ in $(seq 60); do [ "$(idle_nodes)" = "${#NODES[@]}" ] && break; sleep 0.5; done
[ "$(idle_nodes)" = "${#NODES[@]}" ] || die "Slurm did not come up: $(sinfo 2>&1) (see $S/log)"
say "Slurm is up: nodes ${NODES[*]}"

submit() {  # submit the batch script "$1" with sbatch options "${@:2}"; print the job id
    sbatch --parsable -D "$S/home" -o "$S/out/job-%j.out" "${@:2}" "$1"
}
nodes_idle() {  # both nodes idle again: their epilogs succeeded
    for _ in $(seq 120); do [ "$(idle_nodes)" = "${#NODES[@]}" ] && return 0; sleep 0.5; done
    die "after job $1 the nodes are: $(sinfo -h -N -o '%N %T %E' | tr '\n' ';') (epilogs: $(cat "$S"/out/epilog."$1".* 2>&1))"
}
left_on_nodes() {  # what is left of job $1 in the nodes' /tmp
    local node
    for node in "${NODES[@]}"; do
        ls -d "$S/nodes/$node/tmp/bbio/$1" "$S/nodes/$node/tmp/bbio-$1" 2>/dev/null || true
    done
}

# 1. the demo on two nodes: srun launches, the driver kills the job, the
#    demo's epilog drains on every node, the restart checks the state
JOB=$(submit "$REPO/jobscripts/demo.sbatch" --export="ALL,BBIO_HOME=$REPO,BBIO_DEMO_DIR=$S/home/work")
wait_job "$JOB" 300
OUT=$S/out/job-$JOB.out
grep -q "^RESULT: all checks passed" "$OUT" || die "the demo (job $JOB, $(job_state "$JOB")) failed: $(tail -30 "$OUT")"
grep -q "^stage-in  replicated to 2 nodes" "$OUT" || die "the demo did not run on 2 nodes: $(cat "$OUT")"
grep -q "^epilog    bbio ckpt drain --finish on 2 nodes" "$OUT" || die "no epilog on 2 nodes: $(cat "$OUT")"
nodes_idle "$JOB"
[ -z "$(left_on_nodes "$JOB")" ] || die "job $JOB left $(left_on_nodes "$JOB")"
say "job $JOB: demo.sbatch on 2 nodes x 2 ranks: all checks passed; nothing left in the nodes' /tmp: OK"

# 2. a checkpoint the job could not drain (the PFS refused it), its drains killed: Slurm's
#    epilog drains it on each node and the last commits it; a new job of 2 ranks, not 4,
#    restores it from the PFS
cat > "$S/home/ckpt_job.py" <<'EOF'
import os, signal, socket, sys
from pathlib import Path
import numpy as np
import bbio
from bbio.checkpoint import drain

STEP, ROWS = 7, 16
GLOBAL = np.arange(ROWS * 8, dtype=np.float64).reshape(ROWS, 8)

if sys.argv[1] == "kill-drains":  # one task per node: SIGKILL this node's drains
    bb = Path("/tmp/bbio") / os.environ["SLURM_JOB_ID"]
    for journal in drain.journals(bb):
        status = drain.read_status(journal)
        if status.get("pid") and status.get("host") == socket.gethostname():
            try:
                os.kill(status["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"{socket.gethostname()}: drain failing {status.get('failing')}: {status.get('error')}")
    sys.exit(0)

from mpi4py import MPI
comm = MPI.COMM_WORLD
rows = ROWS // comm.size
mine = (slice(comm.rank * rows, (comm.rank + 1) * rows), slice(None))
ckpt = bbio.Checkpointer(comm, "run")
if sys.argv[1] == "save":
    shard = bbio.Shard(GLOBAL[mine], start=(comm.rank * rows, 0), global_shape=GLOBAL.shape)
    handle = ckpt.save(STEP, {"w": shard}, attrs={"ranks": comm.size})
    assert not handle.done(), "committed although the PFS is read-only"
    print(f"rank {comm.rank} on {socket.gethostname()}: saved step {STEP} in the BB", flush=True)
    os._exit(0)  # the job ends without waiting for the drain, as a crash would
step, arrays, attrs = ckpt.restore(want={"w": ((comm.rank * rows, 0), (rows, 8))})
assert step == STEP and attrs["ranks"] == 4, (step, attrs)
assert np.array_equal(arrays["w"], GLOBAL[mine]), "restored rows differ"
print(f"rank {comm.rank} of {comm.size} on {socket.gethostname()}: restored step {step}: same rows", flush=True)
ckpt.close()
EOF
PFS=$S/pfs/root
cat > "$S/home/save.sh" <<EOF
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2
set -eu
source $REPO/.venv/bin/activate
export BBIO_CONFIG=$S/etc/bbio.toml
chattr +i $PFS                      # the PFS refuses the drains' copies during the job
srun python ckpt_job.py save
sleep 1                              # the drains have tried, and wait to try again
srun --ntasks=2 --ntasks-per-node=1 python ckpt_job.py kill-drains
chattr -i $PFS
EOF
JOB=$(submit "$S/home/save.sh")
wait_job "$JOB" 300
OUT=$S/out/job-$JOB.out
[ "$(grep -c "saved step 7 in the BB" "$OUT")" = 4 ] || die "job $JOB: $(cat "$OUT")"
[ "$(grep -c "drain failing \[7\]: .*not permitted" "$OUT")" = 2 ] ||
    die "job $JOB: the drains did not report the read-only PFS: $(cat "$OUT")"
nodes_idle "$JOB"
[ -z "$(left_on_nodes "$JOB")" ] || die "the epilogs of job $JOB left $(left_on_nodes "$JOB")"
[ -s "$PFS/ckpt/run/step-00000007/manifest.json" ] ||
    die "step 7 is not committed after the epilogs of job $JOB: $(cat "$S"/out/epilog."$JOB".*)"
"$REPO/.venv/bin/bbio" ckpt verify --pfs-root "$PFS" run >&2 ||
    die "bbio ckpt verify failed on the drained checkpoint"
say "job $JOB: left in both BBs, drained and committed by Slurm's epilog on each node: OK"

cat > "$S/home/restore.sh" <<EOF
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1
set -eu
source $REPO/.venv/bin/activate
export BBIO_CONFIG=$S/etc/bbio.toml
srun python ckpt_job.py restore
EOF
JOB=$(submit "$S/home/restore.sh")
wait_job "$JOB" 300
OUT=$S/out/job-$JOB.out
[ "$(grep -c "restored step 7: same rows" "$OUT")" = 2 ] || die "job $JOB: $(cat "$OUT")"
nodes_idle "$JOB"
say "job $JOB: restored by 2 ranks on 2 nodes from the PFS, the same rows: OK"
say "all checks passed"
