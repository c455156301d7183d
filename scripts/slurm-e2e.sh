#!/usr/bin/env bash
# The Slurm deploy script (deploy/slurm/train.sbatch), end to end, on a one-node Slurm cluster
# this script starts: munged, slurmctld and slurmd (Debian's slurm-wlm and munge, installed if
# missing; as root), all state in a temporary folder. The batch job starts shardcoordd with its
# per-job token and CA, waits for it, and runs the example trainer (examples/vlm_trainer,
# LibTorch on CPU, Gloo) as 4 Slurm tasks in 2 shard groups. Passes when the job exits 0, every
# rank printed its summary, all ranks end with the same parameters, and the coordinator was
# stopped and its secrets removed. The one change to the batch script: its GPU request is
# dropped (no GPU here); nodes and tasks are given on the sbatch command line. The node is
# declared with 8 CPUs (config_overrides) so that 4 trainer tasks and the coordinator fit. Then
# the same script runs the Python example trainer as 2 srun tasks (ranks from SLURM_PROCID).
#
#   scripts/slurm-e2e.sh            (BUILD_DIR: a build with SHARDCOORD_WITH_TORCH, default build/)
# shellcheck disable=SC2016  # check's conditions are evaluated later, on purpose
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${BUILD_DIR:-$root/build}" && pwd)
[[ $(id -u) == 0 ]] || { echo "slurm-e2e: SKIP: needs root (it starts slurmctld, slurmd and munged)"; exit 77; }
[[ -x $build/examples/vlm_trainer/vlm_trainer ]] || { echo "slurm-e2e: no vlm_trainer in $build"; exit 2; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null || exit 2
fi
work=$(mktemp -d /tmp/slurm-e2e.XXXXXX)
chmod 755 "$work"
host=$(hostname -s)
# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
  for f in "$work"/slurmctld.pid "$work"/slurmd.pid "$work"/munged.pid; do
    [[ -s $f ]] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 1
  rm -rf "$work"
}
trap cleanup EXIT
wait_for() {  # wait_for SECONDS COMMAND: polls until COMMAND succeeds, at most SECONDS
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do ((SECONDS < deadline)) || return 1; sleep 0.5; done
}

# munge, with its own key and socket.
mkdir -p "$work/munge" && chown munge: "$work/munge" && chmod 700 "$work/munge"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chown munge: "$work/munge/munge.key" && chmod 400 "$work/munge/munge.key"
runuser -u munge -- munged --force --key-file="$work/munge/munge.key" --socket="$work/munge/munge.socket" \
  --pid-file="$work/munged.pid" --log-file="$work/munge/munged.log" --seed-file="$work/munge/seed" ||
  { echo "FAIL: munged did not start"; exit 1; }

cat >"$work/slurm.conf" <<CONF
ClusterName=shardcoord-e2e
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/munge.socket
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
SlurmctldPort=$((16817 + RANDOM % 1000))
SlurmdPort=$((17818 + RANDOM % 1000))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
NodeName=$host CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
mkdir -p "$work/state" "$work/spool"
export SLURM_CONF=$work/slurm.conf
slurmctld -f "$SLURM_CONF" || { echo "FAIL: slurmctld did not start"; cat "$work/slurmctld.log"; exit 1; }
slurmd -f "$SLURM_CONF" || { echo "FAIL: slurmd did not start"; cat "$work/slurmd.log"; exit 1; }
wait_for 30 bash -c "sinfo -h -o %t | grep -qE '^(idle|mix)'" ||
  { echo "FAIL: the node did not come up"; sinfo; tail -20 "$work/slurmd.log"; exit 1; }
echo "slurm: node $host idle"

# The batch script as shipped, minus its GPU request; shardcoordd and shardctl from the build.
sed '/--gpus-per-node/d' "$root/deploy/slurm/train.sbatch" >"$work/train.sbatch"
trainer="$build/examples/vlm_trainer/vlm_trainer --steps 3 --accum 2 --policy auto --media mixed --group-size 2"
wrapper="$work/rank.sh"
cat >"$wrapper" <<SH
#!/bin/bash
exec $trainer --job "slurm-\$SLURM_JOB_ID" --rank "\$SLURM_PROCID" --world-size "\$SLURM_NTASKS"
SH
chmod +x "$wrapper"
cd "$work" || exit 1
# The batch script expects shardcoordd and shardctl in one folder, as installed.
mkdir -p "$work/bin" && ln -s "$build/coordinator/shardcoordd" "$build/client/shardctl" "$work/bin/"
SHARDCOORD_BIN_DIR="$work/bin" SHARDCOORD_TRAINER="$wrapper" SHARDCOORD_PORT=$((20000 + RANDOM % 20000)) \
  timeout 300 sbatch --wait -N1 --ntasks-per-node=4 --time=10 -o "$work/job.out" "$work/train.sbatch"
rc=$?
fail=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }
check "the batch job exited 0 (sbatch rc $rc)" '[[ $rc == 0 ]]'
check "shardcoordd came up with TLS and tokens" 'grep -q "shardcoordd ready at" "$work/job.out"'
check "all 4 ranks printed their summary" '[[ $(grep -c "^summary rank" "$work/job.out") == 4 ]]'
check "every rank ends with the same parameters" '[[ $(grep "^final" "$work/job.out" | awk "{print \$4}" | sort -u | wc -l) == 1 ]]'
check "the coordinator served TLS with tokens" 'grep -q "tls=on tokens=on" "$work"/*shardcoordd.log'
check "the per-job token and CA were removed" '! ls "$work"/.shardcoord-* >/dev/null 2>&1'
# A Python trainer under the same batch script: examples/python/vlm_train.py as 2 srun tasks with
# no rank flags (shardcoord.launcher_rank reads SLURM_PROCID and SLURM_NTASKS; torch's env://
# rendezvous the MASTER_ADDR/MASTER_PORT the script exports). Needs the build's Python package.
if [[ -f $build/python/shardcoord/__init__.py ]]; then
  SHARDCOORD_BIN_DIR="$work/bin" SHARDCOORD_PORT=$((20000 + RANDOM % 20000)) \
    SHARDCOORD_TRAINER="env PYTHONPATH=$build/python /usr/bin/python3 $root/examples/python/vlm_train.py --job slurm-py --steps 2 --accum 2 --media mixed --group-size 2" \
    timeout 300 sbatch --wait -N1 --ntasks-per-node=2 --time=10 -o "$work/job-py.out" "$work/train.sbatch"
  rc=$?
  check "python: the batch job exited 0 (sbatch rc $rc)" '[[ $rc == 0 ]]'
  check "python: ranks 0 and 1 (from SLURM_PROCID) printed their summary" \
    '[[ $(grep -oE "^summary rank [0-9]+" "$work/job-py.out" | sort -u | wc -l) == 2 ]]'
  check "python: both ranks end with the same parameters" \
    '[[ $(grep "^final params hash" "$work/job-py.out" | sort -u | wc -l) == 1 ]]'
  if [[ $fail != 0 ]]; then echo "--- python job output"; tail -40 "$work/job-py.out"; fi
else
  echo "slurm-e2e: no Python package in $build/python: the Python trainer job is not run"
fi
if [[ $fail != 0 ]]; then
  echo "--- job output"; tail -40 "$work/job.out"
  echo "--- coordinator log"; tail -20 "$work"/*shardcoordd.log 2>/dev/null
fi
[[ $fail == 0 ]] && echo "slurm end to end: all checks passed" || echo "slurm end to end: FAILED"
exit $fail
