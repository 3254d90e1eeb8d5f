#!/usr/bin/env bash
# Run a real one-node SLURM cluster on this machine (Debian/Ubuntu, no systemd needed).
#
#   scripts/slurm/local-cluster.sh start    # install slurm-wlm + munge if missing, configure, start, wait until idle
#   scripts/slurm/local-cluster.sh stop     # stop slurmd, slurmctld and munged
#   scripts/slurm/local-cluster.sh status   # daemons, sinfo, squeue; exit 1 unless the cluster is usable
#   scripts/slurm/local-cluster.sh restart
#
# Idempotent: `start` on a running cluster with an unchanged config only checks it.
# If the generated slurm.conf changes (e.g. other CPU count), the daemons are restarted.
#
# Environment (all optional):
#   SLURM_CONF                 slurm.conf to write (default /etc/slurm/slurm.conf; the
#                              SLURM commands read the same variable)
#   LOCAL_SLURM_CPUS           CPUs advertised for the node (default 4 x nproc, at least 8;
#                              oversubscribes the physical cores on purpose, see README.md)
#   LOCAL_SLURM_MEM_MARGIN_MB  memory kept back from RealMemory (default 10% of RAM, min 512)
#   LOCAL_SLURM_STATE_DIR      state/spool root (default /var/lib/slurm)
#   LOCAL_SLURM_LOG_DIR        log dir (default /var/log/slurm)
#   LOCAL_SLURM_PARTITION      partition name (default debug)
#   LOCAL_SLURM_CRED_EXPIRE    seconds a requeued job waits before it may start again
#                              (SLURM's default is 120; default here 10)
#   LOCAL_SLURM_TIMEOUT        seconds to wait for the node to become idle (default 90)
set -euo pipefail

SLURM_CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
STATE_DIR="${LOCAL_SLURM_STATE_DIR:-/var/lib/slurm}"
LOG_DIR="${LOCAL_SLURM_LOG_DIR:-/var/log/slurm}"
PARTITION="${LOCAL_SLURM_PARTITION:-debug}"
CRED_EXPIRE="${LOCAL_SLURM_CRED_EXPIRE:-10}"
TIMEOUT="${LOCAL_SLURM_TIMEOUT:-90}"
((CRED_EXPIRE >= 5)) || CRED_EXPIRE=5 # SLURM rejects values below 5
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
export SLURM_CONF

