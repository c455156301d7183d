#!/usr/bin/env bash
# Installs the Debian 12 packages a shardcoord command needs, only those missing.
#
#   scripts/install-deps.sh [build|demo|python|package|test|clang|deploy|all]...   (default: build)
#
#   build   compile the daemon, the CLI, the worker library, the LibTorch executor, the
#           example trainer, the tests and benchmarks (what scripts/build.sh needs)
#   demo    build, nothing more: scripts/demo.sh installs no browser, Python or Slurm
#   python  the Python package and its tests (python3-dev, pybind11, python3-torch, pytest), and
#           `pip install --no-build-isolation .` (setuptools, wheel, venv)
#   package python + dpkg-dev: scripts/package.sh (cpack's .deb, dependencies by dpkg-shlibdeps)
#   test    build + python + what the suite drives: Chromium (the status page), Slurm and
#           munge (the Slurm end to end test), Prometheus (the metrics test), clang
#           (scripts/clang-build.sh), shellcheck
#   clang   the clang build: lock analysis, ASan+UBSan, libFuzzer
#   deploy  scripts/check-deploy.sh: shellcheck (systemd-analyze is used where systemd is installed)
#
# Runs apt-get as root (or through sudo). Idempotent; safe to call before every build.
set -euo pipefail

build=(
  cmake ninja-build g++ pkg-config ccache openssl libssl-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libcpp-httplib-dev prometheus-cpp-dev
  libsqlite3-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev libtorch-dev libboost-dev
)
python=(python3-dev pybind11-dev python3-torch python3-pytest python3-numpy python3-venv python3-pip python3-setuptools
        python3-wheel)
package=(dpkg-dev)
clang=(clang libclang-rt-14-dev)
deploy=(shellcheck)
test=("${build[@]}" "${python[@]}" "${package[@]}" "${clang[@]}" "${deploy[@]}" chromium slurm-wlm munge prometheus)

packages=()
[[ $# -eq 0 ]] && set -- build
for profile in "$@"; do
  case "$profile" in
    build|demo) packages+=("${build[@]}") ;;
    python) packages+=("${build[@]}" "${python[@]}") ;;
    package) packages+=("${build[@]}" "${python[@]}" "${package[@]}") ;;
    clang) packages+=("${build[@]}" "${clang[@]}") ;;
    deploy) packages+=("${deploy[@]}") ;;
    test|all) packages+=("${test[@]}") ;;
    *) echo "install-deps: unknown profile '$profile'; use build, demo, python, package, test, clang, deploy or all" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi
# One entry per package, in the order first asked for.
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | awk '!seen[$0]++')

echo "install-deps ($*): installing ${missing[*]}" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to apt-get install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
