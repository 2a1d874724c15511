#!/usr/bin/env bash
# Checks deploy/ without a cluster or a container engine:
#   1. the Kubernetes manifests (validate_manifests.py: strict schemas, kustomizations,
#      gateway configs against their Deployments);
#   2. the Grafana dashboard parses, and the metric names it queries are written one per
#      line to $1 (or stdout), for comparison with a live /metrics;
#   3. with MRTR_GATEWAY_BIN set to a built gateway, `check-config` on every gateway.yaml
#      here (the image's and each ConfigMap's), with a peer address standing in for the
#      Pod IP. check-config resolves upstream host names, so run it where the cluster's
#      names resolve, or after discovery: dns defers that.
# PYTHON defaults to the test venv (tests/setup.sh installs kubernetes-validate there).
# The image build itself is not exercised here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-tests/.venv/bin/python}
# 1.30 is the oldest Kubernetes that runs the preStop sleep handler by default.
K8S_VERSIONS=(1.30.0 1.37.0)

echo "== deploy: Kubernetes manifests"
"$PYTHON" deploy/validate_manifests.py deploy/kubernetes "${K8S_VERSIONS[@]}"
if command -v kubectl >/dev/null; then
  for k in deploy/kubernetes/*/kustomization.yaml; do
    kubectl kustomize "$(dirname "$k")" >/dev/null
  done
  echo "kubectl kustomize renders every folder"
fi

echo "== deploy: Grafana dashboard"
metrics=$("$PYTHON" deploy/dashboard_metrics.py deploy/grafana/mrtr-gateway.json)
if [ $# -ge 1 ]; then
  printf '%s\n' "$metrics" >"$1"
  echo "$(wc -l <"$1") metric names written to $1"
else
  printf '%s\n' "$metrics"
fi

if [ -n "${MRTR_GATEWAY_BIN:-}" ]; then
  echo "== deploy: check-config"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$MRTR_GATEWAY_BIN" check-config deploy/image/gateway.yaml
  "$PYTHON" - "$tmp" deploy/kubernetes/*/configmap.yaml <<'PY'
import pathlib, sys, yaml
out = pathlib.Path(sys.argv[1])
for path in sys.argv[2:]:
    for obj in yaml.safe_load_all(open(path)):
        if obj and obj["kind"] == "ConfigMap" and "gateway.yaml" in obj.get("data", {}):
            (out / f"{obj['metadata']['name']}.yaml").write_text(obj["data"]["gateway.yaml"])
PY
  for f in "$tmp"/*.yaml; do
    # As the Deployments advertise it, on a cluster of either family.
    for pod_ip in 10.0.0.1 fd00::1; do
      MRTR_GATEWAY_PEER_ADVERTISE="[$pod_ip]:9091" "$MRTR_GATEWAY_BIN" check-config "$f"
    done
  done
fi
echo "deploy: ok"
