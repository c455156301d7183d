#!/usr/bin/env bash
# Starts a daemon from every shipped deploy file and proves that it serves (a ctest test,
# deploy.check). Each start is laid out as the deploy file describes it, under a temporary
# folder standing for /, with test secrets at the documented paths:
#   1. deploy/config/shardcoordd.yaml, its secret, journal and state paths given as flags;
#      --check-config refuses it (exit 2) where the secrets are missing, a port is taken or the
#      journal's folder does not exist, and a real start agrees;
#   2. systemd: `systemd-analyze verify` on the unit, then its ExecStart, with the credentials
#      its LoadCredential= lines hand over and its StateDirectory;
#   3. the Containerfile's ENTRYPOINT and CMD, with the config its COPY installs, the secrets
#      mounted at /etc/shardcoord/secrets and its VOLUME;
#   4. Kubernetes: the manifests' structure (selectors, ports, volumes, the PodDisruptionBudget,
#      NetworkPolicy, PriorityClass, ServiceMonitor, scrape annotations, the memory sizing), then
#      the Deployment's command and args with the ConfigMap and Secrets as its projected volume
#      lays them out, the claim and /tmp, and its readiness and liveness probes; `kubectl
#      kustomize` renders deploy/kubernetes (and with servicemonitor.yaml), where installed;
#   5. Slurm: `bash -n` and shellcheck (the end-to-end run: scripts/slurm-e2e.sh);
#   6. the environment variables: SHARDCOORD_DAEMON_TOKEN_FILE, and the old SHARDCOORDD_TOKEN_FILE
#      with its deprecation line;
#   7. with --container: the image built with podman from deploy/Containerfile (about 10 min: it
#      compiles shardcoord inside), its user, entrypoint and command checked, and its own
#      shardcoordd started from its ENTRYPOINT and CMD in the image's file system (chroot, as user
#      10001): podman cannot run containers here (docs/DEPLOY.md). No registry is reachable here:
#      the base image is imported from a debootstrap of bookworm (SHARDCOORD_ROOTFS, made if missing).
# "Serves" means: --check-config says OK, then the real start (listeners moved to 127.0.0.1:0)
# writes its bound addresses, /healthz answers over HTTPS (the test CA), /metrics refuses a
# request without a token and answers the read token, `shardctl status` answers with the read
# token, the journal and the resume key exist where the file put them, the log says
# `tls=on tokens=on` and names no deprecated flag or variable, and SIGTERM stops it with exit
# code 0. As root the daemon runs as the deploy files' user 10001 (setpriv), so the secrets'
# owners and modes are tested too.
# shellcheck disable=SC2317  # (whole file) most functions run through `check "$@"`
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${BUILD_DIR:-$root/build}" && pwd)
daemon=$build/coordinator/shardcoordd
shardctl=$build/client/shardctl
work=$(mktemp -d)
chmod 755 "$work"  # the daemon's user must reach the laid-out folders
# ... and the daemon and the shipped config, which it cannot reach in a checkout cloned into a
# private folder (root's home, a mktemp -d: mode 0700): copies of both, where it can.
mkdir "$work/bin" && install -m 755 "$build/coordinator/shardcoordd" "$work/bin/shardcoordd"
daemon=$work/bin/shardcoordd
cleanup() {
  local pid
  if [[ -f $work/pids ]]; then
    while read -r pid; do kill -KILL "$pid" 2>/dev/null; done <"$work/pids"
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail=0
check() {  # check WHAT COMMAND...
  local what=$1
  shift
  if "$@" >"$work/out" 2>&1; then echo "PASS: $what"; else echo "FAIL: $what"; sed 's/^/    /' "$work/out"; fail=1; fi
}
skip() { echo "SKIP: $1"; }

as_daemon=()  # how the daemon runs: as the user 10001 of the deploy files, where this script is root
uid=
if [[ $(id -u) == 0 ]] && command -v setpriv >/dev/null; then
  uid=10001
  as_daemon=(setpriv --reuid="$uid" --regid="$uid" --clear-groups --inh-caps=-all)
fi

# Test secrets: a CA, the daemon's certificate (naming shardcoordd, localhost and 127.0.0.1)
# signed by it, and tokens with roles (the files the documented `kubectl create secret` makes).
secrets=$work/secrets
mkdir -m 700 "$secrets"
(
  cd "$secrets" || exit 1
  umask 077
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.crt -days 2 \
    -subj /CN=shardcoord-test-ca &&
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key -out tls.csr -subj /CN=shardcoordd &&
  printf 'subjectAltName=DNS:shardcoordd,DNS:localhost,IP:127.0.0.1\n' >san.ext &&
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 2 -extfile san.ext &&
  openssl rand -hex 16 >rank-token && openssl rand -hex 16 >read-token &&
  printf 'rank %s\nread %s\n' "$(cat rank-token)" "$(cat read-token)" >tokens
) >/dev/null 2>&1 || { echo "FAIL: cannot make test secrets with openssl"; exit 1; }
chmod 644 "$secrets/ca.crt"
read_token=$(<"$secrets/read-token")

# --- How a start is proven -----------------------------------------------------------------

# own PATH...: owned by the daemon's user (where this script is root).
own() { [[ -z $uid ]] || chown "$uid:$uid" "$@"; }

# wait_serving PID RUN: until the daemon wrote both bound addresses (30 s at most), or it exited.
wait_serving() {
  local deadline=$((SECONDS + 30))
  until [[ -s $2/grpc.addr && -s $2/http.addr ]]; do
    if ! kill -0 "$1" 2>/dev/null; then echo "shardcoordd exited before serving:"; cat "$2/log"; return 1; fi
    if ((SECONDS >= deadline)); then echo "shardcoordd not serving after 30 s:"; cat "$2/log"; return 1; fi
    sleep 0.1
  done
}

# stop PID RUN: SIGTERM; the daemon must exit with code 0 within 15 s.
stop() {
  kill -TERM "$1" 2>/dev/null
  local deadline=$((SECONDS + 15)) rc
  while kill -0 "$1" 2>/dev/null; do
    if ((SECONDS >= deadline)); then echo "still running 15 s after SIGTERM"; kill -KILL "$1"; return 1; fi
    sleep 0.1
  done
  wait "$1"
  rc=$?
  [[ $rc == 0 ]] || { echo "exit code $rc after SIGTERM:"; tail -5 "$2/log"; return 1; }
}

# prove RUN STATE: what a serving daemon answers, and the journal and resume key in STATE.
prove() {
  local grpc http out code
  grpc=$(<"$1/grpc.addr")
  http=$(<"$1/http.addr")
  out=$(curl -sS --max-time 10 --cacert "$secrets/ca.crt" "https://$http/healthz" 2>&1)
  [[ $out == ok* ]] || { echo "GET https://$http/healthz: $out"; return 1; }
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 --cacert "$secrets/ca.crt" "https://$http/metrics")
  [[ $code == 401 ]] || { echo "GET /metrics without a token answered $code, not 401"; return 1; }
  if ! curl -sS --max-time 10 --cacert "$secrets/ca.crt" -H "Authorization: Bearer $read_token" \
    "https://$http/metrics" >"$1/metrics" 2>&1 || ! grep -q '^shardcoord_' "$1/metrics"; then
    echo "GET /metrics with the read token:"; head -5 "$1/metrics"; return 1
  fi
  SHARDCOORD_TOKEN=$read_token "$shardctl" --coordinator "$grpc" --tls-ca "$secrets/ca.crt" status >"$1/status" 2>&1 ||
    { echo "shardctl status:"; cat "$1/status"; return 1; }
  [[ -s $2/events.db ]] || { echo "no journal at $2/events.db"; return 1; }
  [[ -s $2/state.key ]] || { echo "no resume key at $2/state.key"; return 1; }
  grep -q "tls=on tokens=on" "$1/log" || { echo "the log does not say tls=on tokens=on:"; cat "$1/log"; return 1; }
  # A deploy file with a flag or variable renamed since (--tls-cert) still starts; it must not.
  if grep "is deprecated" "$1/log"; then echo "the deploy file uses a deprecated name (above)"; return 1; fi
  if [[ -n $uid && $(stat -c %u "$2/events.db") != "$uid" ]]; then
    echo "the journal is not the user $uid's: the daemon did not run as the deploy files' user"; return 1
  fi
  echo "served gRPC on $grpc and HTTPS on $http"
}

