#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for trying the sbatch scripts and for
# tests/test_slurm.py (Debian or Ubuntu, as root; no systemd or cgroups needed).
#
#   slurm/one-node-slurm.sh up       install (apt) if needed, configure, start munge,
#                                    slurmctld and slurmd; wait until the node is idle
#   slurm/one-node-slurm.sh up --nodes 2
#                                    the same with two nodes, node1 and node2, one slurmd
#                                    each: a job of --nodes=2 runs its ranks under two slurmd
#                                    with two host names, as on two machines
#   slurm/one-node-slurm.sh down     cancel its jobs and stop the daemons it started
#   slurm/one-node-slurm.sh status
#
# Then: export SLURM_CONF=$MPIPS_SLURM_DIR/slurm.conf (printed by `up`) and use sbatch,
# squeue, scancel, scontrol as usual. Settings (environment):
#   MPIPS_SLURM_DIR   state, logs and config (default /tmp/mpips-one-node-slurm)
#   MPIPS_SLURM_CPUS  CPUs each node claims (default 8: an 8-task job fits on a small machine;
#                     ranks then share cores, which mpips is built to tolerate)
#
# With --nodes N (N > 1) Slurm reaches node k's slurmd at 127.0.0.1, port 17000 + k
# (`slurmd -N nodeK`; Debian's Slurm 22.05 runs several slurmd on one host this way). Each
# slurmd runs in its own UTS and mount namespace (unshare): its host name is its node name
# and a private /etc/hosts maps node1..nodeN to 127.0.0.1, so what runs under it (the batch
# script, mpiexec's proxies, the ranks) reports that node's name and reaches the other nodes
# by name. This machine's own host name and /etc/hosts are left alone.
set -euo pipefail

ROOT=${MPIPS_SLURM_DIR:-/tmp/mpips-one-node-slurm}
CPUS=${MPIPS_SLURM_CPUS:-8}
NODES=1
CONF=$ROOT/slurm.conf
export SLURM_CONF=$CONF

note() { printf '[one-node-slurm] %s\n' "$*"; }
die() { note "$*" >&2; exit 1; }

# running PIDFILE COMM: the process in PIDFILE is alive (not a zombie) and is COMM
running() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] &&
        ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" -eq 0 ] || die "installing Slurm needs root (apt-get)"
    note "installing slurmctld, slurmd, slurm-client and munge"
    # the packages' scripts must not try to start services (there may be no init system)
    local blocker=/usr/sbin/policy-rc.d ours=0
    if [ ! -e $blocker ]; then printf '#!/bin/sh\nexit 101\n' > $blocker; chmod 755 $blocker; ours=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >/dev/null || { [ $ours = 0 ] || rm -f $blocker; die "apt-get failed"; }
    [ $ours = 0 ] || rm -f $blocker
}

node_names() {  # this cluster's nodes, one a line
    if [ "$NODES" -eq 1 ]; then echo localhost; else seq -f 'node%g' "$NODES"; fi
}

