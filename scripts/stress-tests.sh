#!/usr/bin/env bash
# Runs the whole test suite many times in a row from a clean clone, to catch tests that fail
# at random (timing, load, ports). Optionally with a CPU hog on every core beside it.
#
#   scripts/stress-tests.sh [--runs N] [--hog-runs M | --hog] [--keep] [--source DIR] [-- CTEST_ARGS...]
#
# --runs N     how many consecutive runs of ctest (default 20)
# --hog-runs M then M more runs with every core kept busy (one busy loop per core) beside them
# --hog        every run with the CPU hog (same as --runs 0 --hog-runs N)
# --keep       keep the clone and the logs (default: logs are kept, the clone is removed)
# --source DIR the repository to clone (default: this checkout; its committed HEAD is used)
#
# The clone is built once (scripts/build.sh: installs what is missing, uses ccache), then
# ctest runs N times. Each run's output goes to $LOGDIR/run-K.log (default a fresh
# directory under /tmp, printed at the start). Prints one line per run and a summary, and
# exits 1 if any run failed.
set -euo pipefail
runs=20 hog_runs=0 keep=0
src=$(cd "$(dirname "$0")/.." && pwd)
ctest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --hog-runs) hog_runs=$2; shift 2 ;;
    --hog) hog_runs=$runs; runs=0; shift ;;
    --keep) keep=1; shift ;;
    --source) src=$2; shift 2 ;;
    --) shift; ctest_args=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "stress-tests: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
[[ "$runs" =~ ^[0-9]+$ && "$hog_runs" =~ ^[0-9]+$ && $((runs + hog_runs)) -gt 0 ]] ||
  { echo "stress-tests: --runs and --hog-runs take integers >= 0, at least one run in all" >&2; exit 2; }

logdir=${LOGDIR:-$(mktemp -d /tmp/shardcoord-stress.XXXXXX)}
mkdir -p "$logdir"
clone=$(mktemp -d /tmp/shardcoord-clone.XXXXXX)
hog_pids=()
cleanup() {
  for p in "${hog_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [[ $keep -eq 0 ]]; then rm -rf "$clone"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "stress-tests: logs in $logdir; cloning $src ($(git -C "$src" rev-parse --short HEAD)) into $clone"
git clone -q "$src" "$clone"
echo "stress-tests: building (log: $logdir/build.log)"
if ! (cd "$clone" && scripts/build.sh >"$logdir/build.log" 2>&1); then
  echo "stress-tests: build failed; see $logdir/build.log" >&2
  exit 1
fi

start_hog() {
  for ((c = 0; c < $(nproc); c++)); do
    (while :; do :; done) &
    hog_pids+=($!)
  done
  echo "stress-tests: CPU hog on $(nproc) cores (pids ${hog_pids[*]})"
}

total=$((runs + hog_runs))
failed=0 failed_hog=0
for ((k = 1; k <= total; k++)); do
  if [[ $k -eq $((runs + 1)) ]]; then start_hog; fi
  start=$(date +%s)
  if (cd "$clone/build" && ctest --output-on-failure --timeout 600 -j "$(nproc)" "${ctest_args[@]}") \
       >"$logdir/run-$k.log" 2>&1; then
    result=pass
  else
    result=FAIL
    if [[ $k -gt $runs ]]; then failed_hog=$((failed_hog + 1)); else failed=$((failed + 1)); fi
  fi
  summary=$(grep -E 'tests passed|tests failed' "$logdir/run-$k.log" | tail -n 1)
  echo "run $k/$total$([[ $k -gt $runs ]] && echo ' (CPU hog)'): $result in $(( $(date +%s) - start )) s: $summary"
  if [[ $result == FAIL ]]; then
    grep -E '^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess aborted|Exception)' "$logdir/run-$k.log" | sed 's/^/    /' || true
  fi
done
echo "stress-tests: without hog: $((runs - failed)) passed, $failed failed; with CPU hog: $((hog_runs - failed_hog)) passed, $failed_hog failed"
echo "$((total - failed - failed_hog)) passed, $((failed + failed_hog)) failed"
[[ $((failed + failed_hog)) -eq 0 ]]
