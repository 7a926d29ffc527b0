#!/usr/bin/env bash
# A real Slurm cluster of one node on this machine, for trying the sbatch scripts and for
# tests/test_slurm.py (Debian or Ubuntu, as root; no systemd or cgroups needed).
#
#   slurm/one-node-slurm.sh up       install (apt) if needed, configure, start munge,
#                                    slurmctld and slurmd; wait until the node is idle
#   slurm/one-node-slurm.sh down     cancel its jobs and stop the daemons it started
#   slurm/one-node-slurm.sh status
#
# Then: export SLURM_CONF=$MPIPS_SLURM_DIR/slurm.conf (printed by `up`) and use sbatch,
# squeue, scancel, scontrol as usual. Settings (environment):
#   MPIPS_SLURM_DIR   state, logs and config (default /tmp/mpips-one-node-slurm)
#   MPIPS_SLURM_CPUS  CPUs the node claims (default 8: an 8-task job fits on a small machine;
#                     ranks then share cores, which mpips is built to tolerate)
set -euo pipefail

ROOT=${MPIPS_SLURM_DIR:-/tmp/mpips-one-node-slurm}
CPUS=${MPIPS_SLURM_CPUS:-8}
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

write_config() {
    mkdir -p "$ROOT/state" "$ROOT/spool" "$ROOT/log"
    local memory
    memory=$(awk '/^MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
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
SlurmdSpoolDir=$ROOT/spool
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd.log
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
# let the node claim more CPUs than it has, so an 8-task job runs on a 2-core machine
SlurmdParameters=config_overrides
NodeName=localhost CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
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

start_daemon() {  # NAME ARGS...: start a Slurm daemon unless it runs already
    local name=$1; shift
    running "$ROOT/$name.pid" "$name" && return 0
    "/usr/sbin/$name" "$@" || true  # it daemonizes; success is judged by its pid file
    for _ in $(seq 100); do running "$ROOT/$name.pid" "$name" && return 0; sleep 0.1; done
    tail -n 20 "$ROOT/log/$name.log" >&2 || true
    die "$name did not start"
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

up() {
    install_packages
    write_config
    start_munge
    # a daemon still running from an earlier `up` may hold an older config: restart it
    stop_pidfile "$ROOT/slurmd.pid" slurmd
    stop_pidfile "$ROOT/slurmctld.pid" slurmctld
    start_daemon slurmctld
    start_daemon slurmd -N localhost
    local state=""
    for _ in $(seq 600); do
        state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
        case $state in idle|mixed|allocated) break ;; esac
        sleep 0.1
    done
    case $state in idle|mixed|allocated) ;; *) die "the node did not come up (state '$state'); logs in $ROOT/log" ;; esac
    sinfo
    note "up; use it with: export SLURM_CONF=$CONF"
}

down() {
    if running "$ROOT/slurmctld.pid" slurmctld; then
        scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
    fi
    stop_pidfile "$ROOT/slurmd.pid" slurmd
    stop_pidfile "$ROOT/slurmctld.pid" slurmctld
    stop_pidfile "$ROOT/munged.pid" munged
}

status() {
    for name in munged slurmctld slurmd; do
        if running "$ROOT/$name.pid" "$name"; then echo "$name: running"; else echo "$name: not started here"; fi
    done
    sinfo 2>/dev/null || true
}

case ${1:-up} in
    up|start) up ;;
    down|stop) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
