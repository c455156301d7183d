#!/usr/bin/env bash
# Runs the libFuzzer targets of fuzz/ (built with ASan and UBSan by scripts/clang-build.sh).
#
#   scripts/fuzz.sh                      # every target, 300 s each (the long run)
#   scripts/fuzz.sh --seconds 20         # every target, 20 s each (what CI runs)
#   scripts/fuzz.sh --seconds 600 core   # one target
#
# Targets: core (CoordinatorCore's message handling, with the one-decision check), trace,
# manifest, cost (`shardctl plan`'s cost model file), config (YAML config and token file).
# Each keeps its corpus in build-clang/fuzz-corpus/TARGET across runs and starts from the
# seeds in fuzz/seeds/ and examples/. A crash, leak, sanitizer report or broken contract stops that target, leaves the
# input in build-clang/fuzz-findings/ and makes the script exit 1; reproduce it with
#   build-clang/fuzz/TARGET_fuzz build-clang/fuzz-findings/FILE
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CLANG_BUILD_DIR:-$root/build-clang}
seconds=300
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    core|trace|manifest|cost|config) targets+=("$1"); shift ;;
    *) echo "fuzz.sh: unknown argument '$1' (targets: core trace manifest cost config; --seconds N)" >&2; exit 2 ;;
  esac
done
[[ ${#targets[@]} -eq 0 ]] && targets=(core trace manifest cost config)
"$root/scripts/clang-build.sh" >/dev/null

declare -A seeds=(
  [core]=""
  [trace]="$root/examples/traces $root/fuzz/seeds/trace"
  [manifest]="$root/fuzz/seeds/manifest"
  [cost]="$root/fuzz/seeds/cost"
  [config]="$root/fuzz/seeds/config"
)
mkdir -p "$build/fuzz-findings"
rc=0
for t in "${targets[@]}"; do
  corpus="$build/fuzz-corpus/$t"
  mkdir -p "$corpus"
  log="$build/fuzz-findings/$t.log"
  echo "fuzz: $t for ${seconds}s (corpus $corpus, log $log)"
  # shellcheck disable=SC2086  # seeds[$t] is empty or folders without spaces
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp" \
      "$build/fuzz/${t}_fuzz" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$build/fuzz-findings/$t-" "$corpus" ${seeds[$t]} >"$log" 2>&1; then
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$log" | tr '\n' ' '
    echo "corpus $(find "$corpus" -type f | wc -l) inputs: clean"
  else
    echo "fuzz: $t FAILED; the end of $log:" >&2
    tail -40 "$log" >&2
    rc=1
  fi
done
exit $rc
