"""Validates the Kubernetes manifests under a folder.

- Every object against the Kubernetes OpenAPI schemas that kubernetes-validate ships, for
  each version given, in strict mode (an unknown field is an error). An object with no
  schema fails, except a ServiceMonitor (a Prometheus Operator CRD), which is checked by
  hand.
- Every kustomization.yaml lists files that exist, and every manifest but the Secret
  example is listed by one.
- Each gateway Deployment agrees with the gateway.yaml of the ConfigMap it mounts: the
  listeners are on 0.0.0.0 or [::] at the container's ports (the peer listener's too, with the
  advertised address from the Pod IP), the name of each Service reaching the MCP port is
  in allowed_hosts, preStop + grace period + shutdown timeout fit in
  terminationGracePeriodSeconds, and a server beside the gateway is stopped after it.

Usage: validate_manifests.py FOLDER KUBERNETES_VERSION...
"""

import pathlib
import sys

import yaml
from kubernetes_validate import utils as kv

GATEWAY_IMAGE = "mrtr-gateway"
NOT_IN_KUSTOMIZATION = {"secret.example.yaml"}
# Listeners take every address of the Pod: IPv4 only, or (Linux, dual-stack) both families.
WILDCARDS = {"0.0.0.0", "[::]"}

problems = []


def problem(where, text):
    problems.append(f"{where}: {text}")


def check_servicemonitor(where, obj):
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        problem(where, "ServiceMonitor apiVersion must be monitoring.coreos.com/v1")
    spec = obj.get("spec") or {}
    if not (spec.get("selector") or {}).get("matchLabels"):
        problem(where, "ServiceMonitor needs spec.selector.matchLabels")
    endpoints = spec.get("endpoints") or []
    if not endpoints or any(e.get("port") != "metrics" or e.get("path") != "/metrics" for e in endpoints):
        problem(where, "ServiceMonitor endpoints must scrape port `metrics`, path /metrics")


def check_schema(where, obj, versions):
    if obj.get("kind") == "ServiceMonitor":
        check_servicemonitor(where, obj)
        return
    for version in versions:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problem(where, f"Kubernetes {version}: {path}: {e.message}")
        except kv.SchemaNotFoundError:
            problem(where, f"no Kubernetes {version} schema for {obj.get('apiVersion')} {obj.get('kind')}")


def check_kustomizations(root, manifest_files):
    listed = set()
    for kfile in sorted(root.rglob("kustomization.yaml")):
        k = yaml.safe_load(kfile.read_text()) or {}
        for resource in k.get("resources") or []:
            target = (kfile.parent / resource).resolve()
            if not target.exists():
                problem(kfile, f"resource {resource} does not exist")
            listed.add(target)
    for f in manifest_files:
        if f.name not in NOT_IN_KUSTOMIZATION and f.resolve() not in listed:
            problem(f, "not listed in any kustomization.yaml")


def port_of(address):
    host, _, port = str(address).rpartition(":")
    return host, int(port)


def check_gateway(where, deployment, configmaps, services):
    pod = deployment["spec"]["template"]["spec"]
    grace_total = pod.get("terminationGracePeriodSeconds", 30)
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for c in pod["containers"]:
        if GATEWAY_IMAGE not in c["image"].rsplit("/", 1)[-1]:
            continue
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/mrtr-gateway")
        config = yaml.safe_load(configmaps[volumes[mount["name"]]["configMap"]["name"]]["gateway.yaml"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for key, port_name in (("listen", "mcp"), ("admin_listen", "admin")):
            host, port = port_of(config[key])
            if host not in WILDCARDS or port != ports[port_name]:
                problem(where, f"{key} {config[key]} must be 0.0.0.0 or [::] at port {ports[port_name]}")
        check_peers(where, c, config.get("peers") or {}, ports)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        for name, svc in services.items():
            selects = svc["spec"]["selector"].items() <= labels.items()
            # The peer listener checks no Host: a Service reaching only it needs no name there.
            mcp = any(p.get("targetPort") != "peer" for p in svc["spec"]["ports"])
            if selects and mcp and name not in config.get("allowed_hosts", []):
                problem(where, f"allowed_hosts lacks the Service name {name}")
        server = config.get("server") or {}
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        needed = pre_stop + server["grace_period_seconds"] + server["graceful_shutdown_timeout_seconds"]
        if needed >= grace_total:
            problem(where, f"preStop + grace + shutdown = {needed} s, not below terminationGracePeriodSeconds {grace_total}")
        check_upstream_outlives(where, pod, needed, grace_total)


def check_upstream_outlives(where, pod, gateway_stops_by, grace_total):
    """A server in the gateway's Pod (a sidecar deployment) must be told to stop only after
    the gateway has (its preStop sleeps past the gateway's shutdown), and before SIGKILL."""
    for c in pod["containers"]:
        if GATEWAY_IMAGE in c["image"].rsplit("/", 1)[-1]:
            continue
        sleep = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
        if not gateway_stops_by < sleep < grace_total:
            problem(where, f"container {c['name']}: preStop sleep {sleep} s must be above the gateway's shutdown "
                           f"({gateway_stops_by} s) and below terminationGracePeriodSeconds {grace_total}")


def check_peers(where, container, peers, ports):
    if not peers.get("listen"):
        return
    host, port = port_of(peers["listen"])
    if host not in WILDCARDS or port != ports.get("peer"):
        problem(where, f"peers.listen {peers['listen']} must be 0.0.0.0 or [::] at the container port `peer`")
    env = {e["name"]: e for e in container.get("env") or []}
    advertise = env.get("MRTR_GATEWAY_PEER_ADVERTISE", {}).get("value", "")
    if not peers.get("advertise") and advertise != f"[$(POD_IP)]:{port}":
        problem(where, f"MRTR_GATEWAY_PEER_ADVERTISE must be [$(POD_IP)]:{port} (brackets serve both families)")
    pod_ip = env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if advertise and pod_ip != "status.podIP":
        problem(where, "POD_IP must come from the field status.podIP")


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__.strip())
    root, versions = pathlib.Path(argv[1]), argv[2:]
    files = sorted(f for f in root.rglob("*.yaml") if f.name != "kustomization.yaml")
    count = 0
    for folder in sorted({f.parent for f in files}):
        configmaps, services, deployments = {}, {}, []
        for f in (f for f in files if f.parent == folder):
            for obj in yaml.safe_load_all(f.read_text()):
                if not obj:
                    continue
                count += 1
                where = f"{f} {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
                check_schema(where, obj, versions)
                kind, name = obj.get("kind"), obj["metadata"]["name"]
                if kind == "ConfigMap":
                    configmaps[name] = obj["data"]
                elif kind == "Service":
                    services[name] = obj
                elif kind == "Deployment":
                    deployments.append((where, obj))
        for where, deployment in deployments:
            try:
                check_gateway(where, deployment, configmaps, services)
            except (KeyError, StopIteration, TypeError, ValueError) as e:
                problem(where, f"gateway Deployment or its config is incomplete: {e!r}")
    check_kustomizations(root, files)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        sys.exit(f"{len(problems)} problem(s) in {root}")
    print(f"{count} objects in {len(files)} files valid (strict) against Kubernetes {', '.join(versions)}; "
          "kustomizations complete; gateway configs match their Deployments")


if __name__ == "__main__":
    main(sys.argv)
