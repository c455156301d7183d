#!/usr/bin/env bash
# Installs shardcoord the ways a user would and checks each install works, away from the
# source tree (README, Install). Parts (default: all):
#   pip    `pip install --no-build-isolation .` into a fresh venv (with Debian's site packages,
#          for torch 1.13 and pytest), import from another folder, run the Python tests against
#          the installed package (no PYTHONPATH, no LD_LIBRARY_PATH); then `pip wheel` and the
#          wheel into a second venv without system packages: imports, no torch imported.
#   cmake  `cmake --install` of the build (DESTDIR): the Python package lands where that prefix's
#          python3 looks, and imports through its RPATH.
#   deb    scripts/package.sh, `apt-get install ./shardcoord_*.deb` (root), shardcoordd and
#          shardctl from /usr/bin serve and answer, Debian's python3 imports the package, the
#          README's C++ example (examples/cpp_worker) builds against the installed headers and
#          CMake package and runs two ranks that get identical decisions; then the package is
#          removed again.
#
#   scripts/package-test.sh [pip] [cmake] [deb]     (BUILD_DIR: a build with shardcoordd for the pip
#                                            part's tests, default build/)
# Prints "package test: all checks passed" when every check passed.
# shellcheck disable=SC2016,SC2034  # check's conditions are evaluated later (and use variables set for them)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${BUILD_DIR:-$root/build}" 2>/dev/null && pwd || echo "")
parts=("$@")
[[ ${#parts[@]} == 0 ]] && parts=(pip cmake deb)
work=$(mktemp -d /tmp/shardcoord-package.XXXXXX)
daemon_pid=""
deb_installed=0
# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
  [[ -n $daemon_pid ]] && kill "$daemon_pid" 2>/dev/null
  if [[ $deb_installed == 1 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq shardcoord >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }
wait_for() {  # wait_for SECONDS COMMAND...: polls, bounded.
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do ((SECONDS >= deadline)) && return 1; sleep 0.1; done
}
"$root/scripts/install-deps.sh" python

free_port() {  # a port free now (the kernel's pick)
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

part_pip() {
  echo "== pip install into a fresh venv"
  /usr/bin/python3 -m venv --system-site-packages "$work/venv"
  local py=$work/venv/bin/python
  # The source tree as a user has it: a copy without build folders, so nothing of this checkout's
  # builds is picked up (the CMake build dir of pip is kept in $work).
  mkdir -p "$work/src"
  (cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src")
  SHARDCOORD_BUILD_DIR=$work/build-pip "$py" -m pip install --no-build-isolation --no-index -q "$work/src" \
    >"$work/pip.log" 2>&1
  local rc=$?
  check "pip install --no-build-isolation . (rc $rc)" '[[ $rc == 0 ]]'
  [[ $rc == 0 ]] || { tail -30 "$work/pip.log"; return; }
  cd "$work" || return
  local where
  where=$(env -u PYTHONPATH -u LD_LIBRARY_PATH "$py" -c 'import shardcoord, sys; print(shardcoord.__file__)
assert "torch" not in sys.modules, "import shardcoord imported torch"' 2>&1)
  check "import shardcoord from another folder, no PYTHONPATH or LD_LIBRARY_PATH, torch not imported ($where)" \
    '[[ $where == "$work/venv/lib/python3"*"/site-packages/shardcoord/__init__.py" ]]'
  local version
  version=$("$py" -c 'import shardcoord; print(shardcoord.__version__)')
  check "the installed version is CMakeLists.txt's ($version)" \
    'grep -q "project(shardcoord VERSION $version " "$root/CMakeLists.txt"'
  local shown
  shown=$("$py" -m pip show shardcoord 2>/dev/null)
  check "pip show names it" '[[ $shown == *"Version: $version"* ]]'
  # The daemon and the CLI come with the package, on the venv's PATH, with its version.
  local daemon_version ctl_help
  daemon_version=$(env -u PYTHONPATH -u LD_LIBRARY_PATH "$work/venv/bin/shardcoordd" --version 2>&1)
  check "the venv's shardcoordd --version is the package's ($daemon_version)" '[[ $daemon_version == *"$version"* ]]'
  ctl_help=$(env -u PYTHONPATH -u LD_LIBRARY_PATH "$work/venv/bin/shardctl" --help 2>&1 | head -1)
  check "the venv's shardctl runs ($ctl_help)" '[[ -n $ctl_help && $ctl_help != *"has no shardctl"* ]]'
  # pip alone: a two-rank job with no daemon started by hand (rank 0 starts one for the job).
  local job_out
  job_out=$(cd "$work" && env -u PYTHONPATH -u LD_LIBRARY_PATH -u SHARDCOORD_ADDR PATH="$work/venv/bin:$PATH" \
    timeout 180 "$py" -m torch.distributed.run --nproc_per_node 2 --redirects 2 --tee 2 \
    --master_addr 127.0.0.1 --master_port "$(free_port)" "$root/examples/python/minimal_loop.py" 2>&1)
  check "pip alone: examples/python/minimal_loop.py at two ranks under torchrun, the daemon embedded" \
    '[[ $job_out == *"started an embedded shardcoordd"* && $(grep -o "final params hash [0-9a-f]*" <<<"$job_out" | wc -l) -ge 2 ]]'
  if [[ -n $build && -x $build/coordinator/shardcoordd ]]; then
    env -u PYTHONPATH SHARDCOORDD="$build/coordinator/shardcoordd" SHARDCTL="$build/client/shardctl" \
      timeout 600 "$py" -m pytest -q -p no:cacheprovider "$root/tests/python/test_binding.py" \
      "$root/tests/python/test_sampler.py" "$root/tests/python/test_hf.py" "$root/tests/python/test_torch.py" \
      >"$work/pytest.log" 2>&1
    rc=$?
    check "the Python tests pass against the installed package: $(tail -1 "$work/pytest.log")" '[[ $rc == 0 ]]'
    [[ $rc == 0 ]] || tail -30 "$work/pytest.log"
  else
    echo "package-test: no shardcoordd in '${BUILD_DIR:-build}': the Python tests are not run against the install"
    fail=1
  fi
  echo "== pip wheel, installed into a second venv without system packages"
  SHARDCOORD_BUILD_DIR=$work/build-pip "$py" -m pip wheel --no-build-isolation --no-index --no-deps -q \
    -w "$work/dist" "$work/src" >"$work/wheel.log" 2>&1
  rc=$?
  local whl wheels
  wheels=("$work"/dist/shardcoord-*.whl)
  whl=""
  [[ -f ${wheels[0]} ]] && whl=${wheels[0]}
  check "pip wheel made $(basename "${whl:-no wheel}") (rc $rc)" '[[ $rc == 0 && -n $whl ]]'
  [[ -n $whl ]] || { tail -30 "$work/wheel.log"; return; }
  /usr/bin/python3 -m venv "$work/venv2"
  "$work/venv2/bin/python" -m pip install --no-index -q "$whl" >"$work/wheel-install.log" 2>&1
  rc=$?
  check "the wheel installs into a venv without system packages (rc $rc)" '[[ $rc == 0 ]]'
  local out
  out=$(cd / && env -u PYTHONPATH -u LD_LIBRARY_PATH "$work/venv2/bin/python" -c '
import sys, shardcoord, shardcoord.sampler
assert "torch" not in sys.modules
print(shardcoord.__version__, len(shardcoord.BUILTIN_TOWER_NAMES))
try:
    import shardcoord.torch
except ImportError as e:
    print("no torch:", e)' 2>&1)
  check "the wheel's package imports without torch ($out)" '[[ $out == "$version "* ]]'
}

part_cmake() {
  echo "== cmake --install of the test build (prefix /usr/local), into a staging folder"
  [[ -n $build && -f $build/CMakeCache.txt ]] || { echo "package-test: no build in '${BUILD_DIR:-build}'"; fail=1; return; }
  local prefix site
  prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build/CMakeCache.txt")
  site=$(sed -n 's/^SHARDCOORD_PYTHON_INSTALL_DIR:STRING=//p' "$build/CMakeCache.txt")
  DESTDIR=$work/stage cmake --install "$build" >"$work/install.log" 2>&1
  local rc=$?
  check "cmake --install (rc $rc)" '[[ $rc == 0 ]]'
  local on_path
  on_path=$(/usr/bin/python3 -c 'import sys; print("\n".join(sys.path))')
  check "the package goes where ${prefix}'s python3 looks: $prefix/$site" \
    '[[ -f $work/stage$prefix/$site/shardcoord/__init__.py && $on_path == *"$prefix/$site"* ]]'
  local out
  out=$(cd / && env -u LD_LIBRARY_PATH PYTHONPATH="$work/stage$prefix/$site" /usr/bin/python3 -c \
    'import shardcoord; print(len(shardcoord.BUILTIN_TOWER_NAMES), shardcoord.__file__)' 2>&1)
  check "it imports and finds the installed worker library through its RPATH ($out)" \
    '[[ $out == *"$work/stage$prefix/$site/shardcoord/__init__.py" ]]'
}

part_deb() {
  echo "== the Debian package"
  [[ $(id -u) == 0 ]] || { echo "package-test: SKIP deb: apt-get install needs root"; return; }
  if dpkg-query -W -f='${Status}' shardcoord 2>/dev/null | grep -q "install ok installed"; then
    echo "package-test: shardcoord is already installed here: not touching it"; fail=1; return
  fi
  local deb
  deb=$("$root/scripts/package.sh" 2>"$work/package.log" | tail -1)
  check "scripts/package.sh made ${deb:-nothing}" '[[ -f $deb ]]'
  [[ -f $deb ]] || { tail -30 "$work/package.log"; return; }
  dpkg-deb -c "$deb" >"$work/contents"
  for f in usr/bin/shardcoordd usr/bin/shardctl usr/include/shardcoord/worker.h \
           usr/lib/x86_64-linux-gnu/cmake/shardcoord/shardcoordConfig.cmake usr/lib/systemd/system/shardcoordd.service \
           etc/shardcoord/shardcoordd.yaml usr/lib/python3/dist-packages/shardcoord/__init__.py; do
    check "the package holds /$f" 'grep -q " \./$f\$" "$work/contents"'
  done
  local depends
  depends=$(dpkg-deb -f "$deb" Depends)
  check "its dependencies come from dpkg-shlibdeps (${depends:0:80}...)" '[[ $depends == *libgrpc* ]]'
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >"$work/apt.log" 2>&1
  local rc=$?
  [[ $rc == 0 ]] && deb_installed=1
  check "apt-get install ./$(basename "$deb") (rc $rc)" '[[ $rc == 0 ]]'
  [[ $rc == 0 ]] || { tail -20 "$work/apt.log"; return; }
  local version
  version=$(/usr/bin/shardcoordd --version 2>&1)
  check "/usr/bin/shardcoordd --version: $version" '[[ $version == "shardcoordd $(dpkg-query -W -f="\${Version}" shardcoord)" ]]'
  check "the unit runs /usr/bin/shardcoordd with /etc/shardcoord/shardcoordd.yaml" \
    'grep -q "^ExecStart=/usr/bin/shardcoordd --config /etc/shardcoord/shardcoordd.yaml" /usr/lib/systemd/system/shardcoordd.service'
  if command -v systemd-analyze >/dev/null; then
    check "systemd-analyze verify the installed unit" 'systemd-analyze verify /usr/lib/systemd/system/shardcoordd.service >/dev/null 2>&1'
  fi
  /usr/bin/shardcoordd --listen 127.0.0.1:0 --address-file "$work/addr" >"$work/daemon.log" 2>&1 &
  daemon_pid=$!
  wait_for 20 grep -q : "$work/addr" 2>/dev/null
  local addr
  addr=$(cat "$work/addr" 2>/dev/null)
  check "the installed daemon serves (${addr:-no address})" '[[ -n $addr ]]'
  [[ -n $addr ]] || { tail -20 "$work/daemon.log"; return; }
  local status
  status=$(/usr/bin/shardctl --coordinator "$addr" status 2>&1)
  check "the installed shardctl reaches it" '[[ $status == *"version $(dpkg-query -W -f="\${Version}" shardcoord) "* ]]'
  local pyout
  pyout=$(cd / && env -u PYTHONPATH /usr/bin/python3 -c 'import shardcoord; print(shardcoord.__file__, shardcoord.__version__)' 2>&1)
  check "Debian's python3 imports the packaged shardcoord ($pyout)" '[[ $pyout == /usr/lib/python3/dist-packages/shardcoord/* ]]'
  cmake -S "$root/examples/cpp_worker" -B "$work/cpp_worker" -G Ninja >"$work/cpp.log" 2>&1 &&
    cmake --build "$work/cpp_worker" >>"$work/cpp.log" 2>&1
  rc=$?
  check "examples/cpp_worker builds against the installed headers and CMake package (rc $rc)" '[[ $rc == 0 ]]'
  [[ $rc == 0 ]] || { tail -20 "$work/cpp.log"; return; }
  local linked
  linked=$(ldd "$work/cpp_worker/cpp_worker")
  check "it links the installed library" \
    '[[ $linked =~ libshardcoord_worker\.so\.0\ =\>\ (/usr)?/lib/x86_64-linux-gnu/libshardcoord_worker\.so\.0 ]]'
  SHARDCOORD_ADDR=$addr timeout 60 "$work/cpp_worker/cpp_worker" 0 2 >"$work/rank0.out" 2>"$work/rank0.err" &
  local r0=$!
  SHARDCOORD_ADDR=$addr timeout 60 "$work/cpp_worker/cpp_worker" 1 2 >"$work/rank1.out" 2>"$work/rank1.err"
  local rc1=$?
  wait $r0
  local rc0=$?
  check "two ranks of it ran (rc $rc0 $rc1)" '[[ $rc0 == 0 && $rc1 == 0 ]]'
  check "they got identical decisions: $(grep "mb 1" "$work/rank0.out")" \
    '[[ $(grep -c "^rank 0 mb" "$work/rank0.out") == 4 ]] && diff <(sed "s/^rank 0//" "$work/rank0.out") <(sed "s/^rank 1//" "$work/rank1.out") >/dev/null'
  check "the divergent microbatch fell back to root, the uniform ones are per_layer" \
    'grep -q "mb 1 root" "$work/rank0.out" && grep -q "mb 0 per_layer" "$work/rank0.out" && grep -q "mb 3 skip" "$work/rank0.out"'
  kill "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null; daemon_pid=""
  # Enabled as `systemctl enable` does (a link in the target's wants; no systemd runs here): a
  # purge must leave no link to the removed unit.
  mkdir -p /etc/systemd/system/multi-user.target.wants
  ln -sf /usr/lib/systemd/system/shardcoordd.service /etc/systemd/system/multi-user.target.wants/shardcoordd.service
  local scripts
  scripts=$(dpkg-query --control-list shardcoord 2>/dev/null | tr '\n' ' ')
  check "the package has maintainer scripts for the unit ($scripts)" \
    '[[ $scripts == *postinst* && $scripts == *prerm* && $scripts == *postrm* ]]'
  DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq shardcoord >/dev/null 2>&1
  rc=$?
  check "apt-get remove shardcoord leaves no /usr/bin/shardcoordd (rc $rc)" '[[ $rc == 0 && ! -e /usr/bin/shardcoordd ]]'
  DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq shardcoord >/dev/null 2>&1
  rc=$?
  [[ $rc == 0 ]] && deb_installed=0
  check "apt-get purge shardcoord leaves no link to the unit (rc $rc)" \
    '[[ $rc == 0 && ! -L /etc/systemd/system/multi-user.target.wants/shardcoordd.service ]]'
}

for part in "${parts[@]}"; do
  case "$part" in
    pip) part_pip ;;
    cmake) part_cmake ;;
    deb) part_deb ;;
    *) echo "package-test: unknown part '$part' (pip, cmake, deb)"; exit 2 ;;
  esac
done
[[ $fail == 0 ]] && echo "package test: all checks passed" || echo "package test: FAILED"
exit $fail
