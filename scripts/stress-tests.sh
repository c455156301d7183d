#!/usr/bin/env bash
# Runs the whole test suite many times in a row from a clean clone, to catch tests that fail
# at random (timing, load, ports). Optionally with a CPU hog on every core beside it.
#
#   scripts/stress-tests.sh [--runs N] [--hog] [--keep] [--source DIR] [-- CTEST_ARGS...]
#
# --runs N     how many consecutive runs of ctest (default 20)
# --hog        keep every core busy (one busy loop per core) during the runs
# --keep       keep the clone and the logs (default: logs are kept, the clone is removed)
# --source DIR the repository to clone (default: this checkout; its committed HEAD is used)
#
# The clone is built once (scripts/build.sh: installs what is missing, uses ccache), then
# ctest runs N times. Each run's output goes to $LOGDIR/run-K.log (default a fresh
# directory under /tmp, printed at the start). Prints one line per run and a summary, and
# exits 1 if any run failed.
set -euo pipefail
runs=20 hog=0 keep=0
src=$(cd "$(dirname "$0")/.." && pwd)
ctest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --hog) hog=1; shift ;;
    --keep) keep=1; shift ;;
    --source) src=$2; shift 2 ;;
    --) shift; ctest_args=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "stress-tests: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "stress-tests: --runs must be a positive integer, got '$runs'" >&2; exit 2; }

logdir=${LOGDIR:-$(mktemp -d /tmp/shardcoord-stress.XXXXXX)}
mkdir -p "$logdir"
clone=$(mktemp -d /tmp/shardcoord-clone.XXXXXX)
hog_pids=()
cleanup() {
  for p in "${hog_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [[ $keep -eq 0 ]]; then rm -rf "$clone"; fi
}
trap cleanup EXIT

echo "stress-tests: logs in $logdir; cloning $src ($(git -C "$src" rev-parse --short HEAD)) into $clone"
git clone -q "$src" "$clone"
echo "stress-tests: building (log: $logdir/build.log)"
if ! (cd "$clone" && scripts/build.sh >"$logdir/build.log" 2>&1); then
  echo "stress-tests: build failed; see $logdir/build.log" >&2
  exit 1
fi

if [[ $hog -eq 1 ]]; then
  for ((c = 0; c < $(nproc); c++)); do
    (while :; do :; done) &
    hog_pids+=($!)
  done
  echo "stress-tests: CPU hog on $(nproc) cores (pids ${hog_pids[*]})"
fi

failed=0
for ((k = 1; k <= runs; k++)); do
  start=$(date +%s)
  if (cd "$clone/build" && ctest --output-on-failure --timeout 600 -j "$(nproc)" "${ctest_args[@]}") \
       >"$logdir/run-$k.log" 2>&1; then
    result=pass
  else
    result=FAIL
    failed=$((failed + 1))
  fi
  summary=$(grep -E 'tests passed|tests failed' "$logdir/run-$k.log" | tail -n 1)
  echo "run $k/$runs: $result in $(( $(date +%s) - start )) s: $summary"
  if [[ $result == FAIL ]]; then
    grep -E '^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess aborted|Exception)' "$logdir/run-$k.log" | sed 's/^/    /' || true
  fi
done
echo "stress-tests: $((runs - failed)) passed, $failed failed (runs of the whole suite$([[ $hog -eq 1 ]] && echo ', CPU hog on every core'))"
[[ $failed -eq 0 ]]