# serves FS ARGV...: starts ARGV, a daemon command line laid out under FS (FS/tmp its TMPDIR,
# FS/var/lib/shardcoord its state), with its listeners on 127.0.0.1:0, and proves that it
# serves. Leaves the daemon's pid in FS/check/pid while it runs (for `during`).
serves() {
  local fs=$1 pid
  shift
  local run=$fs/check
  mkdir -p "$run" && own "$run"
  local moved=(--listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --address-file "$run/grpc.addr"
    --http-address-file "$run/http.addr")
  if ! TMPDIR=$fs/tmp "${as_daemon[@]}" "$@" "${moved[@]}" --check-config >"$run/check-config" 2>&1; then
    echo "--check-config refused what the deploy file starts (with ${moved[*]} added):"
    cat "$run/check-config"
    return 1
  fi
  TMPDIR=$fs/tmp "${as_daemon[@]}" "$@" "${moved[@]}" >"$run/log" 2>&1 &
  pid=$!
  echo "$pid" >>"$work/pids"
  if ! wait_serving "$pid" "$run" || ! prove "$run" "$fs/var/lib/shardcoord" || ! ${during:-true} "$run"; then
    kill -KILL "$pid" 2>/dev/null
    return 1
  fi
  stop "$pid" "$run"
}

