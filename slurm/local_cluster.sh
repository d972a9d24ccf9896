#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for development and the tests:
#   sudo bash slurm/local_cluster.sh start    # installs slurm-wlm + munge if needed, starts munged, slurmctld, slurmd
#   sudo bash slurm/local_cluster.sh status   # daemons and `sinfo`
#   sudo bash slurm/local_cluster.sh stop     # kills the running jobs and the daemons (munged only if this script started it)
# Needs root and Debian/Ubuntu (apt-get). One partition `debug` with this machine's CPUs; jobs run
# as the submitting user in the submit directory. `start` is a no-op when the cluster already runs.
# It writes /etc/slurm/slurm.conf (refusing to replace one it did not write), state under
# /var/spool/fedcp-slurm, pid files and the munged marker under /run/fedcp-slurm, logs under
# /var/log/fedcp-slurm, and the apt output to /tmp/fedcp-slurm-apt.log.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # slurmctld, slurmd, munged

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by fedcp_dist slurm/local_cluster.sh"
STATE=/var/spool/fedcp-slurm
RUN=/run/fedcp-slurm
LOGS=/var/log/fedcp-slurm
APT_LOG=/tmp/fedcp-slurm-apt.log
WAIT_S=${FEDCP_SLURM_WAIT_S:-60}
NODE=$(hostname -s)

say() { echo "local_cluster: $*"; }
die() { echo "local_cluster: error: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process named in the pid file exists
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

need_root() {
    [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts system daemons)"
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurmctld is not installed and there is no apt-get to install it"
    say "installing slurm-wlm and munge with apt-get (log: $APT_LOG)"
    export DEBIAN_FRONTEND=noninteractive
    {
        apt-get update &&
        apt-get install -y --no-install-recommends slurm-wlm munge
    } </dev/null >"$APT_LOG" 2>&1 || { tail -n 20 "$APT_LOG" >&2; die "apt-get failed; see $APT_LOG"; }
    command -v slurmctld >/dev/null || die "slurm-wlm installed but slurmctld is not on PATH"
}

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then return; fi
    local key=/etc/munge/munge.key
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [ ! -s "$key" ]; then
        say "creating the munge key $key"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$key" --force >/dev/null
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        fi
    fi
    local user=root
    if id munge >/dev/null 2>&1; then user=munge; fi
    chown -R "$user:" /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    chmod 0400 "$key"
    # a pid file left by a killed munged blocks a new one
    if [ -s /run/munge/munged.pid ] && ! kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
        rm -f /run/munge/munged.pid
    fi
    if [ "$user" = munge ]; then
        runuser -u munge -- munged </dev/null >>"$LOGS/munged.out" 2>&1 \
            || die "munged did not start; see $LOGS/munged.out and /var/log/munge/munged.log"
    else
        munged --force </dev/null >>"$LOGS/munged.out" 2>&1 \
            || die "munged did not start; see $LOGS/munged.out"
    fi
    touch "$RUN/munged.started-here"
    local _
    for _ in $(seq 1 50); do
        munge_works && return
        sleep 0.2
    done
    die "munged runs but munge -n | unmunge fails; see /var/log/munge/munged.log"
}

gen_conf() {
    local cpus mem
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS
    mem=$(free -m | awk '/^Mem:/ {print $2}')
    mem=$(( mem * 9 / 10 ))   # slurmd drains a node that reports less than RealMemory
    cat <<EOF
$MARK
# A one-node development cluster; rewritten by every \`local_cluster.sh start\`.
ClusterName=local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
KillWait=300
# a requeued job waits cred_expire+1 s before it may start again (default 120 s); schedule often
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=5,bf_interval=2
InactiveLimit=0
MailProg=/bin/true
MinJobAge=300
SlurmdTimeout=300
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

write_conf() {
    if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; move it away to use the local cluster"
    fi
    mkdir -p "$CONF_DIR"
    gen_conf >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
}

node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1; }

wait_idle() {
    local deadline=$(( SECONDS + WAIT_S )) st="" resumed=0
    while [ "$SECONDS" -lt "$deadline" ]; do
        st=$(node_state || true)
        case "$st" in
            idle|mixed|allocated|completing) return 0 ;;
            drained*|draining|down*)
                # a state from an earlier cluster: the daemons are fresh, so put the node back
                if [ "$resumed" = 0 ]; then
                    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        sleep 1
    done
    echo "local_cluster: error: node $NODE is not idle after ${WAIT_S}s (state: ${st:-no answer from slurmctld})" >&2
    sinfo -R >&2 2>/dev/null || true
    echo "  logs: $LOGS/slurmctld.log $LOGS/slurmd.log" >&2
    tail -n 5 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 2>/dev/null || true
    return 1
}

cmd_start() {
    need_root
    mkdir -p "$RUN" "$LOGS"
    if alive "$RUN/slurmctld.pid" && alive "$RUN/slurmd.pid" && [ -e "$CONF" ] \
        && [ "$(gen_conf)" = "$(cat "$CONF")" ]; then
        wait_idle || exit 1
        say "already running (node $NODE: $(node_state))"
        return
    fi
    local t0=$SECONDS
    install_packages
    start_munge
    # a half-running cluster (one daemon died): start both afresh
    stop_daemons
    write_conf
    mkdir -p "$STATE/ctld" "$STATE/d"
    # -c: a throwaway cluster starts clean (no jobs or node states from an earlier start)
    slurmctld -c </dev/null >>"$LOGS/slurmctld.out" 2>&1 \
        || die "slurmctld did not start; see $LOGS/slurmctld.log"
    slurmd </dev/null >>"$LOGS/slurmd.out" 2>&1 \
        || die "slurmd did not start; see $LOGS/slurmd.log"
    wait_idle || exit 1
    say "up in $(( SECONDS - t0 ))s: partition debug, node $NODE ($(sinfo -h -N -n "$NODE" -o %c) CPUs), $(sinfo --version)"
}

kill_pidfile() {  # kill_pidfile FILE NAME: TERM, wait up to 10 s, then KILL
    local f=$1 name=$2 pid _
    alive "$f" || { rm -f "$f"; return 0; }
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$f"; say "stopped $name"; return 0; }
        sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
    say "killed $name"
}

stop_daemons() {
    kill_pidfile "$RUN/slurmd.pid" slurmd
    kill_pidfile "$RUN/slurmctld.pid" slurmctld
}

cmd_stop() {
    need_root
    if alive "$RUN/slurmctld.pid"; then
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
        if [ -n "${jobs// /}" ]; then
            say "killing jobs $jobs"
            # shellcheck disable=SC2086
            scancel --full --signal=KILL $jobs 2>/dev/null || true
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            sleep 1
        fi
    fi
    stop_daemons
    if [ -e "$RUN/munged.started-here" ]; then
        kill_pidfile /run/munge/munged.pid munged
        rm -f "$RUN/munged.started-here"
    fi
    say "stopped"
}

cmd_status() {
    local ok=0 d
    for d in slurmctld slurmd; do
        if alive "$RUN/$d.pid"; then echo "$d: running (pid $(cat "$RUN/$d.pid"))"; else echo "$d: not running"; ok=1; fi
    done
    if munge_works 2>/dev/null; then echo "munged: running"; else echo "munged: not running"; ok=1; fi
    if [ "$ok" = 0 ]; then sinfo; fi
    return "$ok"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
