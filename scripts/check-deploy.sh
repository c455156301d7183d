#!/usr/bin/env bash
# Checks the deploy files against the binaries built here (a ctest test, deploy.check):
#   1. systemd: `systemd-analyze verify` on the unit (its ExecStart pointed at the build);
#   2. the config file, with the flags the unit adds (tokens, TLS), through `shardcoordd
#      --check-config` (every key known, every value in range, TLS files and token file usable);
#   3. Kubernetes: every document parses and has what the API requires of its kind; the
#      ConfigMap's embedded config and the Secrets' files pass --check-config as mounted;
#      `kubectl kustomize` renders them, where kubectl is installed;
#   4. Slurm: `bash -n` and shellcheck on the batch script (its end-to-end run needs a cluster:
#      see docs/DEPLOY.md);
#   5. with --container: the image built with podman from deploy/Containerfile (about 10 min: it
#      compiles shardcoord inside), its user and entrypoint checked and its shardcoordd run on
#      this host's libraries. No registry is reachable here: the base image is imported from a
#      debootstrap of bookworm (SHARDCOORD_ROOTFS, made if missing). podman cannot run
#      containers here (docs/DEPLOY.md).
# Test tokens and certificates are made with openssl in a temporary folder.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${BUILD_DIR:-$root/build}" && pwd)
daemon=$build/coordinator/shardcoordd
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
check() {  # check WHAT COMMAND...
  local what=$1
  shift
  if "$@" >"$work/out" 2>&1; then echo "PASS: $what"; else echo "FAIL: $what"; sed 's/^/    /' "$work/out"; fail=1; fi
}
skip() { echo "SKIP: $1"; }

(
  cd "$work" || exit 1
  umask 077
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key -out tls.crt -days 2 \
    -subj /CN=shardcoordd -addext subjectAltName=DNS:shardcoordd,IP:127.0.0.1
  cp tls.crt ca.crt
  printf 'rank %s\nread %s\n' "$(openssl rand -hex 16)" "$(openssl rand -hex 16)" > tokens
) >/dev/null 2>&1 || { echo "FAIL: cannot make test secrets with openssl"; exit 1; }

# 1. systemd
if command -v systemd-analyze >/dev/null; then
  sed "s|/usr/local/bin/shardcoordd|$daemon|" "$root/deploy/systemd/shardcoordd.service" >"$work/shardcoordd.service"
  check "systemd-analyze verify deploy/systemd/shardcoordd.service" systemd-analyze verify "$work/shardcoordd.service"
else
  skip "systemd-analyze not installed"
fi

# 2. the config file as the unit runs it (credentials in place of /etc/shardcoord/secrets)
check "deploy/config/shardcoordd.yaml with the unit's flags (--check-config)" \
  "$daemon" --config "$root/deploy/config/shardcoordd.yaml" --token-file "$work/tokens" \
  --tls-cert "$work/tls.crt" --tls-key "$work/tls.key" --check-config
check "the same config refuses to serve 0.0.0.0 without tokens and TLS" \
  bash -c "! '$daemon' --config '$root/deploy/config/shardcoordd.yaml' --check-config"

# 3. Kubernetes
check "deploy/kubernetes/shardcoordd.yaml: documents and required fields" /usr/bin/python3 - \
  "$root/deploy/kubernetes/shardcoordd.yaml" "$work" <<'PY'
import os, sys, yaml
path, work = sys.argv[1], sys.argv[2]
docs = [d for d in yaml.safe_load_all(open(path)) if d]
kinds = {d["kind"]: d for d in docs}
assert set(kinds) == {"ConfigMap", "Deployment", "Service"}, kinds.keys()
for d in docs:
    assert d["apiVersion"] and d["metadata"]["name"], d
dep = kinds["Deployment"]["spec"]
pod = dep["template"]["spec"]
assert dep["replicas"] == 1 and dep["strategy"]["type"] == "Recreate"
assert dep["selector"]["matchLabels"].items() <= dep["template"]["metadata"]["labels"].items()
c = pod["containers"][0]
volumes = {v["name"]: v for v in pod["volumes"]}
mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
for m in c["volumeMounts"]:
    assert m["name"] in volumes, m