# The layouts: a Python helper reads each deploy file and lays out what it describes.
cat >"$work/layout.py" <<'PY'
"""Lays out under FS what a deploy file describes, and writes the daemon's command line to
FS/argv (one argument a line). Usage: layout.py KIND FS DAEMON SECRETS UID ARGS..."""
import json, os, re, shlex, shutil, sys
import yaml

PATH_KEYS = ("token_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file", "journal_file",
             "state_file", "address_file")
BINARIES = ("/usr/local/bin/shardcoordd", "/opt/shardcoord/bin/shardcoordd")


def fail(message):
    sys.exit(message)


class Layout:
    def __init__(self, fs, daemon, secrets, uid):
        self.fs, self.daemon, self.secrets = fs, daemon, secrets
        self.uid = int(uid) if uid else None

    def path(self, p):
        return self.fs + p

    def secret(self, name):
        return open(os.path.join(self.secrets, name)).read()

    def owner(self, full, user, group):
        if self.uid is not None:
            os.chown(full, self.uid if user else 0, self.uid if group else 0)

    def mkdir(self, p, mode, user=False, group=False):
        full = self.path(p)
        os.makedirs(full, exist_ok=True)
        os.chmod(full, mode)
        self.owner(full, user, group)

    def put(self, p, data, mode, user=False, group=False):
        full = self.path(p)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(data)
        os.chmod(full, mode)
        self.owner(full, user, group)

    def config(self, text):
        """The config with its absolute paths under FS (what the daemon sees at those paths)."""
        cfg = yaml.safe_load(text) or {}
        for k in PATH_KEYS:
            if isinstance(cfg.get(k), str) and cfg[k].startswith("/"):
                cfg[k] = self.path(cfg[k])
        return yaml.safe_dump(cfg)

    def write_argv(self, args):
        out = [self.daemon if a in BINARIES else self.path(a) if a.startswith("/") else a for a in args]
        if out[0] != self.daemon:
            fail(f"the command starts {args[0]}, not shardcoordd at {' or '.join(BINARIES)}")
        with open(os.path.join(self.fs, "argv"), "w") as f:
            f.write("\n".join(out[1:]) + "\n")
        self.mkdir("/tmp", 0o1777)


def unit_entries(path):
    text = open(path).read().replace("\\\n", " ")
    entries = []
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            entries.append((key.strip(), value.strip()))
    return entries


def unit(lay, unit_path, config_path):
    """systemd: /etc/shardcoord as the unit's install steps lay it out (config 0644, secrets root
    only), the credentials its LoadCredential= lines hand over (owned by the service's user, 0400,
    in a 0500 folder), its StateDirectory and RuntimeDirectory; ExecStart with them."""
    entries = unit_entries(unit_path)
    values = lambda key: [v for k, v in entries if k == key]
    if len(values("ExecStart")) != 1:
        fail("the unit needs exactly one ExecStart")
    lay.put("/etc/shardcoord/shardcoordd.yaml", lay.config(open(config_path).read()), 0o644)
    lay.mkdir("/etc/shardcoord/secrets", 0o700)
    for name in ("tokens", "tls.crt", "tls.key"):
        lay.put("/etc/shardcoord/secrets/" + name, lay.secret(name), 0o600)
    creds = "/run/credentials/shardcoordd.service"
    lay.mkdir(creds, 0o700)
    for value in values("LoadCredential"):
        name, source = value.split(":", 1)
        if not os.path.exists(lay.path(source)):
            fail(f"LoadCredential={value}: {source} is not where the unit's install steps put the secrets")
        lay.put(creds + "/" + name, open(lay.path(source)).read(), 0o400, user=True)
    lay.mkdir(creds, 0o500, user=True)
    writable = ["/var/lib/" + d for d in values("StateDirectory")] + ["/run/" + d for d in values("RuntimeDirectory")]
    for d in writable:
        lay.mkdir(d, 0o700, user=True)
    cfg = yaml.safe_load(open(config_path))
    for key in ("journal_file", "state_file", "address_file"):
        if cfg.get(key) and os.path.dirname(cfg[key]) not in writable:
            fail(f"the config's {key} {cfg[key]} is outside the unit's StateDirectory/RuntimeDirectory "
                 f"(ProtectSystem=strict makes the rest read-only): {writable}")
    command = values("ExecStart")[0].replace("${CREDENTIALS_DIRECTORY}", creds)
    lay.write_argv(shlex.split(command.replace("$CREDENTIALS_DIRECTORY", creds)))


def final_stage(path):
    text = open(path).read().replace("\\\n", " ")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    start = max(i for i, l in enumerate(lines) if l.upper().startswith("FROM "))
    return [l.split(None, 1) + [""] for l in lines[start + 1:]]


