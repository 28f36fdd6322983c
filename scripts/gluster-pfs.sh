#!/usr/bin/env bash
# A single-node GlusterFS volume on this machine, mounted with FUSE: a real
# distributed file system that stands in for the PFS in bbio's benchmarks.
#
#   scripts/gluster-pfs.sh start  [--dir STATE_DIR]   # prints the mount point last
#   scripts/gluster-pfs.sh status [--dir STATE_DIR]   # exit 0 if mounted and usable
#   scripts/gluster-pfs.sh stop   [--dir STATE_DIR]   # unmount, stop, remove state
#
#   PFS=$(scripts/gluster-pfs.sh start | tail -1)
#
# STATE_DIR (default $BBIO_GLUSTER_DIR, else /tmp/bbio-gluster) holds everything:
# glusterd's config and working directory, PID files, logs, the two bricks
# (bricks/b1, bricks/b2: a 2-brick distribute volume "bbiopfs") and the mount
# point (mnt). No systemd: glusterd runs with its own vol file and PID file, and
# every daemon is stopped by its PID file. The few files gluster hard-codes
# elsewhere (brick sockets in /run/gluster, brick logs and cmd_history.log in
# /var/log/glusterfs, two stubs in /var/lib/glusterd) are removed by stop,
# except those that existed before the first start. Needs root and FUSE
# (/dev/fuse); glusterfs-server and glusterfs-client are apt-installed if
# glusterd is missing.
# glusterd listens on TCP port 24007, so a system glusterd must not be running.
set -euo pipefail

VOL=bbiopfs
PORT=24007
PATH=$PATH:/usr/sbin:/sbin
SELF=$(realpath -- "${BASH_SOURCE[0]}")

say() { printf 'gluster-pfs: %s\n' "$*" >&2; }
die() { printf 'gluster-pfs: ERROR: %s\n' "$*" >&2; exit 1; }
usage() {
    cat <<EOF
usage: scripts/gluster-pfs.sh start|stop|status [--dir STATE_DIR]
  start   start glusterd and the 2-brick volume "$VOL", mount it at STATE_DIR/mnt
          (idempotent) and print the mount point as the last line of stdout
  status  say whether STATE_DIR/mnt is mounted, with df -h; exit 0 if so, else 1
  stop    unmount, stop the volume and its daemons, remove STATE_DIR (idempotent)
STATE_DIR defaults to \$BBIO_GLUSTER_DIR, else /tmp/bbio-gluster.
EOF
}

CMD=
G=${BBIO_GLUSTER_DIR:-/tmp/bbio-gluster}
while [ $# -gt 0 ]; do
    case $1 in
        start|stop|status)
            [ -z "$CMD" ] || { usage >&2; exit 2; }
            CMD=$1 ;;
        --dir)
            [ $# -ge 2 ] || die "--dir needs a directory"
            G=$2; shift ;;
        --dir=*) G=${1#--dir=} ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
    shift
done
[ -n "$CMD" ] || { usage >&2; exit 2; }
[ -n "$G" ] || die "the state directory is empty"
case $G in
    *[[:space:]\\]*) die "the state directory must not contain blanks or backslashes: '$G'" ;;
esac
G=$(realpath -m -- "$G")
[ "$G" != / ] || die "refusing / as the state directory"
MNT=$G/mnt
MARK=$G/.bbio-gluster-pfs      # proves STATE_DIR was made by this script
SOCK=$G/run/glusterd.socket
# what glusterd creates outside STATE_DIR whatever its options (besides brick
# sockets and brick logs); stop removes those that did not exist before start
OUTSIDE_FILES="/var/log/glusterfs/cmd_history.log /var/lib/glusterd/geo-replication/gsyncd_template.conf"
OUTSIDE_DIRS="/run/gluster/snaps /run/gluster /var/lib/glusterd/ss_brick /var/lib/glusterd/geo-replication
  /var/log/glusterfs/bricks /var/log/glusterfs/geo-replication-secondaries/mbr
  /var/log/glusterfs/geo-replication-secondaries /var/log/glusterfs/geo-replication
  /var/log/glusterfs/gfproxy/$VOL /var/log/glusterfs/gfproxy /var/log/glusterfs/snaps/$VOL
  /var/log/glusterfs/snaps"

gl() {  # the gluster CLI, talking to our glusterd only
    timeout 120 gluster --mode=script --glusterd-sock="$SOCK" \
        --log-file="$G/log/cli.log" "$@"
}

is_root() { [ "$(id -u)" -eq 0 ]; }

