#!/usr/bin/env bash
# `make test-slurm`: a one-node SLURM cluster on 127.0.0.1, its configuration, state and logs in a
# temporary directory, and the tests of tests/slurm run against it (scripts in slurm/, real sbatch,
# scancel, preemption). Installs Debian's slurm-wlm and munge where they are missing (as root).
# The daemons it starts (munged, slurmctld, slurmd) are stopped by their PIDs when it exits, also
# when a test fails. Arguments go to pytest; KEEP=1 keeps the directory (logs) afterwards;
# `tests/slurm/cluster.sh --run CMD ...` runs CMD instead of the tests, with SLURM_CONF set.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}

missing=()
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/oryx-slurm.XXXXXX")
pids=()
payload=
stop() {
  local rc=$? pid
  set +e
  if [[ -n $payload ]]; then kill -TERM "$payload" 2>/dev/null; wait "$payload" 2>/dev/null; fi
  if [[ -n ${SLURM_CONF:-} ]] && squeue -h -o %i 2>/dev/null | grep -q .; then  # jobs outlive slurmd: end them
    scancel --signal=KILL --full --user="$(id -un)" 2>/dev/null
    scancel --user="$(id -un)" 2>/dev/null
    for _ in $(seq 150); do squeue -h -o %i 2>/dev/null | grep -q . || break; sleep 0.2; done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do  # slurmd, slurmctld, then munged
    pid=${pids[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  if ((rc)) || [[ -n ${KEEP:-} ]]; then echo "cluster files kept in $dir" >&2; else rm -rf "$dir"; fi
  exit "$rc"
}
trap stop EXIT
trap 'exit 130' INT TERM

mkdir -p "$dir"/{state,spool,munge}
chmod 700 "$dir/munge"
mungekey --create --keyfile="$dir/munge/munge.key"
munged --force --foreground --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $dir/munge/munge.socket ]] && break; sleep 0.1; done

# Two free loopback ports for slurmctld and slurmd (another cluster may hold SLURM's defaults).
read -r ctld_port slurmd_port < <("$PY" -c '
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in ss))')
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
cat >"$dir/slurm.conf" <<CONF
ClusterName=oryx-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
# cred_expire: the credential lifetime, which also holds a requeued job back (120 s by default).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# The main scheduler every 2 s (60 s by default): a requeued job starts again once its begin time passed.
SchedulerParameters=sched_interval=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$memory_mb State=UNKNOWN
PartitionName=low Nodes=localhost Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=60 MaxTime=INFINITE State=UP
PartitionName=high Nodes=localhost PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf

slurmctld -D -i -f "$SLURM_CONF" >/dev/null 2>&1 &  # logs: slurmctld.log
pids+=($!)
slurmd -D -N localhost -f "$SLURM_CONF" >/dev/null 2>&1 &  # logs: slurmd.log
pids+=($!)
for _ in $(seq 300); do
  [[ $(sinfo -h -n localhost -o %t 2>/dev/null) == idle ]] && break
  sleep 0.2
done
[[ $(sinfo -h -n localhost -o %t) == idle ]] || { echo "the node never became idle" >&2; cat "$dir"/*.log >&2; exit 1; }
echo "SLURM $(sinfo -V | cut -d' ' -f2) up in $dir: $(sinfo -h -o '%P %c CPUs %t' | tr '\n' ' ')"

# In the background, so that a signal to this script stops the daemons at once (a trap waits
# for a command in the foreground).
if [[ ${1:-} == --run ]]; then
  "${@:2}" &
else
  ORYX_SLURM_CLUSTER=$dir "$PY" -m pytest -q -p no:cacheprovider --durations=0 tests/slurm "$@" &
fi
payload=$!
status=0
wait "$payload" || status=$?
payload=
exit "$status"