def container(lay, containerfile, repo):
    """The image's final stage: files its COPY lines install from the repository, its VOLUMEs
    (owned by its user), the secrets mounted at /etc/shardcoord/secrets (owned by that user,
    0600, as deploy/README.md says); ENTRYPOINT followed by CMD."""
    entrypoint = cmd = user = None
    runs = []
    for op, arg, _ in final_stage(containerfile):
        op = op.upper()
        if op == "COPY" and not arg.startswith("--from"):
            src, dest = arg.split()
            text = open(os.path.join(repo, src)).read()
            lay.put(dest, lay.config(text) if dest.endswith(".yaml") else text, 0o644)
        elif op == "VOLUME":
            for d in (json.loads(arg) if arg.startswith("[") else arg.split()):
                lay.mkdir(d, 0o750, user=True, group=True)
        elif op == "USER":
            user = arg
        elif op == "RUN":
            runs.append(arg)
        elif op in ("ENTRYPOINT", "CMD"):
            if not arg.startswith("["):
                fail(f"{op} is in shell form; use the JSON (exec) form so that signals reach shardcoordd")
            entrypoint, cmd = (json.loads(arg), cmd) if op == "ENTRYPOINT" else (entrypoint, json.loads(arg))
    if user != "10001:10001":
        fail(f"the image's USER is {user}, not 10001:10001")
    if not any("/var/lib/shardcoord" in r and "10001" in r for r in runs):
        fail("no RUN makes /var/lib/shardcoord the user 10001's (a new volume copies the image's owner)")
    lay.mkdir("/etc/shardcoord/secrets", 0o700, user=True, group=True)
    for name in ("tokens", "tls.crt", "tls.key"):
        lay.put("/etc/shardcoord/secrets/" + name, lay.secret(name), 0o600, user=True, group=True)
    lay.write_argv((entrypoint or []) + (cmd or []))


def docs_of(path):
    kinds = {}
    for d in yaml.safe_load_all(open(path)):
        if d:
            if not d.get("apiVersion") or not d.get("metadata", {}).get("name"):
                fail(f"{path}: a document without apiVersion or metadata.name: {d}")
            kinds.setdefault(d["kind"], []).append(d)
    return kinds


def k8s_secrets(lay):
    """The two Secrets as the manifest's header makes them."""
    return {"shardcoordd-tokens": {k: lay.secret(k) for k in ("tokens", "rank-token", "read-token")},
            "shardcoordd-tls": {k: lay.secret(k) for k in ("tls.crt", "tls.key", "ca.crt")}}


def k8s_volume(lay, mount, volume, kinds):
    """Lays out one mounted volume as the kubelet would (projected files root:fsGroup with their
    mode); returns whether the daemon may write there."""
    where = mount["mountPath"]
    if "projected" in volume:
        mode = volume["projected"].get("defaultMode", 0o644)
        lay.mkdir(where, 0o755)
        maps = {m["metadata"]["name"]: m["data"] for m in kinds["ConfigMap"]}
        for source in volume["projected"]["sources"]:
            kind = "configMap" if "configMap" in source else "secret"
            ref = source[kind]
            data = (maps if kind == "configMap" else k8s_secrets(lay)).get(ref["name"])
            if data is None:
                fail(f"volume {volume['name']}: no {kind} {ref['name']} in the manifest or its header")
            for item in ref["items"]:
                if item["key"] not in data:
                    fail(f"volume {volume['name']}: {kind} {ref['name']} has no key {item['key']}")
                text = lay.config(data[item["key"]]) if kind == "configMap" else data[item["key"]]
                lay.put(where + "/" + item["path"], text, item.get("mode", mode), group=True)
        return False
    if "persistentVolumeClaim" in volume:
        claims = {c["metadata"]["name"] for c in kinds["PersistentVolumeClaim"]}
        if volume["persistentVolumeClaim"]["claimName"] not in claims:
            fail(f"volume {volume['name']}: its claim is not in the manifest")
        lay.mkdir(where, 0o2775, group=True)  # fsGroup: group-owned, setgid
        return True
    if "emptyDir" in volume:
        lay.mkdir(where, 0o1777)
        return True
    fail(f"volume {volume['name']}: a kind this check does not lay out: {volume}")