log() { printf '[local-cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

need_root() {
    if [[ $EUID -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "must run as root (or with sudo available)"
        exec sudo -E -- bash "$0" "$@"
    fi
}

# --- process helpers --------------------------------------------------------
# alive = exists and is not a zombie (PID 1 in containers may reap late)
alive() {
    local st
    st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

# pid of a running daemon: from its pid file if that process still has the
# expected name, else an exact-name process lookup (covers lost pid files).
daemon_pid() {
    local name=$1 pidfile=$2 pid=""
    if [[ -r $pidfile ]]; then
        pid=$(tr -dc '0-9' <"$pidfile")
        if [[ -n $pid ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] && alive "$pid"; then
            echo "$pid"; return 0
        fi
    fi
    for pid in $(pgrep -x "$name" 2>/dev/null || true); do
        alive "$pid" && { echo "$pid"; return 0; }
    done
    return 1
}

stop_daemon() {
    local name=$1 pidfile=$2 pid i
    pid=$(daemon_pid "$name" "$pidfile") || { rm -f "$pidfile"; return 0; }
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        log "$name did not exit after 10s, sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$pidfile"
}

# --- install ----------------------------------------------------------------
install_packages() {
    local missing=()
    command -v munged >/dev/null 2>&1 || [[ -x /usr/sbin/munged ]] || missing+=(munge)
    { command -v slurmctld >/dev/null 2>&1 || [[ -x /usr/sbin/slurmctld ]]; } &&
        { command -v slurmd >/dev/null 2>&1 || [[ -x /usr/sbin/slurmd ]]; } &&
        command -v sbatch >/dev/null 2>&1 || missing+=(slurm-wlm)
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install ${missing[*]} yourself"
    log "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # 9>&-: daemons started by package scripts must not inherit our lock fd
    apt-get update -qq >/dev/null 9>&-
    apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${missing[@]}" >/dev/null 9>&-
}

# --- munge ------------------------------------------------------------------
setup_munge() {
    id munge >/dev/null 2>&1 || die "user 'munge' missing (is the munge package installed?)"
    install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
    install -d -o munge -g munge -m 0711 /var/lib/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating munge key $MUNGE_KEY"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    # munged refuses keys that are readable by others or not owned by its user
    chown munge:munge "$MUNGE_KEY"
    chmod 0600 "$MUNGE_KEY"

    if ! daemon_pid munged "$MUNGE_PID" >/dev/null; then
        log "starting munged"
        runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID" 9>&-
    fi
    local i
    for ((i = 0; i < 50; i++)); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    die "munge does not work (see /var/log/munge/munged.log)"
}

# --- slurm.conf ---------------------------------------------------------------
render_conf() {
    local host=$1 ncpu mem_total margin real_mem cpus def_mem slurm_user
    ncpu=$(nproc)
    cpus="${LOCAL_SLURM_CPUS:-$((ncpu * 4 > 8 ? ncpu * 4 : 8))}"
    mem_total=$(free -m | awk '/^Mem:/ {print $2}')
    margin="${LOCAL_SLURM_MEM_MARGIN_MB:-$((mem_total / 10 > 512 ? mem_total / 10 : 512))}"
    real_mem=$((mem_total - margin))
    ((real_mem >= 256)) || real_mem=256
    def_mem=$((real_mem / cpus))
    slurm_user=root
    id slurm >/dev/null 2>&1 && slurm_user=slurm

    cat <<EOF
# Generated by scripts/slurm/local-cluster.sh -- one-node localhost cluster.
# Regenerated on every 'start'; edit the script (or its env vars), not this file.
ClusterName=localcluster
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=${slurm_user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued batch job waits before it may start
# again (SLURM's default is 120 s).
AuthInfo=cred_expire=${CRED_EXPIRE}
MpiDefault=none
# no cgroups / systemd here: track processes by parent pid, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# job completion records in a text file ('sacct -c' reads them)
JobCompType=jobcomp/filetxt
JobCompLoc=${LOG_DIR}/jobcomp.log
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
# schedule often so pending/requeued jobs start within seconds
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# the node advertises more CPUs than it has (see CPUs= below); accept that
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
# keep finished jobs visible to 'scontrol show job' for an hour
MinJobAge=3600
KillWait=30
InactiveLimit=0
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=${STATE_DIR}/slurmctld
SlurmdSpoolDir=${STATE_DIR}/slurmd
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${SLURMD_PID}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# physical: ${ncpu} CPUs, ${mem_total} MiB
NodeName=${host} NodeAddr=127.0.0.1 NodeHostname=${host} CPUs=${cpus} RealMemory=${real_mem} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${host} Default=YES MaxTime=INFINITE State=UP DefMemPerCPU=${def_mem} OverSubscribe=NO
EOF
}

ensure_hostname_resolves() {
    local host=$1
    getent hosts "$host" >/dev/null 2>&1 && return 0
    log "hostname '$host' does not resolve; adding it to /etc/hosts"
    printf '127.0.0.1 %s\n' "$host" >>/etc/hosts
}

# writes slurm.conf; returns 0 if it changed
write_conf() {
    local host=$1 tmp
    tmp=$(mktemp)
    render_conf "$host" >"$tmp"
    mkdir -p "$(dirname "$SLURM_CONF")"
    if [[ -f $SLURM_CONF ]] && cmp -s "$tmp" "$SLURM_CONF"; then
        rm -f "$tmp"
        return 1
    fi
    install -m 0644 "$tmp" "$SLURM_CONF"
    rm -f "$tmp"
    log "wrote $SLURM_CONF"
    return 0
}

prepare_dirs() {
    local user
    user=$(awk -F= '/^SlurmUser=/ {print $2}' "$SLURM_CONF")
    install -d -m 0755 "$STATE_DIR" "$LOG_DIR"
    install -d -o "$user" -m 0755 "$STATE_DIR/slurmctld"
    install -d -m 0755 "$STATE_DIR/slurmd"
    chown "$user" "$LOG_DIR"
    touch "$LOG_DIR/slurmctld.log" "$LOG_DIR/jobcomp.log"
    chown "$user" "$LOG_DIR/slurmctld.log" "$LOG_DIR/jobcomp.log"
}

node_state() { sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n1; }

wait_ready() {
    local host=$1 deadline state resumed=0
    deadline=$((SECONDS + TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(node_state "$host" || true)
        case "$state" in
            idle | mixed | allocated | completing)
                return 0 ;;
            *drain* | down* | fail*)
                if ((resumed < 3)); then
                    log "node $host is '$state', resuming"
                    scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
                    resumed=$((resumed + 1))
                fi ;;
        esac
        sleep 1
    done
    log "node $host not ready after ${TIMEOUT}s (state '${state:-unknown}')"
    scontrol show node "$host" 2>/dev/null | grep -E 'State=|Reason=' >&2 || true
    log "see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
    return 1
}

one_line_status() {
    local host=$1
    printf 'local SLURM up: node %s state=%s partition=%s cpus=%s mem=%sMiB conf=%s logs=%s\n' \
        "$host" "$(node_state "$host")" "$PARTITION" \
        "$(sinfo -h -N -n "$host" -o '%c')" "$(sinfo -h -N -n "$host" -o '%m')" \
        "$SLURM_CONF" "$LOG_DIR"
}

# --- commands ---------------------------------------------------------------
cmd_start() {
    local host changed=1 t0=$SECONDS
    host=$(hostname -s)
    install_packages
    ensure_hostname_resolves "$host"
    setup_munge
    write_conf "$host" || changed=0
    prepare_dirs

    if ((changed)); then
        if daemon_pid slurmctld "$CTLD_PID" >/dev/null || daemon_pid slurmd "$SLURMD_PID" >/dev/null; then
            log "config changed: restarting slurm daemons"
            stop_daemon slurmd "$SLURMD_PID"
            stop_daemon slurmctld "$CTLD_PID"
        fi
    fi
    if ! daemon_pid slurmctld "$CTLD_PID" >/dev/null; then
        log "starting slurmctld"
        /usr/sbin/slurmctld 9>&- || die "slurmctld failed to start; see $LOG_DIR/slurmctld.log"
    fi
    local i
    for ((i = 0; i < 100; i++)); do
        scontrol ping 2>/dev/null | grep -q 'is UP' && break
        sleep 0.2
    done
    if ! daemon_pid slurmd "$SLURMD_PID" >/dev/null; then
        log "starting slurmd"
        /usr/sbin/slurmd 9>&- || die "slurmd failed to start; see $LOG_DIR/slurmd.log"
    fi
    wait_ready "$host" || exit 1
    one_line_status "$host"
    log "ready in $((SECONDS - t0))s"
}

cmd_stop() {
    stop_daemon slurmd "$SLURMD_PID"
    stop_daemon slurmctld "$CTLD_PID"
    stop_daemon munged "$MUNGE_PID"
    log "stopped"
}

cmd_status() {
    local ok=0 name pidfile pid host state
    host=$(hostname -s)
    for name in munged slurmctld slurmd; do
        case $name in
            munged) pidfile=$MUNGE_PID ;;
            slurmctld) pidfile=$CTLD_PID ;;
            slurmd) pidfile=$SLURMD_PID ;;
        esac
        if pid=$(daemon_pid "$name" "$pidfile"); then
            printf '%-10s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-10s NOT running\n' "$name"
            ok=1
        fi
    done
    if command -v sinfo >/dev/null 2>&1 && sinfo >/dev/null 2>&1; then
        echo
        sinfo -N -o '%N %P %T %c %m %E' || true
        echo
        squeue -o '%.8i %.9P %.20j %.8u %.10T %.10M %.6D %R' || true
        state=$(node_state "$host" || true)
        case "$state" in
            idle | mixed | allocated | completing) ;;
            *) echo "node $host state: ${state:-unknown}"; ok=1 ;;
        esac
    else
        echo "slurmctld not reachable (sinfo failed)"
        ok=1
    fi
    return $ok
}

# serialise concurrent start/stop calls (e.g. parallel test workers)
lock() {
    local f=/tmp/local-slurm-cluster.lock
    [[ -d /run/lock && -w /run/lock ]] && f=/run/lock/local-slurm-cluster.lock
    exec 9>"$f"
    flock -w 300 9 || die "could not get the lock (another start/stop is hanging?)"
}

case "${1:-}" in
    start) need_root "$@"; lock; cmd_start ;;
    stop) need_root "$@"; lock; cmd_stop ;;
    restart) need_root "$@"; lock; cmd_stop; cmd_start ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 start|stop|status|restart" >&2
        exit 2 ;;
esac