svc = kinds["Service"]["spec"]
assert svc["selector"].items() <= dep["template"]["metadata"]["labels"].items()
ports = {p["name"] for p in c["ports"]}
for p in svc["ports"]:
    assert p["targetPort"] in ports, p
# The daemon's args, with the mounted files mapped to the test secrets.
files = {"/etc/shardcoord/shardcoordd.yaml": os.path.join(work, "k8s.yaml"),
         "/var/run/shardcoord/tokens": os.path.join(work, "tokens"),
         "/var/run/shardcoord-tls/tls.crt": os.path.join(work, "tls.crt"),
         "/var/run/shardcoord-tls/tls.key": os.path.join(work, "tls.key")}
open(files["/etc/shardcoord/shardcoordd.yaml"], "w").write(kinds["ConfigMap"]["data"]["shardcoordd.yaml"])
for arg in c["args"]:
    if arg.startswith("/"):
        assert os.path.dirname(arg) in mounts or arg in files, "not mounted: " + arg
open(os.path.join(work, "k8s-args"), "w").write("\n".join(files.get(a, a) for a in c["args"]))
PY
if [[ -s "$work/k8s-args" ]]; then
  mapfile -t args <"$work/k8s-args"
  check "the Kubernetes ConfigMap and Secrets as mounted (--check-config)" "$daemon" "${args[@]}" --check-config
fi

# kubectl, where installed (Debian: kubernetes-client), parses and renders them offline; apply
# --dry-run=client would need an API server.
if command -v kubectl >/dev/null; then
  mkdir -p "$work/kustomize"
  cp "$root/deploy/kubernetes/shardcoordd.yaml" "$work/kustomize/"
  printf 'resources:\n- shardcoordd.yaml\n' >"$work/kustomize/kustomization.yaml"
  check "kubectl kustomize parses and renders the manifests" kubectl kustomize "$work/kustomize"
else
  skip "kubectl not installed (Debian: kubernetes-client)"
fi

# 4. Slurm
check "bash -n deploy/slurm/train.sbatch" bash -n "$root/deploy/slurm/train.sbatch"
if command -v shellcheck >/dev/null; then
  check "shellcheck deploy/slurm/train.sbatch" shellcheck "$root/deploy/slurm/train.sbatch"
else
  skip "shellcheck not installed"
fi

# 5. The container
# shellcheck disable=SC2317  # called through check
container() {
  local rootfs=${SHARDCOORD_ROOTFS:-/var/tmp/bookworm-root} base=localhost/debian:bookworm
  if ! podman image exists "$base"; then
    [[ -x $rootfs/bin/bash ]] || debootstrap --variant=minbase bookworm "$rootfs" >/dev/null || return 1
    tar -C "$rootfs" -c . | podman import - "$base" >/dev/null || return 1
  fi
  podman build -q --isolation chroot --network host --build-arg BASE="$base" --build-arg RUNTIME_BASE="$base" \
    -t localhost/shardcoord:check -f "$root/deploy/Containerfile" "$root" || return 1
  local user entry id
  user=$(podman image inspect -f '{{.Config.User}}' localhost/shardcoord:check)
  entry=$(podman image inspect -f '{{.Config.Entrypoint}}' localhost/shardcoord:check)
  [[ $user == 10001:10001 ]] || { echo "image user is '$user', not 10001:10001"; return 1; }
  [[ $entry == *shardcoordd*--listen* ]] || { echo "entrypoint is '$entry'"; return 1; }
  id=$(podman create localhost/shardcoord:check) && podman cp "$id:/opt/shardcoord/bin/shardcoordd" "$work/" &&
    podman rm "$id" >/dev/null || return 1
  "$work/shardcoordd" --listen 127.0.0.1:0 --check-config
}
if [[ "${1:-}" == --container ]]; then
  if command -v podman >/dev/null && command -v debootstrap >/dev/null; then
    check "podman build deploy/Containerfile (user, entrypoint, its shardcoordd runs)" container
  else
    echo "FAIL: --container needs podman and debootstrap (apt-get install podman debootstrap)"
    fail=1
  fi
else
  skip "the container image: scripts/check-deploy.sh --container builds it (about 10 min)"
fi

[[ $fail == 0 ]] && echo "deploy files: all checks passed" || echo "deploy files: FAILED"
exit $fail