# A PID is ours if it is a gluster process whose command line names STATE_DIR
# (glusterd: its vol file; bricks: their paths; FUSE client: the mount point).
is_ours() {
    local p=$1 comm
    [[ $p =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$p/comm" 2>/dev/null) || return 1
    case $comm in glusterd|glusterfs|glusterfsd) ;; *) return 1 ;; esac
    tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$G/"
}
pid_in() { local p; p=$(cat "$1" 2>/dev/null) || return 1; p=${p//[[:space:]]/}; is_ours "$p" && echo "$p"; }
alive() { pid_in "$1" >/dev/null; }

reaped() {  # wait up to 5 s until the zombie of an exited daemon is reaped by init
    local i
    for i in $(seq 50); do
        [ "$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" = Z ] || return 0
        sleep 0.1
    done
}
stop_pid() {  # SIGTERM, wait up to 10 s, then SIGKILL
    local p=$1 i
    is_ours "$p" || return 0
    kill "$p" 2>/dev/null || return 0
    for i in $(seq 100); do is_ours "$p" || { reaped "$p"; return 0; }; sleep 0.1; done
    say "PID $p did not stop after 10 s: killing it"
    kill -9 "$p" 2>/dev/null || true
    for i in $(seq 50); do is_ours "$p" || { reaped "$p"; return 0; }; sleep 0.1; done
}
stop_pidfile() { local p; if p=$(pid_in "$1"); then stop_pid "$p"; fi; rm -f "$1"; }

mounted() { awk -v m="$MNT" '$2 == m { f = 1 } END { exit !f }' /proc/mounts; }
mount_type() { awk -v m="$MNT" '$2 == m { t = $3 } END { print t }' /proc/mounts; }

bricks_online() {  # both bricks of the volume report Online = Y
    local n
    n=$(gl volume status "$VOL" 2>/dev/null | awk '$1 == "Brick" && $(NF-1) == "Y"' | wc -l) || return 1
    [ "$n" -eq 2 ]
}

client_ok() {  # mounted, and its FUSE client alive and answering
    mounted && [ "$(mount_type)" = fuse.glusterfs ] && alive "$G/run/fuse.pid" &&
        timeout 10 stat -f "$MNT" >/dev/null 2>&1 && timeout 10 ls "$MNT" >/dev/null 2>&1
}
healthy() { client_ok && alive "$G/run/glusterd.pid" && bricks_online; }

unmount_client() {
    if mounted; then umount "$MNT" 2>/dev/null || umount -l "$MNT"; fi
    stop_pidfile "$G/run/fuse.pid"
}

find_fuse_pid() {  # the glusterfs FUSE client whose last argument is our mount point
    local d args
    for d in /proc/[0-9]*; do
        [ "$(cat "$d/comm" 2>/dev/null)" = glusterfs ] || continue
        args=$(tr '\0' '\n' <"$d/cmdline" 2>/dev/null) || continue
        [ "$(tail -n 1 <<<"$args")" = "$MNT" ] && echo "${d#/proc/}"
    done
    return 0
}

lock() {  # serialise concurrent start/stop (e.g. several benchmark launchers)
    # fd 9 holds the lock: the daemons we start must not inherit it (9<&-)
    exec 9<"$SELF"
    flock -w 300 9 || die "another gluster-pfs.sh start/stop is still running"
}

ensure_installed() {
    local c missing=
    for c in glusterd gluster mount.glusterfs; do
        command -v "$c" >/dev/null || missing="$missing $c"
    done
    [ -n "$missing" ] || return 0
    is_root || die "GlusterFS is not installed (missing:$missing). Install the Debian/Ubuntu packages" \
        "glusterfs-server and glusterfs-client (sudo apt-get install glusterfs-server glusterfs-client)," \
        "or run this script as root to install them."
    command -v apt-get >/dev/null || die "GlusterFS is not installed (missing:$missing) and there is" \
        "no apt-get: install glusterfs-server and glusterfs-client with your package manager"
    say "installing glusterfs-server and glusterfs-client with apt-get (about 15 s)"
    export DEBIAN_FRONTEND=noninteractive
    local apt=(apt-get install -y -q --no-install-recommends glusterfs-server glusterfs-client)
    if ! "${apt[@]}" >"/tmp/gluster-pfs-apt.$$.log" 2>&1; then
        say "apt-get install failed; running apt-get update and trying again"
        { apt-get update -q && "${apt[@]}"; } >"/tmp/gluster-pfs-apt.$$.log" 2>&1 ||
            { tail -n 20 "/tmp/gluster-pfs-apt.$$.log" >&2
              die "could not install glusterfs-server glusterfs-client (log above)"; }
    fi
    rm -f "/tmp/gluster-pfs-apt.$$.log"
    if [ -d /run/systemd/system ] && systemctl is-active -q glusterd 2>/dev/null; then
        say "the package started the system glusterd.service (port $PORT): stopping and disabling it"
        systemctl disable --now glusterd >&2 || true
    fi
    for c in glusterd gluster mount.glusterfs; do
        command -v "$c" >/dev/null || die "$c is still missing after installing GlusterFS"
    done
}

brick_host() {  # gluster refuses localhost / 127.0.0.1 as a brick host
    local hn
    hn=$(hostname -s)
    case $hn in ''|localhost|localhost.*) die "the short host name is '$hn'; gluster needs a real" \
        "host name for its bricks (set one with hostname/hostnamectl)" ;; esac
    getent hosts "$hn" >/dev/null || die "host name '$hn' does not resolve; add it to /etc/hosts" \
        "(e.g. '127.0.1.1 $hn')"
    echo "$hn"
}

start_glusterd() {
    local f i
    # leftovers of a crashed run: a mount and bricks without their glusterd
    if mounted; then say "unmounting $MNT (its glusterd is gone)"; fi
    unmount_client
    for f in $(find "$G/run" -name '*.pid' 2>/dev/null); do stop_pidfile "$f"; done
    cat >"$G/glusterd.vol" <<VOLFILE
volume management
    type mgmt/glusterd
    option working-directory $G/lib
    option run-directory $G/run
    option glusterd-sockfile $SOCK
    option transport-type socket
    option transport.socket.listen-port $PORT
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
VOLFILE
    say "starting glusterd (state in $G)"
    glusterd -f "$G/glusterd.vol" -p "$G/run/glusterd.pid" -l "$G/log/glusterd.log" 9<&- ||
        die "glusterd failed to start; see $G/log/glusterd.log"
    for i in $(seq 100); do
        gl peer status >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    tail -n 20 "$G/log/glusterd.log" >&2 || true
    die "glusterd does not answer on $SOCK after 20 s; see $G/log/glusterd.log"
}

cmd_start() {
    ensure_installed
    is_root || die "start needs root (it runs glusterd and mounts with FUSE)"
    [ -c /dev/fuse ] || die "FUSE is not available (/dev/fuse is missing): load the fuse module," \
        "or give the container --device /dev/fuse --cap-add SYS_ADMIN"
    lock
    if healthy; then
        say "volume $VOL is already mounted at $MNT"
        echo "$MNT"
        return 0
    fi
    if mounted && ! client_ok; then
        say "$MNT is mounted but does not answer: unmounting it"
        unmount_client
    fi
    if ! alive "$G/run/glusterd.pid" && ss -Hltn "sport = :$PORT" 2>/dev/null | grep -q .; then
        die "TCP port $PORT is already in use (a system glusterd? 'systemctl stop glusterd'; or" \
            "this script with another state dir: 'scripts/gluster-pfs.sh stop --dir OTHER_DIR')"
    fi
    if [ -d "$G" ] && [ ! -e "$MARK" ] && [ -n "$(ls -A "$G")" ]; then
        die "$G exists, is not empty and was not made by this script: choose another --dir"
    fi
    mkdir -p "$G"/{lib,run,log,bricks/b1,bricks/b2,mnt}
    touch "$MARK"
    if [ ! -e "$G/outside-preexisting" ]; then  # stop leaves these alone
        local f
        for f in $OUTSIDE_FILES $OUTSIDE_DIRS; do [ ! -e "$f" ] || echo "$f"; done >"$G/outside-preexisting"
    fi
    if [ -d /var/lib/glusterd/groups ] && [ ! -e "$G/lib/groups" ]; then
        cp -r /var/lib/glusterd/groups "$G/lib/"   # volume option groups (optional)
    fi
    local hn i t0=$SECONDS
    hn=$(brick_host)

    alive "$G/run/glusterd.pid" || start_glusterd

    if ! gl volume info "$VOL" >/dev/null 2>&1; then
        say "creating volume $VOL: bricks $hn:$G/bricks/b1 and $hn:$G/bricks/b2"
        gl volume create "$VOL" transport tcp "$hn:$G/bricks/b1" "$hn:$G/bricks/b2" force >&2 ||
            die "gluster volume create failed; see $G/log/cli.log and $G/log/glusterd.log"
    fi
    if ! gl volume info "$VOL" 2>/dev/null | grep -q '^Status: Started'; then
        gl volume start "$VOL" >&2 || die "gluster volume start failed; see $G/log/glusterd.log"
    elif ! bricks_online; then
        say "restarting the bricks that are down"
        gl volume start "$VOL" force >&2 || die "gluster volume start force failed; see $G/log/glusterd.log"
    fi
    for i in $(seq 50); do bricks_online && break; sleep 0.2; done
    bricks_online || die "the bricks of $VOL are not online; see $G/log/glusterd.log and" \
        "/var/log/glusterfs/bricks/"

    if ! client_ok; then
        unmount_client
        mount -t glusterfs -o "log-file=$G/log/mnt.log" "$hn:/$VOL" "$MNT" 9<&- ||
            die "mount -t glusterfs $hn:/$VOL $MNT failed; see $G/log/mnt.log"
        find_fuse_pid | head -n 1 >"$G/run/fuse.pid"
        [ -s "$G/run/fuse.pid" ] || say "warning: could not find the PID of the FUSE client"
    fi
    healthy || die "volume $VOL is mounted at $MNT but does not answer; see the logs in $G/log"
    say "volume $VOL mounted at $MNT ($((SECONDS - t0)) s)"
    echo "$MNT"
}

cleanup_outside() {  # the files gluster hard-codes outside STATE_DIR
    local socks=$1 name f
    # shellcheck disable=SC2086  # socket paths: no blanks
    [ -z "$socks" ] || rm -f $socks
    name=$(echo "${G#/}" | tr / -)
    rm -f /var/log/glusterfs/bricks/"$name"-bricks-b1.log /var/log/glusterfs/bricks/"$name"-bricks-b2.log
    [ -e "$G/outside-preexisting" ] || return 0   # unknown: leave the rest alone
    for f in $OUTSIDE_FILES; do
        grep -qxF -- "$f" "$G/outside-preexisting" || rm -f "$f"
    done
    for f in $OUTSIDE_DIRS; do   # only when empty (another gluster may use them)
        grep -qxF -- "$f" "$G/outside-preexisting" || rmdir "$f" 2>/dev/null || true
    done
}

cmd_stop() {
    if [ ! -e "$G" ]; then
        say "nothing to stop ($G does not exist)"
        return 0
    fi
    if [ ! -e "$MARK" ]; then
        rmdir "$G" 2>/dev/null && { say "removed the empty $G"; return 0; }
        die "$G was not made by this script (no $MARK): refusing to touch it"
    fi
    is_root || die "stop needs root (it unmounts and stops glusterd)"
    lock
    local f p socks=
    if mounted; then
        say "unmounting $MNT"
        if ! umount "$MNT"; then
            say "$MNT is busy (see: fuser -vm $MNT); detaching it lazily"
            umount -l "$MNT"
        fi
    fi
    stop_pidfile "$G/run/fuse.pid"
    # brick sockets live in /run/gluster whatever the options: note them while the bricks run
    for f in $(find "$G/run" -path '*/vols/*' -name '*.pid' 2>/dev/null); do
        p=$(pid_in "$f") || continue
        socks="$socks $(tr '\0' '\n' <"/proc/$p/cmdline" | grep -A1 -x -- -S | tail -n 1)"
    done
    if alive "$G/run/glusterd.pid"; then
        say "stopping volume $VOL"
        gl volume stop "$VOL" force >/dev/null 2>&1 || say "gluster volume stop failed; stopping the bricks by PID"
    fi
    for f in $(find "$G/run" -name '*.pid' ! -path "$G/run/glusterd.pid" 2>/dev/null); do
        stop_pidfile "$f"
    done
    stop_pidfile "$G/run/glusterd.pid"
    # a process of this volume that had no PID file (it must not happen): stop it by its PID
    for p in $(ls /proc | grep -E '^[0-9]+$'); do
        if is_ours "$p"; then
            say "warning: PID $p ($(cat "/proc/$p/comm" 2>/dev/null)) of this volume had no PID file; stopping it"
            stop_pid "$p"
        fi
    done
    cleanup_outside "$socks"
    rm -rf "$G"
    say "stopped; removed $G"
}

cmd_status() {
    if ! mounted; then
        echo "gluster-pfs: not mounted ($MNT)"
        return 1
    fi
    local state="not running"
    alive "$G/run/glusterd.pid" && state="running (PID $(pid_in "$G/run/glusterd.pid"))"
    echo "gluster-pfs: volume $VOL mounted at $MNT ($(mount_type)); glusterd $state"
    if ! timeout 10 df -h "$MNT"; then
        echo "gluster-pfs: $MNT is mounted but does not answer (stale); run start to remount"
        return 1
    fi
}

case $CMD in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
esac
