#!/usr/bin/env bash
# Slurm for real: a daskflow-kv workflow whose workers are `sbatch` jobs (dask-jobqueue).
#
#   bash scripts/slurm_check.sh            # tiny model (+ a cancelled job, adapt, scale-down), then SmolLM2
#   SLURM_CHECK_QUICK=1 bash scripts/slurm_check.sh   # tiny model only
#   SLURM_CHECK_PYTEST=1 bash scripts/slurm_check.sh  # also run tests/test_slurm.py while Slurm is up
#
# Where `sinfo` already answers, the Slurm found is used as it is and nothing is started or
# stopped. Otherwise (root and apt needed) munge and Slurm are installed if missing, a
# single-node cluster is configured under $DASKFLOW_KV_SLURM_DIR (this host is controller
# and compute node; CPUs from nproc, memory below what is available; no cgroups), and
# munged, slurmctld and slurmd are started, then stopped on exit. /etc is not written to,
# except by apt. Safe to run twice: daemons a killed earlier run left behind are stopped first.
#
# Python: the active virtual environment when it imports daskflow_kv and dask_jobqueue,
# else the project's (scripts/env.sh creates .venv in the repo root). Worker jobs run the
# same python, with PYTHONPATH forwarded so they import this checkout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SLURM_DIR="${DASKFLOW_KV_SLURM_DIR:-/tmp/daskflow-kv-slurm}"
NODE="$(hostname -s)"
STARTED=()  # pids of the daemons this run started, in start order

say() { echo "[slurm-check] $*"; }
die() { say "error: $*" >&2; exit 1; }

sinfo_answers() { timeout 20 sinfo -h -o %P >/dev/null 2>&1; }

# -- stopping what this script started (and only that) ------------------------------------
stop_pid() {
  local pid=$1 _
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
}

stop_daemons() {
  local i
  for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do stop_pid "${STARTED[i]}"; done
  [ ${#STARTED[@]} -eq 0 ] || say "stopped the daemons this run started (${STARTED[*]})"
  rm -f "$SLURM_DIR"/*.pid
}

# A run killed before its trap ran leaves its daemons behind, with their pid files.
stop_leftovers() {
  local f pid
  for f in "$SLURM_DIR"/slurmd.pid "$SLURM_DIR"/slurmctld.pid "$SLURM_DIR"/munged.pid; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null && grep -qE 'slurm|munge' "/proc/$pid/comm" 2>/dev/null; then
      say "stopping $(cat "/proc/$pid/comm") $pid left by an earlier run"
      stop_pid "$pid"
    fi
    rm -f "$f"
  done
}

# -- a single-node Slurm, when none answers -----------------------------------------------
install_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || die "no Slurm answers and this is not root with apt"
  say "installing munge and Slurm (apt-get install slurm-wlm munge)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
}

write_conf() {
  local cpus mem_kib mem_mib
  cpus="$(nproc)"
  mem_kib="$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)"
  mem_mib=$((mem_kib / 1024 * 3 / 4))  # below what is free now: other processes share this host
  mkdir -p "$SLURM_DIR"/{ctld,spool,logs}
  cat >"$SLURM_DIR/slurm.conf" <<EOF
# Written by scripts/slurm_check.sh: $NODE is controller and its only compute node.
ClusterName=daskflow-kv
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$SLURM_DIR/logs/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation=$SLURM_DIR/ctld
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/logs/slurmctld.log
SlurmdLogFile=$SLURM_DIR/logs/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  say "wrote $SLURM_DIR/slurm.conf: node $NODE, $cpus CPUs, ${mem_mib} MiB"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already running"
    return
  fi
  [ -s /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || /usr/sbin/mungekey --create; }
  chown munge:munge /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F \
    --pid-file="$SLURM_DIR/munged.pid.own" >"$SLURM_DIR/logs/munged.out" 2>&1 &
  STARTED+=($!)
  echo $! >"$SLURM_DIR/munged.pid"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.2; done
  die "munged did not start (see $SLURM_DIR/logs/munged.out)"
}

start_slurm() {
  # -c: no state recovered from an earlier run (its jobs are gone with it).
  slurmctld -D -c -f "$SLURM_CONF" >"$SLURM_DIR/logs/slurmctld.out" 2>&1 &
  STARTED+=($!)
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
  slurmd -D -c -f "$SLURM_CONF" >"$SLURM_DIR/logs/slurmd.out" 2>&1 &
  STARTED+=($!)
  say "started slurmctld and slurmd (pids ${STARTED[*]: -2})"
}

wait_idle() {
  local state=""
  for _ in $(seq 120); do
    state="$(timeout 10 sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true)"
    case "$state" in
      idle*|mixed*|allocated*) say "sinfo: node $NODE $state"; return ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  die "node $NODE not idle after 60s (state '${state}'); logs in $SLURM_DIR/logs"
}

# -- the Python that runs the client and, through the job script, the workers -------------
use_python() {
  if [ -n "${VIRTUAL_ENV:-}" ] && python -c "import daskflow_kv, dask_jobqueue" 2>/dev/null; then
    say "python: $(command -v python) (active environment)"
  else
    # shellcheck disable=SC1091
    source "$ROOT/scripts/env.sh"
    say "python: $(command -v python)"
  fi
}

main() {
  if sinfo_answers; then
    say "using the Slurm that answers: $(sinfo -h -o '%P %D nodes %T' | tr '\n' ' ')"
  else
    install_slurm
    mkdir -p "$SLURM_DIR"
    stop_leftovers
    export SLURM_CONF="$SLURM_DIR/slurm.conf"
    trap stop_daemons EXIT
    trap 'exit 130' INT TERM
    write_conf
    start_munge
    start_slurm
    wait_idle
  fi

  use_python
  cd "$ROOT"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  local check=(python scripts/slurm_check.py --log-directory "$SLURM_DIR/jobs")
  "${check[@]}" --model tiny-llama --workflow debate --cancel --elastic
  if [ -z "${SLURM_CHECK_QUICK:-}" ]; then
    # SmolLM2: readers, then a synthesizer; a job is cancelled 1 s into the synthesizer's level.
    "${check[@]}" --model smollm2 --workflow rag --agents 3 --cancel --cancel-delay 1
  fi
  if [ -n "${SLURM_CHECK_PYTEST:-}" ]; then
    python -m pytest -q tests/test_slurm.py
  fi
  say "done: every agent agreed in every run"
}

# Sourced (for debugging), it only defines the functions.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || main "$@"