write_config() {
    mkdir -p "$ROOT/state" "$ROOT/spool" "$ROOT/log"
    local memory hardware node i=0
    local spool=$ROOT/spool pidfile=$ROOT/slurmd.pid log=$ROOT/log/slurmd.log
    memory=$(awk '/^MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
    hardware="CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1"
    hardware="$hardware RealMemory=$memory State=UNKNOWN"
    if [ "$NODES" -gt 1 ]; then  # a spool, pid file and log per slurmd (%n: its node name)
        spool=$ROOT/spool/%n pidfile=$ROOT/slurmd-%n.pid log=$ROOT/log/slurmd-%n.log
        for node in $(node_names); do mkdir -p "$ROOT/spool/$node"; done
    fi
    cat > "$CONF" <<EOF
# written by mpips' slurm/one-node-slurm.sh
ClusterName=mpips-local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a short credential life: a requeued job may start again after 10 s, not 120 s
AuthInfo=cred_expire=10
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$pidfile
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$log
# plain process tracking: containers and VMs often have no usable cgroups
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# each job's end state and exit code, kept in a text file
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.log
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
KillWait=10
# let a node claim more CPUs than it has, so an 8-task job runs on a 2-core machine
SlurmdParameters=config_overrides
EOF
    if [ "$NODES" -eq 1 ]; then
        echo "NodeName=localhost $hardware" >> "$CONF"
    else
        for node in $(node_names); do
            i=$((i + 1))
            echo "NodeName=$node NodeHostname=$node NodeAddr=127.0.0.1 Port=$((17000 + i)) $hardware" >> "$CONF"
        done
        { cat /etc/hosts; echo "127.0.0.1 $(node_names | paste -sd' ')"; } > "$ROOT/hosts"
    fi
    echo "PartitionName=debug Nodes=$(node_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
}

start_munge() {
    if echo | munge 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey -c
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$ROOT/munged.pid"  # started by us: `down` stops it
    for _ in $(seq 100); do echo | munge 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
    die "munged did not answer"
}

start_daemon() {  # COMM FILE COMMAND...: start a Slurm daemon unless it runs already
    # (FILE: the name of its pid file in $ROOT and its log in $ROOT/log, without .pid/.log)
    local comm=$1 file=$2; shift 2
    running "$ROOT/$file.pid" "$comm" && return 0
    "$@" || true  # it daemonizes; success is judged by its pid file
    for _ in $(seq 100); do running "$ROOT/$file.pid" "$comm" && return 0; sleep 0.1; done
    tail -n 20 "$ROOT/log/$file.log" >&2 || true
    die "$file did not start"
}

start_nodes() {
    local node
    if [ "$NODES" -eq 1 ]; then
        start_daemon slurmd slurmd /usr/sbin/slurmd -N localhost
        return
    fi
    unshare --uts --mount true 2>/dev/null ||
        die "--nodes $NODES needs 'unshare --uts --mount' (root with CAP_SYS_ADMIN): $(unshare --uts --mount true 2>&1)"
    for node in $(node_names); do
        start_daemon slurmd "slurmd-$node" unshare --uts --mount sh -c \
            "mount --bind '$ROOT/hosts' /etc/hosts && hostname $node && exec /usr/sbin/slurmd -N $node"
    done
}

stop_pidfile() {  # PIDFILE COMM
    if running "$1" "$2"; then
        local pid; pid=$(cat "$1")
        kill "$pid"
        for _ in $(seq 100); do running "$1" "$2" || break; sleep 0.1; done
        running "$1" "$2" && kill -9 "$pid"
    fi
    rm -f "$1"
}

stop_nodes() {  # every slurmd started here, by one-node or several-node `up`
    local pidfile
    for pidfile in "$ROOT"/slurmd.pid "$ROOT"/slurmd-*.pid; do
        [ ! -e "$pidfile" ] || stop_pidfile "$pidfile" slurmd
    done
}

up() {
    install_packages
    write_config
    start_munge
    # a daemon still running from an earlier `up` may hold an older config: restart it
    stop_nodes
    stop_pidfile "$ROOT/slurmctld.pid" slurmctld
    start_daemon slurmctld slurmctld /usr/sbin/slurmctld
    start_nodes
    local states="" ready=0
    for _ in $(seq 600); do  # every node up: idle, or running a job kept from before
        states=$(sinfo -h -N -o %T 2>/dev/null || true)
        ready=$(printf '%s\n' "$states" | grep -cxE 'idle|mixed|allocated' || true)
        [ "$ready" -eq "$NODES" ] && break
        sleep 0.1
    done
    [ "$ready" -eq "$NODES" ] ||
        die "$ready of $NODES nodes came up (states: $(echo "$states" | paste -sd' ')); logs in $ROOT/log"
    sinfo
    note "up; use it with: export SLURM_CONF=$CONF"
}

down() {
    if running "$ROOT/slurmctld.pid" slurmctld; then
        scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
    fi
    stop_nodes
    stop_pidfile "$ROOT/slurmctld.pid" slurmctld
    stop_pidfile "$ROOT/munged.pid" munged
}

status() {
    local pidfile name
    for pidfile in "$ROOT"/munged.pid "$ROOT"/slurmctld.pid "$ROOT"/slurmd.pid "$ROOT"/slurmd-*.pid; do
        [ -e "$pidfile" ] || [ "$pidfile" != "$ROOT/slurmd-*.pid" ] || continue
        name=$(basename "$pidfile" .pid)
        if running "$pidfile" "${name%%-*}"; then echo "$name: running"; else echo "$name: not started here"; fi
    done
    sinfo 2>/dev/null || true
}

usage() { echo "usage: $0 up [--nodes N] | down | status" >&2; exit 2; }

command=${1:-up}
[ $# -eq 0 ] || shift
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) [ $# -ge 2 ] || usage; NODES=$2; shift 2 ;;
        --nodes=*) NODES=${1#--nodes=}; shift ;;
        *) usage ;;
    esac
done
case $NODES in ''|*[!0-9]*|0*) die "--nodes takes a count of 1 or more, got '$NODES'" ;; esac
case $command in
    up|start) up ;;
    down|stop) down ;;
    status) status ;;
    *) usage ;;
esac
