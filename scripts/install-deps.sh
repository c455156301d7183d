#!/usr/bin/env bash
# Installs the Debian 12 packages shardcoord needs to build and test, only those missing.
# Runs apt-get as root (or through sudo). Idempotent; safe to call before every build.
set -euo pipefail

packages=(
  cmake ninja-build g++ clang pkg-config ccache openssl libssl-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libcpp-httplib-dev prometheus-cpp-dev
  libsqlite3-dev chromium slurm-wlm munge
  libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev libtorch-dev
  python3-dev pybind11-dev python3-torch python3-pytest python3-numpy
)
if [[ "${SHARDCOORD_WITH_TORCH:-0}" == 1 ]]; then packages+=(libtorch-dev); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to apt-get install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
