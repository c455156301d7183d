#!/usr/bin/env bash
# The Slurm deploy script (deploy/slurm/train.sbatch), end to end, on a one-node Slurm cluster
# this script starts: munged, slurmctld and slurmd (Debian's slurm-wlm and munge, installed if
# missing; as root), all state in a temporary folder. The shipped batch script is submitted
# unchanged (sbatch options on the command line: one node, no GPU); it starts shardcoordd with
# its per-job token and CA, waits for it, and runs the trainer given as SHARDCOORD_TRAINER in
# every task, with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE exported from Slurm's variables:
#   1. a task that prints those variables (3 tasks): each RANK is its SLURM_PROCID;
#   2. the example trainer (examples/vlm_trainer, LibTorch on CPU, Gloo) as 4 tasks in 2 shard
#      groups, its --rank and --world-size taken from $RANK and $WORLD_SIZE: the job exits 0,
#      ranks 0-3 printed their summary, all end with the same parameters, the coordinator served
#      TLS with tokens, and its secrets were removed;
#   3. the Python example trainer as 2 tasks with no rank flags (shardcoord.Worker reads RANK).
# The node is declared with 8 CPUs (config_overrides) so that 4 trainer tasks and the
# coordinator fit.
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

free_port() {  # a port free now (the kernel's pick): Slurm's own ports, the trainers' MASTER_PORT
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
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
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
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

# The batch script as shipped; shardcoordd and shardctl from the build, in one folder as installed.
cd "$work" || exit 1
mkdir -p "$work/bin" && ln -s "$build/coordinator/shardcoordd" "$build/client/shardctl" "$work/bin/"
submit() {  # submit OUT TASKS TRAINER: the shipped script on one node without GPUs; sbatch's exit code
  # Port 0: the coordinator binds a free port itself and the script reads it back (no port picked
  # here and used later, which another test on a busy machine could take in between).
  SHARDCOORD_BIN_DIR="$work/bin" SHARDCOORD_TRAINER="$3" SHARDCOORD_PORT=0 MASTER_PORT=$(free_port) \
    timeout 300 sbatch --wait -N1 --ntasks-per-node="$2" --gpus-per-node=0 --time=10 -o "$work/$1" \
    "$root/deploy/slurm/train.sbatch"
}
fail=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }
show() {  # show OUT: on failure, the job's output and its coordinator's log
  [[ $fail == 0 ]] && return
  echo "--- $1"; tail -40 "$work/$1"
  echo "--- coordinator logs"; tail -20 "$work"/*shardcoordd.log 2>/dev/null
}

# 1. What each task gets (single quotes: each task's bash expands them).
submit job-env.out 3 'echo "task procid=$SLURM_PROCID rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK local_world=$LOCAL_WORLD_SIZE"'
rc=$?
check "env: the batch job exited 0 (sbatch rc $rc)" '[[ $rc == 0 ]]'
check "env: each task's RANK and LOCAL_RANK are its SLURM_PROCID; WORLD_SIZE and LOCAL_WORLD_SIZE 3" \
  '[[ $(grep -cE "^task procid=([0-2]) rank=\1 world=3 local=\1 local_world=3$" "$work/job-env.out") == 3 &&
     $(grep -oE "^task procid=[0-9]+" "$work/job-env.out" | sort -u | wc -l) == 3 ]]'
show job-env.out

# 2. The LibTorch example trainer, its rank flags from the variables the script exports.
submit job.out 4 "$build/examples/vlm_trainer/vlm_trainer --steps 3 --accum 2 --policy auto --media mixed \
--group-size 2 --job \"slurm-\$SLURM_JOB_ID\" --rank \"\$RANK\" --world-size \"\$WORLD_SIZE\""
rc=$?
check "the batch job exited 0 (sbatch rc $rc)" '[[ $rc == 0 ]]'
check "shardcoordd came up with TLS and tokens" 'grep -q "shardcoordd ready at" "$work/job.out"'
check "ranks 0-3 (from \$RANK) printed their summary" \
  '[[ $(grep -oE "^summary rank [0-3]\b" "$work/job.out" | sort -u | wc -l) == 4 ]]'
check "every rank ends with the same parameters" '[[ $(grep "^final" "$work/job.out" | awk "{print \$4}" | sort -u | wc -l) == 1 ]]'
check "the coordinator served TLS with tokens" 'grep -q "tls=on tokens=on" "$work"/*shardcoordd.log'
check "the per-job token and CA were removed" '! ls "$work"/.shardcoord-* >/dev/null 2>&1'
show job.out

# 3. A Python trainer under the same batch script: examples/python/vlm_train.py as 2 srun tasks with
# no rank flags (shardcoord.launcher_rank reads the RANK and WORLD_SIZE the script exports; torch's
# env:// rendezvous the MASTER_ADDR/MASTER_PORT it exports). Needs the build's Python package.
if [[ -f $build/python/shardcoord/__init__.py ]]; then
  submit job-py.out 2 "env PYTHONPATH=$build/python /usr/bin/python3 $root/examples/python/vlm_train.py \
--job slurm-py --steps 2 --accum 2 --media mixed --group-size 2"
  rc=$?
  check "python: the batch job exited 0 (sbatch rc $rc)" '[[ $rc == 0 ]]'
  check "python: ranks 0 and 1 (from \$RANK) printed their summary" \
    '[[ $(grep -oE "^summary rank [0-9]+" "$work/job-py.out" | sort -u | wc -l) == 2 ]]'
  check "python: both ranks end with the same parameters" \
    '[[ $(grep "^final params hash" "$work/job-py.out" | sort -u | wc -l) == 1 ]]'
  show job-py.out
else
  echo "slurm-e2e: no Python package in $build/python: the Python trainer job is not run"
fi
[[ $fail == 0 ]] && echo "slurm end to end: all checks passed" || echo "slurm end to end: FAILED"
exit $fail
