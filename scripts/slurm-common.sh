# Shared by scripts/slurm-hooks-check.sh and scripts/slurm-cluster-check.sh (sourced, not run):
# a munge and the site's bbio hooks under a state directory, and the slurm.conf lines both use.

check_prerequisites() {  # check_prerequisites WHY_ROOT: root, bbio's venv, a state directory
    [ "$(id -u)" = 0 ] || die "run as root ($1)"
    [ -x "$REPO/.venv/bin/bbio" ] || die "no $REPO/.venv/bin/bbio: run make setup first"
    [ "$S" != / ] || die "refusing / as the state directory"
}

claim_state_dir() {  # claim_state_dir SETTING: refuse a $S not made by this script ($MARK
    # proves it; SETTING names the variable that chooses another), arm the teardown, and
    # install slurm-wlm and munge if they are missing
    if [ -e "$S" ] && [ ! -e "$MARK" ] && [ -n "$(ls -A "$S" 2>/dev/null)" ]; then
        die "$S exists and was not made by this script: choose another $1"
    fi
    [ "$KEEP" = 1 ] || trap teardown EXIT
    if ! command -v slurmctld >/dev/null; then
        say "installing slurm-wlm and munge"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            slurm-wlm munge >/dev/null
    fi
}

job_state() {  # job_state JOB: its JobState; GONE once Slurm forgot it; empty if Slurm did not say
    local out
    if out=$(scontrol -o show job "$1" 2>&1); then
        sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$out"
    elif grep -q "Invalid job id" <<<"$out"; then
        echo GONE
    fi
}

wait_job() {  # wait_job JOB SECONDS: until JOB has ended and its epilogs ran; a query that
    # fails (slurmctld busy) is asked again, never taken for the job's end
    local state=""
    for _ in $(seq $(($2 * 4))); do
        state=$(job_state "$1")
        case $state in
            "" | PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | REQUEUED | RESIZING | SIGNALING | STAGE_OUT) ;;
            *) return 0 ;;
        esac
        sleep 0.25
    done
    die "job $1 did not end in $2 s (its state: ${state:-Slurm did not answer})"
}

stop_pid() {  # stop a daemon by its PID file, never by name
    local file=$1 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

start_munge() {  # start munged with its key and socket under $1/munge; print the socket's path
    local state=$1
    install -d -o munge -g munge -m 0755 "$state/munge"
    mungekey --create --keyfile="$state/munge/munge.key" --force >&2
    chown munge:munge "$state/munge/munge.key"
    chmod 0400 "$state/munge/munge.key"
    runuser -u munge -- /usr/sbin/munged --key-file="$state/munge/munge.key" \
        --socket="$state/munge/munge.socket.2" --pid-file="$state/munge/munged.pid" \
        --log-file="$state/munge/munged.log" --seed-file="$state/munge/munged.seed" >&2
    printf '%s\n' "$state/munge/munge.socket.2"
}

install_hooks() {  # install_hooks STATE REPO BB_ROOT EPILOG_TIMEOUT OUTPUT_SUFFIX
    # the site's bbio configuration (STATE/etc/bbio.toml, the PFS in STATE/pfs/{user}), and
    # the prolog and epilog as an admin installs them (BBIO_HOME set in a wrapper), each
    # writing to STATE/out/HOOK.JOBID followed by OUTPUT_SUFFIX (shell, expanded by the hook)
    local state=$1 repo=$2 bb_root=$3 timeout=$4 suffix=$5 hook
    cat > "$state/etc/bbio.toml" <<EOF
bb_root = "$bb_root"
pfs_root = "$state/pfs/{user}"
EOF
    for hook in prolog epilog; do
        cat > "$state/etc/$hook.sh" <<EOF
#!/bin/bash
export BBIO_HOME=$repo BBIO_CONFIG=$state/etc/bbio.toml BBIO_EPILOG_TIMEOUT=$timeout
$repo/jobscripts/slurm-$hook.sh > $state/out/$hook.\$SLURM_JOB_ID$suffix 2>&1
EOF
    done
    chmod 755 "$state"/etc/*.sh
}

slurm_conf_common() {  # slurm.conf lines of both checks: slurm_conf_common STATE MUNGE_SOCKET
    cat <<EOF
MailProg=/bin/true
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$2
StateSaveLocation=$1/state
SlurmctldPidFile=$1/run/slurmctld.pid
SlurmctldLogFile=$1/log/slurmctld.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
Prolog=$1/etc/prolog.sh
Epilog=$1/etc/epilog.sh
PrologFlags=Alloc
ReturnToService=2
InactiveLimit=0
KillWait=5
EOF
}