def k8s(lay, manifest):
    """The Deployment's pod: its volumes as mounted, its command and args, and for the probes
    FS/probe-env (the container's environment) and FS/readiness (the exec command)."""
    kinds = docs_of(manifest)
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    writable = [m["mountPath"] for m in c["volumeMounts"] if k8s_volume(lay, m, volumes[m["name"]], kinds)]
    cfg = yaml.safe_load(kinds["ConfigMap"][0]["data"]["shardcoordd.yaml"])
    for key in ("journal_file", "state_file"):
        if os.path.dirname(cfg[key]) not in writable:
            fail(f"the ConfigMap's {key} {cfg[key]} is not on a writable volume ({writable}; the root is read-only)")
    if "/tmp" not in writable:
        fail("no writable /tmp: the daemon's TLS copy needs one under readOnlyRootFilesystem")
    env = []
    for e in c.get("env", []):
        value = e.get("value")
        if value is None:
            ref = e["valueFrom"]["secretKeyRef"]
            value = k8s_secrets(lay)[ref["name"]][ref["key"]].strip()
        env.append(f"{e['name']}={lay.path(value) if value.startswith('/') else value}")
    open(os.path.join(lay.fs, "probe-env"), "w").write("\n".join(env) + "\n")
    grpc_port = {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
    probe = [("@GRPC@" if a == f"127.0.0.1:{grpc_port}" else a) for a in c["readinessProbe"]["exec"]["command"]]
    if "@GRPC@" not in probe:
        fail(f"the readiness probe does not dial 127.0.0.1:{grpc_port}: {probe}")
    open(os.path.join(lay.fs, "readiness"), "w").write("\n".join(probe) + "\n")
    lay.write_argv(c["command"] + c.get("args", []))


def main():
    kind, fs, daemon, secrets, uid = sys.argv[1:6]
    lay = Layout(fs, daemon, secrets, uid)
    {"unit": lambda: unit(lay, *sys.argv[6:8]), "container": lambda: container(lay, *sys.argv[6:8]),
     "k8s": lambda: k8s(lay, sys.argv[6])}[kind]()


main()
PY

# lay_out KIND FS ARGS...: the layout of one deploy file (see layout.py).
lay_out() {
  local kind=$1 fs=$2
  shift 2
  mkdir -p "$fs" && /usr/bin/python3 "$work/layout.py" "$kind" "$fs" "$daemon" "$secrets" "$uid" "$@"
}

# starts FS: serves with the command line the layout wrote.
starts() {
  local -a argv
  mapfile -t argv <"$1/argv"
  serves "$1" "$daemon" "${argv[@]}"
}

# --- 1. The shipped config ------------------------------------------------------------------
install -m 644 "$root/deploy/config/shardcoordd.yaml" "$work/shardcoordd.yaml"
config=$work/shardcoordd.yaml  # deploy/config/shardcoordd.yaml, readable by the daemon's user
cfs=$work/config
mkdir -p "$cfs/var/lib/shardcoord" "$cfs/tmp" && chmod 1777 "$cfs/tmp" && own "$cfs/var/lib/shardcoord"
cp "$secrets/tokens" "$secrets/tls.crt" "$secrets/tls.key" "$cfs/" && own "$cfs/tokens" "$cfs/tls.crt" "$cfs/tls.key"
config_flags=(--config "$config" --token-file "$cfs/tokens" --tls-cert-file "$cfs/tls.crt" --tls-key-file "$cfs/tls.key"
  --state-file "$cfs/var/lib/shardcoord/state")
journal_flag=(--journal-file "$cfs/var/lib/shardcoord/events.db")
if [[ ! -e /etc/shardcoord/secrets/tokens ]]; then
  missing_secrets() {
    local out rc
    out=$("$daemon" --config "$config" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --check-config 2>&1)
    rc=$?
    echo "exit $rc: $out"
    [[ $rc == 2 && $out == *"/etc/shardcoord/secrets/tokens"* ]]
  }
  check "deploy/config/shardcoordd.yaml where its secrets are missing: --check-config exits 2 naming them" \
    missing_secrets
fi
every_key() {  # the config lists every key the daemon accepts (set, or commented out)
  printf 'no_such_key: 1\n' >"$work/unknown.yaml"
  local accepted
  accepted=$("$daemon" --config "$work/unknown.yaml" --check-config 2>&1 | sed -n 's/.*accepted keys: //p')
  [[ -n $accepted ]] || { echo "the daemon did not list its accepted keys"; return 1; }
  /usr/bin/python3 - "$config" "$accepted" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
listed = set(re.findall(r"^#? ?([a-z_]+):", text, re.M))
missing = sorted(set(k.strip() for k in sys.argv[2].split(",")) - listed)
assert not missing, f"deploy/config/shardcoordd.yaml does not list {missing}"
PY
}
check "deploy/config/shardcoordd.yaml lists every key the daemon accepts" every_key
config_conflicts() {  # RUN: a second daemon on the first one's ports, and a journal without a folder
  local grpc out rc
  grpc=$(<"$1/grpc.addr")
  # As the deploy files' user, as the daemon that made the state folder's resume key ran: a key of
  # another user's is refused (issue: the key file is trusted only from its owner or root).
  out=$("${as_daemon[@]}" "$daemon" "${config_flags[@]}" "${journal_flag[@]}" --listen "$grpc" \
    --http-listen 127.0.0.1:0 --check-config 2>&1)
  rc=$?
  [[ $rc == 2 && $out == *"port ${grpc##*:} is already in use"*"--listen"* ]] ||
    { echo "--check-config on a taken port: exit $rc: $out"; return 1; }
  for mode in --check-config ""; do  # the check and a real start agree
    # shellcheck disable=SC2086  # no mode: no argument
    out=$(timeout 30 "${as_daemon[@]}" "$daemon" "${config_flags[@]}" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
      --journal-file "$cfs/no-such-folder/events.db" $mode 2>&1)
    rc=$?
    [[ $rc == 2 && $out == *"$cfs/no-such-folder"* ]] ||
      { echo "a journal in a missing folder (${mode:-a real start}): exit $rc: $out"; return 1; }
  done
  echo "refused a taken port and a journal in a missing folder, naming them"
}
during=config_conflicts check "deploy/config/shardcoordd.yaml starts and serves (secret, journal and state paths as flags); \
--check-config refuses a taken port and a missing journal folder" serves "$cfs" "$daemon" "${config_flags[@]}" "${journal_flag[@]}"

# --- 2. systemd -------------------------------------------------------------------------------
unit=$root/deploy/systemd/shardcoordd.service
if command -v systemd-analyze >/dev/null; then
  sed "s|/usr/local/bin/shardcoordd|$daemon|" "$unit" >"$work/shardcoordd.service"
  check "systemd-analyze verify deploy/systemd/shardcoordd.service" systemd-analyze verify "$work/shardcoordd.service"
else
  skip "systemd-analyze not installed"
fi
unit_starts() { lay_out unit "$work/unit" "$unit" "$config" && starts "$work/unit"; }
check "the systemd unit's ExecStart starts and serves (its credentials, StateDirectory, the installed config)" \
  unit_starts

# --- 3. The Containerfile ---------------------------------------------------------------------
image_starts() { lay_out container "$work/image" "$root/deploy/Containerfile" "$root" && starts "$work/image"; }
check "the Containerfile's ENTRYPOINT and CMD start and serve (its config, the mounted secrets, its VOLUME)" \
  image_starts

# --- 4. Kubernetes ----------------------------------------------------------------------------
kdir=$root/deploy/kubernetes
check "deploy/kubernetes: kinds, selectors, ports, volumes, budget, policy, priority, monitoring, memory" \
  /usr/bin/python3 - "$kdir" "$config" <<'PY'
import os, re, sys, yaml
kdir, shipped = sys.argv[1], sys.argv[2]
def docs(name):
    out = {}
    for d in yaml.safe_load_all(open(os.path.join(kdir, name))):
        if d:
            assert d.get("apiVersion") and d["metadata"].get("name"), d
            assert d["kind"] not in out, f"two {d['kind']} in {name}"
            out[d["kind"]] = d
    return out
def subset(selector, labels, what):
    assert selector.items() <= labels.items(), f"{what}: {selector} does not select {labels}"
main, prio, mon = docs("shardcoordd.yaml"), docs("priorityclass.yaml"), docs("servicemonitor.yaml")
assert set(main) == {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget",
                     "NetworkPolicy"}, sorted(main)
assert set(prio) == {"PriorityClass"} and set(mon) == {"ServiceMonitor"}, (prio.keys(), mon.keys())
kust = yaml.safe_load(open(os.path.join(kdir, "kustomization.yaml")))
assert sorted(kust["resources"]) == ["priorityclass.yaml", "shardcoordd.yaml"], kust["resources"]
dep = main["Deployment"]["spec"]
tpl = dep["template"]
pod, labels = tpl["spec"], tpl["metadata"]["labels"]
c = pod["containers"][0]
assert dep["replicas"] == 1 and dep["strategy"]["type"] == "Recreate", "one pod, never two"
subset(dep["selector"]["matchLabels"], labels, "Deployment selector")
ports = {p["name"]: p["containerPort"] for p in c["ports"]}
svc = main["Service"]
subset(svc["spec"]["selector"], labels, "Service")
for p in svc["spec"]["ports"]:
    assert p["targetPort"] in ports, p
assert pod["priorityClassName"] == prio["PriorityClass"]["metadata"]["name"], "priority class name"
assert prio["PriorityClass"]["value"] < 10**9 and not prio["PriorityClass"].get("globalDefault")
pdb = main["PodDisruptionBudget"]["spec"]
subset(pdb["selector"]["matchLabels"], labels, "PodDisruptionBudget")
assert pdb.get("maxUnavailable") == 0 or pdb.get("minAvailable") == 1, pdb
assert pdb.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", "a crash-looping coordinator must not block drains"
netpol = main["NetworkPolicy"]["spec"]
subset(netpol["podSelector"]["matchLabels"], labels, "NetworkPolicy")
allowed = {}
for rule in netpol["ingress"]:
    for p in rule["ports"]:
        assert p["port"] in ports, f"NetworkPolicy port {p['port']} is no container port"
        allowed.setdefault(p["port"], []).extend(rule["from"])
assert any("podSelector" in f for f in allowed["grpc"]), "gRPC from training pods"
assert any(f.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name") == "monitoring"
           for f in allowed["http"]), "HTTP from the monitoring namespace"
ann = tpl["metadata"]["annotations"]
assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports["http"], ann
assert ann["prometheus.io/scheme"] == "https" and ann["prometheus.io/path"] == "/metrics", ann
sm = mon["ServiceMonitor"]["spec"]
subset(sm["selector"]["matchLabels"], svc["metadata"]["labels"], "ServiceMonitor")
ep = sm["endpoints"][0]
assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["scheme"] == "https", ep
assert ep["authorization"]["credentials"] == {"name": "shardcoordd-tokens", "key": "read-token"}, ep
# The ConfigMap sets the shipped config's values, nothing else.
cfg = yaml.safe_load(main["ConfigMap"]["data"]["shardcoordd.yaml"])
ref = yaml.safe_load(open(shipped))
for k, v in cfg.items():
    assert ref.get(k) == v, f"ConfigMap {k}: {v!r}, deploy/config/shardcoordd.yaml: {ref.get(k)!r}"
# The memory limit covers the comment's arithmetic for 4096 ranks: idle 20 MiB, 23 KB per rank,
# max_buffered_bytes, 64 KiB per rank always served, the memory-backed /tmp.
def quantity(q):
    m = re.fullmatch(r"(\d+)(Mi|Gi)?", str(q))
    return int(m[1]) * {None: 1, "Mi": 2**20, "Gi": 2**30}[m[2]]
tmp = [v for v in pod["volumes"] if v["name"] == "tmp"][0]["emptyDir"]
need = 20 * 2**20 + 4096 * (23000 + 65536) + cfg["max_buffered_bytes"] + quantity(tmp["sizeLimit"])
limit = quantity(c["resources"]["limits"]["memory"])
assert need <= limit, f"memory limit {limit} below the sizing {need}"
assert quantity(c["resources"]["requests"]["memory"]) >= 20 * 2**20 + 4096 * 23000, "request below the steady state"
claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
assert claims == {main["PersistentVolumeClaim"]["metadata"]["name"]}, claims
PY
probes() {  # RUN: the readiness probe as the pod runs it (its command and environment), the liveness GET
  local -a probe penv
  mapfile -t probe <"$1/../readiness"
  mapfile -t penv <"$1/../probe-env"
  probe=("${probe[@]/#shardctl/$shardctl}")
  probe=("${probe[@]/@GRPC@/$(<"$1/grpc.addr")}")
  env -i "${penv[@]}" "${probe[@]}" >"$1/readiness.out" 2>&1 ||
    { echo "readiness probe ${probe[*]}:"; cat "$1/readiness.out"; return 1; }
  # The kubelet's HTTPS GET checks no certificate.
  [[ $(curl -sSk --max-time 5 "https://$(<"$1/http.addr")/healthz") == ok* ]] || { echo "liveness GET failed"; return 1; }
  echo "readiness and liveness probes pass"
}
k8s_starts() { lay_out k8s "$work/k8s" "$kdir/shardcoordd.yaml" && during=probes starts "$work/k8s"; }
check "the Kubernetes Deployment starts and serves (ConfigMap and Secrets as projected, the claim, /tmp); \
its readiness and liveness probes pass" k8s_starts
if command -v kubectl >/dev/null; then
  renders() { kubectl kustomize "$kdir" >"$work/rendered.yaml" && grep "^kind:" "$work/rendered.yaml" | sort | uniq -c &&
    [[ $(grep -c "^kind:" "$work/rendered.yaml") == 7 ]]; }
  check "kubectl kustomize deploy/kubernetes renders its 7 objects" renders
  mkdir -p "$work/kustomize"
  cp "$kdir"/*.yaml "$work/kustomize/"
  printf 'resources:\n- priorityclass.yaml\n- shardcoordd.yaml\n- servicemonitor.yaml\n' >"$work/kustomize/kustomization.yaml"
  check "kubectl kustomize renders them with servicemonitor.yaml" kubectl kustomize "$work/kustomize"
else
  skip "kubectl not installed (Debian: kubernetes-client)"
fi

# --- 5. Slurm ---------------------------------------------------------------------------------
check "bash -n deploy/slurm/train.sbatch" bash -n "$root/deploy/slurm/train.sbatch"
if command -v shellcheck >/dev/null; then
  check "shellcheck deploy/slurm/train.sbatch" shellcheck "$root/deploy/slurm/train.sbatch"
else
  skip "shellcheck not installed"
fi

# --- 6. Environment variables -----------------------------------------------------------------
env_names() {
  local out rc
  out=$(SHARDCOORD_DAEMON_TOKEN_FILE=$work/no-tokens "$daemon" --listen 127.0.0.1:0 --check-config 2>&1)
  rc=$?
  [[ $rc == 2 && $out == *"$work/no-tokens"* && $out != *deprecated* ]] ||
    { echo "SHARDCOORD_DAEMON_TOKEN_FILE not read as the token file: exit $rc: $out"; return 1; }
  out=$(SHARDCOORDD_TOKEN_FILE=$cfs/tokens "$daemon" --listen 127.0.0.1:0 --check-config 2>&1)
  rc=$?
  [[ $rc == 0 && $(grep -c "SHARDCOORDD_TOKEN_FILE is deprecated: rename it SHARDCOORD_DAEMON_TOKEN_FILE" <<<"$out") == 1 ]] ||
    { echo "the old SHARDCOORDD_TOKEN_FILE: exit $rc: $out"; return 1; }
  out=$(SHARDCOORDD_TOKEN_FILE=$work/old SHARDCOORD_DAEMON_TOKEN_FILE=$work/new "$daemon" --listen 127.0.0.1:0 --check-config 2>&1)
  [[ $out == *"$work/new"* && $out != *"$work/old "* && $out == *"SHARDCOORDD_TOKEN_FILE is deprecated and ignored"* ]] ||
    { echo "both names set: $out"; return 1; }
}
check "SHARDCOORD_DAEMON_TOKEN_FILE is the daemon's token file; SHARDCOORDD_TOKEN_FILE still works, with one deprecation line" \
  env_names

# --- 7. The container image -------------------------------------------------------------------
container() {
  local rootfs=${SHARDCOORD_ROOTFS:-/var/tmp/bookworm-root} base=localhost/debian:bookworm image=localhost/shardcoord:check
  if ! podman image exists "$base"; then
    [[ -x $rootfs/bin/bash ]] || debootstrap --variant=minbase bookworm "$rootfs" >/dev/null || return 1
    tar -C "$rootfs" -c . | podman import - "$base" >/dev/null || return 1
  fi
  podman build -q --isolation chroot --network host --build-arg BASE="$base" --build-arg RUNTIME_BASE="$base" \
    -t "$image" -f "$root/deploy/Containerfile" "$root" || return 1
  local user entry cmd id mnt
  user=$(podman image inspect -f '{{.Config.User}}' "$image")
  entry=$(podman image inspect -f '{{json .Config.Entrypoint}}' "$image")
  cmd=$(podman image inspect -f '{{json .Config.Cmd}}' "$image")
  [[ $user == 10001:10001 ]] || { echo "image user is '$user', not 10001:10001"; return 1; }
  echo "entrypoint $entry, command $cmd"
  # The image's own file system (its binaries, libraries, config and volume folder) in a container
  # that never runs: its shardcoordd is started there with chroot, as the image's user.
  id=$(podman create "$image") && mnt=$(podman mount "$id") || return 1
  mkdir -p "$mnt/etc/shardcoord/secrets" "$mnt/check"
  cp "$secrets/tokens" "$secrets/tls.crt" "$secrets/tls.key" "$mnt/etc/shardcoord/secrets/"
  chown -R 10001:10001 "$mnt/etc/shardcoord/secrets" "$mnt/check" && chmod 700 "$mnt/etc/shardcoord/secrets"
  /usr/bin/python3 -c 'import json, sys; print("\n".join(json.loads(sys.argv[1]) + json.loads(sys.argv[2])))' \
    "$entry" "$cmd" >"$work/image-argv"
  local -a argv
  mapfile -t argv <"$work/image-argv"
  local ok=0
  local -a as_daemon=(chroot --userspec=10001:10001 "$mnt")  # seen by serves_in_image
  serves_in_image "$mnt" "${argv[@]}" || ok=1
  podman umount "$id" >/dev/null
  podman rm "$id" >/dev/null
  return "$ok"
}
# serves_in_image MNT ARGV...: serves, with the paths of the image (its root is MNT).
serves_in_image() {
  local mnt=$1 pid
  shift
  local moved=(--listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --address-file /check/grpc.addr
    --http-address-file /check/http.addr)
  "${as_daemon[@]}" "$@" "${moved[@]}" --check-config || return 1
  "${as_daemon[@]}" "$@" "${moved[@]}" >"$mnt/check/log" 2>&1 &
  pid=$!
  echo "$pid" >>"$work/pids"
  if ! wait_serving "$pid" "$mnt/check" || ! prove "$mnt/check" "$mnt/var/lib/shardcoord"; then
    kill -KILL "$pid" 2>/dev/null
    return 1
  fi
  stop "$pid" "$mnt/check"
}
if [[ "${1:-}" == --container ]]; then
  if command -v podman >/dev/null && command -v debootstrap >/dev/null && [[ $(id -u) == 0 ]]; then
    check "podman build deploy/Containerfile; its shardcoordd starts from ENTRYPOINT and CMD in the image and serves" \
      container
  else
    echo "FAIL: --container needs root, podman and debootstrap (apt-get install podman debootstrap)"
    fail=1
  fi
else
  skip "the container image: scripts/check-deploy.sh --container builds it (about 10 min)"
fi

[[ $fail == 0 ]] && echo "deploy files: all checks passed" || echo "deploy files: FAILED"
exit $fail
