"""The Kubernetes manifests under deploy/ agree with each other and with the code.

Every YAML document is parsed; names, ports, labels, selectors, environment
variables and image references are checked against each other and against
``timeslice.common.defaults``. Each check is a function that returns a list of problems
(empty = fine), run per document; ``test_check_catches`` then breaks a copy of
the manifests in one specific way per check and asserts that the check notices,
so that no check can pass vacuously.
"""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from timeslice.common import defaults

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"

# What the CLIs accept (each flag also as TIMESLICE_<FLAG>).
LOCKD_FLAGS = (
    "etcd-endpoints", "prefix", "listen", "metrics-port", "metrics-host", "replica-id",
    "etcd-ca", "etcd-cert", "etcd-key", "tls-cert", "tls-key",
)
NODEAGENT_FLAGS = (
    "node", "etcd-endpoints", "prefix", "listen", "metrics-port", "metrics-host", "backend",
    "etcd-ca", "etcd-cert", "etcd-key", "advertise", "state-dir", "tls-cert", "tls-key", "tls-client-ca",
    "channel-socket", "admin-token-file",
)
ALLOWED_TIMESLICE_ENV = frozenset(
    {getattr(defaults, n) for n in dir(defaults) if n.startswith("ENV_")}
    | {"TIMESLICE_" + f.upper().replace("-", "_") for f in LOCKD_FLAGS + NODEAGENT_FLAGS}
)
# Variables a timeslice container may carry besides TIMESLICE_* ones: they are
# read by the NVIDIA container runtime, not by our code.
ALLOWED_FOREIGN_ENV = frozenset({"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "POD_IP"})

# The components built from our image, and what their manifests must say.
COMPONENTS = {
    "lockd": {"kind": "Deployment", "grpc": defaults.LOCKD_PORT,
              "metrics": defaults.LOCKD_METRICS_PORT, "health": "timeslice.v1.Lockd"},
    "nodeagent": {"kind": "DaemonSet", "grpc": defaults.NODEAGENT_PORT,
                  "metrics": defaults.NODEAGENT_METRICS_PORT, "health": "timeslice.v1.NodeAgent"},
}

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "Job"})
CLUSTER_SCOPED_KINDS = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "DeviceClass"})
API_VERSIONS = {
    "Namespace": "v1", "ServiceAccount": "v1", "Service": "v1", "ConfigMap": "v1",
    "Deployment": "apps/v1", "StatefulSet": "apps/v1", "DaemonSet": "apps/v1",
    "Job": "batch/v1", "PodDisruptionBudget": "policy/v1",
    "ClusterRole": "rbac.authorization.k8s.io/v1",
    "ClusterRoleBinding": "rbac.authorization.k8s.io/v1",
    "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
    # DRA: one API version for all of it (deploy/dra/deviceclass.yaml says why v1).
    "DeviceClass": "resource.k8s.io/v1", "ResourceClaim": "resource.k8s.io/v1",
    "ResourceClaimTemplate": "resource.k8s.io/v1",
}
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


# --------------------------------------------------------------------------- loading

@dataclass
class Doc:
    path: str        # relative to deploy/
    index: int       # position in its file
    body: dict

    @property
    def kind(self) -> str:
        return self.body.get("kind", "")

    @property
    def name(self) -> str:
        return (self.body.get("metadata") or {}).get("name", "")

    @property
    def namespace(self) -> str | None:
        return (self.body.get("metadata") or {}).get("namespace")

    @property
    def id(self) -> str:
        return f"{self.path}#{self.index}:{self.kind}/{self.name}"


def is_kustomization(path: Path) -> bool:
    return path.name in ("kustomization.yaml", "kustomization.yml", "Kustomization")


# Kustomize components hold patches (partial objects); they are checked rendered,
# in tests/test_deploy_render.py.
KUSTOMIZE_COMPONENTS = DEPLOY / "components"


def manifest_files() -> list[Path]:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    return [p for p in files if not is_kustomization(p) and KUSTOMIZE_COMPONENTS not in p.parents]


def kustomization_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if is_kustomization(p))


def load_docs() -> list[Doc]:
    docs = []
    for path in manifest_files():
        try:
            bodies = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue  # test_file_parses reports it
        rel = str(path.relative_to(DEPLOY))
        docs += [Doc(rel, i, b) for i, b in enumerate(bodies) if b is not None]
    return docs


DOCS = load_docs()


def of_kind(docs: list[Doc], *kinds: str) -> list[Doc]:
    return [d for d in docs if d.kind in kinds]


def find(docs: list[Doc], kind: str, name: str, namespace: str | None = None) -> Doc | None:
    for d in docs:
        if d.kind == kind and d.name == name and (namespace is None or d.namespace == namespace):
            return d
    return None


def ids(docs: list[Doc]) -> list[str]:
    return [d.id for d in docs]


def by_id(docs: list[Doc], doc_id: str) -> Doc:
    for d in docs:
        if d.id == doc_id:
            return d
    raise LookupError(doc_id)


# --------------------------------------------------------------------------- pod helpers

def pod_template(w: Doc) -> dict:
    return (w.body.get("spec") or {}).get("template") or {}


def pod_spec(w: Doc) -> dict:
    return pod_template(w).get("spec") or {}


def pod_labels(w: Doc) -> dict:
    return (pod_template(w).get("metadata") or {}).get("labels") or {}


def pod_annotations(w: Doc) -> dict:
    return (pod_template(w).get("metadata") or {}).get("annotations") or {}


def containers(w: Doc) -> list[dict]:
    spec = pod_spec(w)
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def image_parts(image: str) -> tuple[str | None, str]:
    """(registry host or None, repository path without tag/digest)."""
    ref = image.split("@", 1)[0]
    first, _, rest = ref.partition("/")
    registry = None
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, ref = first, rest
    last_slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > last_slash:
        ref = ref[:colon]
    return registry, ref


def is_timeslice_image(image: str) -> bool:
    return image_parts(image)[1] == image_parts(defaults.IMAGE)[1]


def main_container(w: Doc) -> dict:
    """The container running our image (there must be exactly one)."""
    ours = [c for c in containers(w) if is_timeslice_image(c.get("image", ""))]
    return ours[0] if len(ours) == 1 else {}


def env_map(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env") or [] if "name" in e}


def envfrom_names(c: dict, docs: list[Doc], namespace: str | None) -> set[str]:
    names: set[str] = set()
    for src in c.get("envFrom") or []:
        ref = src.get("configMapRef")
        if ref:
            cm = find(docs, "ConfigMap", ref.get("name", ""), namespace)
            if cm:
                names |= set((cm.body.get("data") or {}).keys())
    return names


def field_ref(entry: dict) -> str | None:
    return ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")


def port_by_name(c: dict, name: str) -> int | None:
    for p in c.get("ports") or []:
        if p.get("name") == name:
            return p.get("containerPort")
    return None


def arg_value(c: dict, flag: str) -> str | None:
    """Value of --flag=value or --flag value in command + args."""
    argv = list(c.get("command") or []) + [str(a) for a in c.get("args") or []]
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def selector_matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def workloads_selected(selector: dict, docs: list[Doc], namespace: str | None) -> list[Doc]:
    return [w for w in of_kind(docs, *WORKLOAD_KINDS)
            if w.namespace == namespace and selector_matches(selector, pod_labels(w))]


def services_of(w: Doc, docs: list[Doc]) -> list[Doc]:
    return [s for s in of_kind(docs, "Service") if s.namespace == w.namespace
            and selector_matches((s.body.get("spec") or {}).get("selector") or {}, pod_labels(w))]


def pdbs_of(w: Doc, docs: list[Doc]) -> list[Doc]:
    out = []
    for p in of_kind(docs, "PodDisruptionBudget"):
        sel = (((p.body.get("spec") or {}).get("selector") or {}).get("matchLabels")) or {}
        if p.namespace == w.namespace and selector_matches(sel, pod_labels(w)):
            out.append(p)
    return out


def required_anti_affinity_on_hostname(w: Doc) -> list[str]:
    """Problems unless a required anti-affinity term keeps the pods one per node."""
    terms = (((pod_spec(w).get("affinity") or {}).get("podAntiAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution")) or []
    for t in terms:
        sel = (t.get("labelSelector") or {}).get("matchLabels") or {}
        if t.get("topologyKey") == HOSTNAME_TOPOLOGY and selector_matches(sel, pod_labels(w)):
            return []
    return [f"{w.id}: no required pod anti-affinity on {HOSTNAME_TOPOLOGY} selecting its own pods"]


# --------------------------------------------------------------------------- checks
# Each returns a list of problems for one subject document.

def check_identity(d: Doc, docs: list[Doc]) -> list[str]:
    out = []
    if not d.body.get("apiVersion") or not d.kind or not d.name:
        out.append(f"{d.id}: apiVersion, kind and metadata.name are required")
    want = API_VERSIONS.get(d.kind)
    if want is None:
        out.append(f"{d.id}: kind {d.kind!r} is not one this test knows; add it to API_VERSIONS")
    elif d.body.get("apiVersion") != want:
        out.append(f"{d.id}: apiVersion {d.body.get('apiVersion')!r}, expected {want!r}")
    if d.kind in CLUSTER_SCOPED_KINDS:
        if d.namespace:
            out.append(f"{d.id}: cluster-scoped, but sets a namespace")
    elif not d.namespace:
        out.append(f"{d.id}: namespaced kind without metadata.namespace")
    elif not find(docs, "Namespace", d.namespace):
        out.append(f"{d.id}: namespace {d.namespace!r} is not defined under deploy/")
    dup = [o for o in docs if o is not d and (o.kind, o.name, o.namespace) == (d.kind, d.name, d.namespace)]
    if dup:
        out.append(f"{d.id}: defined again in {dup[0].id}")
    return out


def check_workload_selector(w: Doc, docs: list[Doc]) -> list[str]:
    sel = ((w.body.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    if w.kind == "Job" and not sel:
        return []  # Jobs generate their own selector
    if not selector_matches(sel, pod_labels(w)):
        return [f"{w.id}: spec.selector {sel} does not match its pod labels {pod_labels(w)}"]
    return []


def check_service(s: Doc, docs: list[Doc]) -> list[str]:
    spec = s.body.get("spec") or {}
    sel = spec.get("selector") or {}
    targets = workloads_selected(sel, docs, s.namespace)
    if len(targets) != 1:
        return [f"{s.id}: selector {sel} matches {len(targets)} workloads ({ids(targets)}), expected 1"]
    w = targets[0]
    out = []
    for p in spec.get("ports") or []:
        tp = p.get("targetPort", p.get("port"))
        if isinstance(tp, str):
            if not any(port_by_name(c, tp) is not None for c in containers(w)):
                out.append(f"{s.id}: targetPort {tp!r} is no container port of {w.id}")
        elif not any(cp.get("containerPort") == tp for c in containers(w) for cp in c.get("ports") or []):
            out.append(f"{s.id}: targetPort {tp} is no container port of {w.id}")
    return out


def check_pdb(p: Doc, docs: list[Doc]) -> list[str]:
    spec = p.body.get("spec") or {}
    sel = (spec.get("selector") or {}).get("matchLabels") or {}
    targets = workloads_selected(sel, docs, p.namespace)
    if len(targets) != 1:
        return [f"{p.id}: selector {sel} matches {len(targets)} workloads, expected 1"]
    w = targets[0]
    out = []
    if ("minAvailable" in spec) == ("maxUnavailable" in spec):
        out.append(f"{p.id}: set exactly one of minAvailable / maxUnavailable")
    replicas = (w.body.get("spec") or {}).get("replicas", 1)
    if isinstance(spec.get("minAvailable"), int) and not 1 <= spec["minAvailable"] < replicas:
        out.append(f"{p.id}: minAvailable {spec['minAvailable']} must be in [1, replicas={replicas})")
    if isinstance(spec.get("maxUnavailable"), int) and spec["maxUnavailable"] < 1:
        out.append(f"{p.id}: maxUnavailable < 1 blocks every drain")
    return out


def check_component_ports(w: Doc, docs: list[Doc]) -> list[str]:
    comp = COMPONENTS[w.name]
    c = main_container(w)
    if not c:
        return [f"{w.id}: no (single) container running {defaults.IMAGE}"]
    out = []
    for name in ("grpc", "metrics"):
        if port_by_name(c, name) != comp[name]:
            out.append(f"{w.id}: container port {name!r} is {port_by_name(c, name)}, defaults say {comp[name]}")
    for probe in ("readinessProbe", "livenessProbe"):
        g = (c.get(probe) or {}).get("grpc") or {}
        if g.get("port") != comp["grpc"] or g.get("service") != comp["health"]:
            out.append(f"{w.id}: {probe} must be grpc port {comp['grpc']} service {comp['health']}, is {g}")
    listen = arg_value(c, "--listen") or ""
    if listen.rpartition(":")[2] != str(comp["grpc"]):
        out.append(f"{w.id}: --listen {listen!r} does not end in :{comp['grpc']}")
    if arg_value(c, "--metrics-port") != str(comp["metrics"]):
        out.append(f"{w.id}: --metrics-port is {arg_value(c, '--metrics-port')!r}, defaults say {comp['metrics']}")
    ann = pod_annotations(w)
    if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(comp["metrics"]):
        out.append(f"{w.id}: prometheus.io annotations must scrape port {comp['metrics']}")
    svcs = services_of(w, docs)
    if not svcs:
        out.append(f"{w.id}: no Service selects it")
    for s in svcs:
        ports = {p.get("name"): p for p in (s.body.get("spec") or {}).get("ports") or []}
        for name in ("grpc", "metrics"):
            p = ports.get(name) or {}
            if p.get("port") != comp[name] or p.get("targetPort") not in (name, comp[name]):
                out.append(f"{s.id}: port {name!r} must be {comp[name]} -> {name}, is {p}")
    return out


def check_prometheus_annotation(w: Doc, docs: list[Doc]) -> list[str]:
    port = pod_annotations(w).get("prometheus.io/port")
    if port is None:
        return []
    if not any(str(p.get("containerPort")) == port for c in containers(w) for p in c.get("ports") or []):
        return [f"{w.id}: prometheus.io/port {port} is no container port"]
    return []


def _var_refs(text: str) -> set[str]:
    return set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))


def check_env(w: Doc, docs: list[Doc]) -> list[str]:
    out = []
    for c in containers(w):
        own = is_timeslice_image(c.get("image", ""))
        from_cm = envfrom_names(c, docs, w.namespace)
        for src in c.get("envFrom") or []:
            ref = (src.get("configMapRef") or {}).get("name")
            if ref and not find(docs, "ConfigMap", ref, w.namespace):
                out.append(f"{w.id}: envFrom ConfigMap {ref!r} is not defined")
        seen: list[str] = []
        for e in c.get("env") or []:
            name = e.get("name", "")
            for ref in _var_refs(str(e.get("value", ""))):
                if ref not in seen and ref not in from_cm:
                    out.append(f"{w.id}: env {name} refers to $({ref}), not defined before it")
            seen.append(name)
        for name in seen + sorted(from_cm):
            if name.startswith("TIMESLICE_") and name not in ALLOWED_TIMESLICE_ENV:
                out.append(f"{w.id}: {name} is neither in timeslice.common.defaults nor a documented flag")
            elif own and not name.startswith("TIMESLICE_") and name not in ALLOWED_FOREIGN_ENV:
                out.append(f"{w.id}: {name} is not a variable our programs or the NVIDIA runtime read")
        argv = " ".join(map(str, list(c.get("command") or []) + list(c.get("args") or [])))
        for ref in _var_refs(argv):
            if ref not in seen and ref not in from_cm:
                out.append(f"{w.id}: command/args refer to $({ref}), which the container does not define")
    return out


def check_configmap(cm: Doc, docs: list[Doc]) -> list[str]:
    data = cm.body.get("data") or {}
    out = [f"{cm.id}: key {k} is not a known TIMESLICE_* variable"
           for k in data if k not in ALLOWED_TIMESLICE_ENV]
    if defaults.ENV_PREFIX in data and data[defaults.ENV_PREFIX] != defaults.KEY_PREFIX:
        out.append(f"{cm.id}: {defaults.ENV_PREFIX} is {data[defaults.ENV_PREFIX]!r}, "
                   f"defaults say {defaults.KEY_PREFIX!r}")
    return out


def _etcd_statefulset(docs: list[Doc]) -> Doc | None:
    for s in of_kind(docs, "StatefulSet"):
        if any("ETCD_INITIAL_CLUSTER" in env_map(c) for c in containers(s)):
            return s
    return None


def check_etcd_cluster(sts: Doc, docs: list[Doc]) -> list[str]:
    spec = sts.body.get("spec") or {}
    replicas, svc_name = spec.get("replicas", 1), spec.get("serviceName", "")
    c = next(c for c in containers(sts) if "ETCD_INITIAL_CLUSTER" in env_map(c))
    env = env_map(c)
    val = {k: str(e.get("value", "")) for k, e in env.items()}
    peer, client = port_by_name(c, "peer"), port_by_name(c, "client")
    out = []
    if replicas < 3 or replicas % 2 == 0:
        out.append(f"{sts.id}: replicas {replicas}: an HA etcd needs an odd number >= 3")
    if spec.get("podManagementPolicy") != "Parallel":
        out.append(f"{sts.id}: podManagementPolicy must be Parallel (members need each other to become ready)")
    out += required_anti_affinity_on_hostname(sts)
    if pod_spec(sts).get("enableServiceLinks") is not False:
        out.append(f"{sts.id}: enableServiceLinks must be false (Service links inject ETCD_* variables)")

    headless = find(docs, "Service", svc_name, sts.namespace)
    if headless is None:
        out.append(f"{sts.id}: serviceName {svc_name!r} is no Service")
    else:
        hs = headless.body.get("spec") or {}
        if hs.get("clusterIP") != "None":
            out.append(f"{headless.id}: the governing Service must be headless (clusterIP: None)")
        if hs.get("publishNotReadyAddresses") is not True:
            out.append(f"{headless.id}: needs publishNotReadyAddresses: true so members can bootstrap")
        if not selector_matches(hs.get("selector") or {}, pod_labels(sts)):
            out.append(f"{headless.id}: does not select {sts.id}")

    if field_ref(env.get("POD_NAME", {})) != "metadata.name" or val.get("ETCD_NAME") != "$(POD_NAME)":
        out.append(f"{sts.id}: ETCD_NAME must be $(POD_NAME), POD_NAME from metadata.name")
    if field_ref(env.get("POD_NAMESPACE", {})) != "metadata.namespace":
        out.append(f"{sts.id}: POD_NAMESPACE must come from metadata.namespace")

    def member_url(member: str, port: int | None, scheme: str) -> str:
        return f"{scheme}://{member}.{svc_name}.$(POD_NAMESPACE).svc:{port}"

    entries = [e.split("=", 1) for e in val.get("ETCD_INITIAL_CLUSTER", "").split(",") if e]
    names = [e[0] for e in entries]
    expected = [f"{sts.name}-{i}" for i in range(replicas)]
    if names != expected:
        out.append(f"{sts.id}: ETCD_INITIAL_CLUSTER names {names}, expected {expected}")
    for entry in entries:
        if len(entry) != 2:
            out.append(f"{sts.id}: ETCD_INITIAL_CLUSTER entry {entry} is not name=url")
            continue
        name, url = entry
        scheme = url.split("://", 1)[0]
        if scheme not in ("http", "https") or url != member_url(name, peer, scheme):
            out.append(f"{sts.id}: member {name} url {url!r}, expected {member_url(name, peer, 'http')!r}")
    for key, port in (("ETCD_INITIAL_ADVERTISE_PEER_URLS", peer), ("ETCD_ADVERTISE_CLIENT_URLS", client)):
        scheme = val.get(key, "").split("://", 1)[0]
        if val.get(key) != member_url("$(POD_NAME)", port, scheme) or scheme not in ("http", "https"):
            out.append(f"{sts.id}: {key} {val.get(key)!r}, expected {member_url('$(POD_NAME)', port, 'http')!r}")

    data_dir = val.get("ETCD_DATA_DIR", "")
    claims = {t.get("metadata", {}).get("name") for t in spec.get("volumeClaimTemplates") or []}
    mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") in claims]
    if not data_dir or not any(data_dir.startswith(m.get("mountPath", "").rstrip("/") + "/") for m in mounts):
        out.append(f"{sts.id}: ETCD_DATA_DIR {data_dir!r} is not on a volumeClaimTemplate mount")
    return out


def check_etcd_endpoints(cm: Doc, docs: list[Doc]) -> list[str]:
    """The endpoints our programs use name real members on the client port."""
    endpoints = (cm.body.get("data") or {}).get(defaults.ENV_ETCD_ENDPOINTS)
    if endpoints is None:
        return []
    sts = _etcd_statefulset(docs)
    if sts is None:
        return [f"{cm.id}: names etcd endpoints, but deploy/ has no etcd StatefulSet"]
    spec = sts.body.get("spec") or {}
    members = {f"{sts.name}-{i}" for i in range(spec.get("replicas", 1))}
    client = port_by_name(next(c for c in containers(sts) if "ETCD_INITIAL_CLUSTER" in env_map(c)), "client")
    out = []
    listed = set()
    for ep in endpoints.split(","):
        host, _, port = ep.strip().rpartition(":")
        parts = host.split(".")
        if len(parts) < 2 or parts[0] not in members or parts[1] != spec.get("serviceName"):
            out.append(f"{cm.id}: endpoint {ep!r} is not <member>.{spec.get('serviceName')} of {sts.id}")
        if port != str(client):
            out.append(f"{cm.id}: endpoint {ep!r} is not on the client port {client}")
        listed.add(parts[0])
    if listed != members:
        out.append(f"{cm.id}: endpoints list {sorted(listed)}, the cluster has {sorted(members)}")
    return out


def check_lockd(w: Doc, docs: list[Doc]) -> list[str]:
    spec = w.body.get("spec") or {}
    out = []
    if spec.get("replicas", 1) < 3:
        out.append(f"{w.id}: replicas {spec.get('replicas', 1)} < 3")
    out += required_anti_affinity_on_hostname(w)
    c = main_container(w)
    if field_ref(env_map(c).get("TIMESLICE_REPLICA_ID", {})) != "metadata.name":
        out.append(f"{w.id}: TIMESLICE_REPLICA_ID must come from the pod name (metadata.name)")
    if not pod_spec(w).get("terminationGracePeriodSeconds"):
        out.append(f"{w.id}: terminationGracePeriodSeconds must be set (leadership is resigned on SIGTERM)")
    if not pdbs_of(w, docs):
        out.append(f"{w.id}: no PodDisruptionBudget")
    if (pod_spec(w).get("securityContext") or {}).get("runAsNonRoot") is not True:
        out.append(f"{w.id}: lockd must run as non-root")
    sa = pod_spec(w).get("serviceAccountName")
    if not sa or not find(docs, "ServiceAccount", sa, w.namespace):
        out.append(f"{w.id}: serviceAccountName {sa!r} is no ServiceAccount")
    for b in of_kind(docs, "RoleBinding", "ClusterRoleBinding"):
        if any(s.get("name") == sa and s.get("namespace") == w.namespace for s in b.body.get("subjects") or []):
            out.append(f"{w.id}: lockd needs no Kubernetes API access, but {b.id} grants some")
    return out


def check_nodeagent(w: Doc, docs: list[Doc]) -> list[str]:
    ps = pod_spec(w)
    c = main_container(w)
    env = env_map(c)
    out = []
    if ps.get("hostPID") is not True:
        out.append(f"{w.id}: hostPID must be true (the agent acts on the jobs' processes)")
    if (c.get("securityContext") or {}).get("privileged") is not True:
        out.append(f"{w.id}: the agent container must be privileged")
    if field_ref(env.get(defaults.ENV_NODE_NAME, {})) != "spec.nodeName":
        out.append(f"{w.id}: {defaults.ENV_NODE_NAME} must come from spec.nodeName")
    if arg_value(c, "--node") != f"$({defaults.ENV_NODE_NAME})":
        out.append(f"{w.id}: --node must be $({defaults.ENV_NODE_NAME})")
    if env.get("NVIDIA_VISIBLE_DEVICES", {}).get("value") != "all":
        out.append(f"{w.id}: NVIDIA_VISIBLE_DEVICES must be 'all'")
    caps = set(str(env.get("NVIDIA_DRIVER_CAPABILITIES", {}).get("value", "")).split(","))
    if not {"compute", "utility"} <= caps:
        out.append(f"{w.id}: NVIDIA_DRIVER_CAPABILITIES must include compute,utility (driver + NVML)")
    # Least privilege: hostPID already shows the jobs' pids; nothing
    # reads a second procfs, so none is mounted.
    if any((v.get("hostPath") or {}).get("path") == "/proc" for v in ps.get("volumes") or []):
        out.append(f"{w.id}: host /proc is mounted but unused (hostPID already shows the pids)")
    if not ps.get("nodeSelector") and not ps.get("affinity"):
        out.append(f"{w.id}: no nodeSelector/affinity for GPU nodes")
    if not any(t.get("key") == "nvidia.com/gpu" for t in ps.get("tolerations") or []):
        out.append(f"{w.id}: does not tolerate the nvidia.com/gpu taint")
    res = c.get("resources") or {}
    if any("nvidia.com/gpu" in (res.get(k) or {}) for k in ("requests", "limits")) or ps.get("resourceClaims"):
        out.append(f"{w.id}: the agent must not take GPUs away from the jobs")
    sa = ps.get("serviceAccountName")
    if not sa or not find(docs, "ServiceAccount", sa, w.namespace):
        out.append(f"{w.id}: serviceAccountName {sa!r} is no ServiceAccount")
    elif _may_read_pods(sa, w.namespace, docs):
        out.append(f"{w.id}: ServiceAccount {sa} may read pods, which the agent never does")
    if ps.get("automountServiceAccountToken") is not False:
        out.append(f"{w.id}: the agent calls no Kubernetes API: automountServiceAccountToken must be false")
    return out


def _may_read_pods(sa: str, namespace: str | None, docs: list[Doc]) -> bool:
    for b in of_kind(docs, "ClusterRoleBinding"):
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa
                   and s.get("namespace") == namespace for s in b.body.get("subjects") or []):
            continue
        role = find(docs, "ClusterRole", (b.body.get("roleRef") or {}).get("name", ""))
        for rule in (role.body.get("rules") if role else None) or []:
            if "" in rule.get("apiGroups", []) and "pods" in rule.get("resources", []) \
                    and {"get", "list", "watch"} <= set(rule.get("verbs", [])):
                return True
    return False


def check_rbac_binding(b: Doc, docs: list[Doc]) -> list[str]:
    out = []
    ref = b.body.get("roleRef") or {}
    kind = ref.get("kind", "")
    if not find(docs, kind, ref.get("name", ""), None if kind == "ClusterRole" else b.namespace):
        out.append(f"{b.id}: roleRef {kind}/{ref.get('name')} is not defined")
    for s in b.body.get("subjects") or []:
        if s.get("kind") == "ServiceAccount" and not find(docs, "ServiceAccount", s.get("name", ""), s.get("namespace")):
            out.append(f"{b.id}: subject ServiceAccount {s.get('namespace')}/{s.get('name')} is not defined")
    return out


def check_images(w: Doc, docs: list[Doc]) -> list[str]:
    out = []
    for c in containers(w):
        image = c.get("image", "")
        registry, _ = image_parts(image)
        if not image:
            out.append(f"{w.id}: container {c.get('name')} has no image")
        elif registry is not None or image.split("/", 1)[0] == "localhost":
            out.append(f"{w.id}: image {image!r} names a registry host; set it with kustomize images:")
        if is_timeslice_image(image) and image != defaults.IMAGE:
            out.append(f"{w.id}: image {image!r}, defaults say {defaults.IMAGE!r}")
    return out


def check_dra_request(d: Doc, docs: list[Doc]) -> list[str]:
    spec = d.body.get("spec") or {}
    if d.kind == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    requests = (spec.get("devices") or {}).get("requests") or []
    out = [] if requests else [f"{d.id}: no device requests"]
    for r in requests:
        cls = (r.get("exactly") or {}).get("deviceClassName")
        if not cls or not find(docs, "DeviceClass", cls):
            out.append(f"{d.id}: request {r.get('name')!r} names DeviceClass {cls!r}, which is not defined")
    return out


def check_pod_claims(w: Doc, docs: list[Doc]) -> list[str]:
    out = []
    pod_claims = {}
    for rc in pod_spec(w).get("resourceClaims") or []:
        pod_claims[rc.get("name")] = rc
        if "resourceClaimName" in rc:
            kind, name = "ResourceClaim", rc["resourceClaimName"]
        else:
            kind, name = "ResourceClaimTemplate", rc.get("resourceClaimTemplateName", "")
        if not find(docs, kind, name, w.namespace):
            out.append(f"{w.id}: pod claim {rc.get('name')!r} refers to {kind} {name!r}, not in {w.namespace}")
    used = set()
    for c in containers(w):
        for cc in (c.get("resources") or {}).get("claims") or []:
            used.add(cc.get("name"))
            if cc.get("name") not in pod_claims:
                out.append(f"{w.id}: container {c.get('name')} uses claim {cc.get('name')!r}, not a pod claim")
    for name in set(pod_claims) - used:
        out.append(f"{w.id}: pod claim {name!r} is used by no container")
    return out


def check_deviceclass(d: Doc, docs: list[Doc]) -> list[str]:
    exprs = " ".join(((s.get("cel") or {}).get("expression") or "") for s in (d.body.get("spec") or {}).get("selectors") or [])
    if not re.search(r"device\.driver\s*==\s*[\"']gpu\.nvidia\.com[\"']", exprs):
        return [f"{d.id}: does not select the NVIDIA DRA driver's devices (device.driver == \"gpu.nvidia.com\")"]
    return []


def check_shared_claim(claim: Doc, docs: list[Doc]) -> list[str]:
    """A ResourceClaim exists to be shared: at least two jobs' pods name it."""
    users = [w for w in of_kind(docs, *WORKLOAD_KINDS) if w.namespace == claim.namespace and any(
        rc.get("resourceClaimName") == claim.name for rc in pod_spec(w).get("resourceClaims") or [])]
    if len(users) < 2:
        return [f"{claim.id}: referenced by {len(users)} workloads; a shared claim needs >= 2"]
    job_ids = [str(env_map(c).get(defaults.ENV_JOB_ID, {}).get("value")) for w in users for c in containers(w)]
    if len(set(job_ids)) != len(job_ids):
        return [f"{claim.id}: the workloads sharing it must be distinct jobs, have {defaults.ENV_JOB_ID}s {job_ids}"]
    return []


# --------------------------------------------------------------------------- tests over deploy/

def _params(kinds: tuple[str, ...], pred: Callable[[Doc], bool] = lambda d: True) -> list:
    chosen = [d for d in of_kind(DOCS, *kinds) if pred(d)]
    assert chosen, f"deploy/ has no {kinds} to check"
    return [pytest.param(d.id, id=d.id) for d in chosen]


def _no_problems(check, doc_id: str) -> None:
    problems = check(by_id(DOCS, doc_id), DOCS)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("path", manifest_files() + kustomization_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_file_parses(path: Path):
    bodies = [b for b in yaml.safe_load_all(path.read_text()) if b is not None]
    assert bodies, f"{path} has no YAML documents"
    assert all(isinstance(b, dict) for b in bodies), f"{path}: every document must be a mapping"


@pytest.mark.parametrize("doc_id", [pytest.param(d.id, id=d.id) for d in DOCS])
def test_identity(doc_id):
    _no_problems(check_identity, doc_id)


@pytest.mark.parametrize("doc_id", _params(tuple(WORKLOAD_KINDS)))
def test_workload_selector_matches_own_pods(doc_id):
    _no_problems(check_workload_selector, doc_id)


@pytest.mark.parametrize("doc_id", _params(("Service",)))
def test_service_selects_exactly_one_workload(doc_id):
    _no_problems(check_service, doc_id)


@pytest.mark.parametrize("doc_id", _params(("PodDisruptionBudget",)))
def test_pdb_selects_exactly_one_workload(doc_id):
    _no_problems(check_pdb, doc_id)


@pytest.mark.parametrize("doc_id", _params(("Deployment", "DaemonSet"), lambda d: d.name in COMPONENTS))
def test_component_ports_agree_with_defaults(doc_id):
    _no_problems(check_component_ports, doc_id)


def test_every_component_is_deployed():
    for name, comp in COMPONENTS.items():
        assert find(DOCS, comp["kind"], name), f"no {comp['kind']} {name} under deploy/"


@pytest.mark.parametrize("doc_id", _params(tuple(WORKLOAD_KINDS)))
def test_prometheus_annotation_names_a_port(doc_id):
    _no_problems(check_prometheus_annotation, doc_id)


@pytest.mark.parametrize("doc_id", _params(tuple(WORKLOAD_KINDS)))
def test_env_names_are_known(doc_id):
    _no_problems(check_env, doc_id)


@pytest.mark.parametrize("doc_id", _params(("ConfigMap",)))
def test_configmap(doc_id):
    _no_problems(check_configmap, doc_id)


@pytest.mark.parametrize("doc_id", _params(("StatefulSet",), lambda d: d is _etcd_statefulset(DOCS)))
def test_etcd_initial_cluster(doc_id):
    _no_problems(check_etcd_cluster, doc_id)


@pytest.mark.parametrize("doc_id", _params(("ConfigMap",), lambda d: defaults.ENV_ETCD_ENDPOINTS in (d.body.get("data") or {})))
def test_etcd_endpoints_name_members(doc_id):
    _no_problems(check_etcd_endpoints, doc_id)


@pytest.mark.parametrize("doc_id", _params(("Deployment",), lambda d: d.name == "lockd"))
def test_lockd_is_highly_available(doc_id):
    _no_problems(check_lockd, doc_id)


@pytest.mark.parametrize("doc_id", _params(("DaemonSet",), lambda d: d.name == "nodeagent"))
def test_nodeagent_is_privileged_with_host_pid(doc_id):
    _no_problems(check_nodeagent, doc_id)


def test_no_component_is_granted_kubernetes_api_access():
    # Neither lockd nor the agent calls the Kubernetes API (no unused RBAC).
    assert of_kind(DOCS, "ClusterRoleBinding", "RoleBinding") == []


@pytest.mark.parametrize("doc_id", [pytest.param(d.id, id=d.id) for d in of_kind(DOCS, "ClusterRoleBinding", "RoleBinding")])
def test_rbac_binding_refers_to_defined_objects(doc_id):
    _no_problems(check_rbac_binding, doc_id)


@pytest.mark.parametrize("doc_id", _params(tuple(WORKLOAD_KINDS)))
def test_images_have_no_registry_host(doc_id):
    _no_problems(check_images, doc_id)


@pytest.mark.parametrize("doc_id", _params(("ResourceClaim", "ResourceClaimTemplate")))
def test_dra_requests_name_a_device_class(doc_id):
    _no_problems(check_dra_request, doc_id)


@pytest.mark.parametrize("doc_id", _params(("DeviceClass",)))
def test_deviceclass_selects_nvidia_gpus(doc_id):
    _no_problems(check_deviceclass, doc_id)


@pytest.mark.parametrize("doc_id", _params(tuple(WORKLOAD_KINDS), lambda d: bool(pod_spec(d).get("resourceClaims"))))
def test_pod_claims_resolve(doc_id):
    _no_problems(check_pod_claims, doc_id)


@pytest.mark.parametrize("doc_id", _params(("ResourceClaim",)))
def test_resource_claim_is_shared_by_two_jobs(doc_id):
    _no_problems(check_shared_claim, doc_id)


# --------------------------------------------------------------------------- kustomize

def _kustomization(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _listed(kpath: Path) -> list[Path]:
    k = _kustomization(kpath)
    entries = list(k.get("resources") or []) + list(k.get("components") or [])
    entries += [p["path"] if isinstance(p, dict) else p for p in k.get("patches") or [] if not isinstance(p, dict) or "path" in p]
    return [(kpath.parent / e).resolve() for e in entries]


def kustomize_problems(deploy: Path) -> list[str]:
    """Every manifest is listed by exactly one kustomization, every entry exists,
    and the top kustomization covers everything outside nested kustomizations."""
    kfiles = sorted(p for p in deploy.rglob("*") if is_kustomization(p))
    manifests = sorted(p.resolve() for p in deploy.rglob("*") if p.suffix in (".yaml", ".yml") and not is_kustomization(p))
    top = (deploy / "kustomization.yaml").resolve()
    out = [] if top in [k.resolve() for k in kfiles] else ["deploy/kustomization.yaml is missing"]
    listed_by: dict[Path, list[Path]] = {}
    for k in kfiles:
        for entry in _listed(k):
            if not entry.exists():
                out.append(f"{k.relative_to(deploy)}: lists {entry}, which does not exist")
            elif entry.is_dir() and not any(is_kustomization(p) for p in entry.iterdir()):
                out.append(f"{k.relative_to(deploy)}: lists directory {entry} without a kustomization")
            listed_by.setdefault(entry, []).append(k)
    nested_roots = [k.parent.resolve() for k in kfiles if k.resolve() != top]
    for m in manifests:
        owners = listed_by.get(m, [])
        if len(owners) != 1:
            out.append(f"{m.relative_to(deploy.resolve())} is listed by {len(owners)} kustomizations, expected 1")
            continue
        nearest = max((r for r in nested_roots + [top.parent] if m.is_relative_to(r)), key=lambda r: len(r.parts))
        if owners[0].parent.resolve() != nearest:
            out.append(f"{m.relative_to(deploy.resolve())} is listed by {owners[0]}, not by its own folder's kustomization")
    return out


def test_kustomization_lists_every_manifest():
    problems = kustomize_problems(DEPLOY)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("kpath", kustomization_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomize_renders(kpath: Path):
    kubectl = shutil.which("kubectl")
    kustomize = shutil.which("kustomize")
    if not (kubectl or kustomize):
        pytest.skip("neither kubectl nor kustomize is installed")
    if _kustomization(kpath).get("kind") == "Component":
        pytest.skip("a component renders only inside a kustomization (tests/test_deploy_render.py)")
    argv = [kubectl, "kustomize", str(kpath.parent)] if kubectl else [kustomize, "build", str(kpath.parent)]
    r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert list(yaml.safe_load_all(r.stdout))


def test_kustomization_images_have_no_registry_host():
    for k in kustomization_files():
        for img in _kustomization(k).get("images") or []:
            new = img.get("newName", img.get("name", ""))
            assert image_parts(new + ":x")[0] is None, f"{k}: image {new!r} names a registry host"


# --------------------------------------------------------------------------- Dockerfile

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def console_scripts() -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def dockerfile_programs(text: str) -> set[str]:
    """Programs the Dockerfile runs or checks: CMD/ENTRYPOINT and its `for program in ...` check."""
    progs: set[str] = set()
    for m in re.finditer(r"^(?:CMD|ENTRYPOINT)\s+(\[.*\])\s*$", text, re.MULTILINE):
        progs.add(yaml.safe_load(m.group(1))[0])
    for m in re.finditer(r"for program in ([^;]+);", text):
        progs |= set(m.group(1).split())
    return progs


def dockerfile_problems(dockerfile: str, dockerignore: str, scripts: set[str], manifest_programs: set[str]) -> list[str]:
    out = []
    programs = dockerfile_programs(dockerfile)
    if not programs:
        out.append("Dockerfile names no program (CMD / entry point check)")
    for p in sorted((programs | manifest_programs) - scripts):
        out.append(f"{p!r} is run by the Dockerfile or a manifest but is no console script in pyproject.toml")
    for p in sorted(scripts - programs):
        out.append(f"console script {p!r} is not checked by the Dockerfile's entry point loop")
    for m in re.finditer(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE):
        if image_parts(m.group(1))[0] is not None:
            out.append(f"FROM {m.group(1)} names a registry host")
    if not re.search(r"^FROM\s+python:3\.12-slim\b", dockerfile, re.MULTILINE):
        out.append("the base image must be python:3.12-slim")
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    if not users or users[-1].split(":")[0] in ("root", "0"):
        out.append("the image must end as a non-root USER (lockd's)")
    # Every folder that pyproject's package discovery needs is in the build context.
    ignore_lines = [ln.strip() for ln in dockerignore.splitlines() if ln.strip() and not ln.startswith("#")]
    allow_all = "*" not in ignore_lines
    for folder in sorted(package_roots()):
        if not re.search(rf"^COPY\s+{re.escape(folder)}/?\s", dockerfile, re.MULTILINE):
            out.append(f"the Dockerfile does not COPY {folder}/, which pyproject packages come from")
        if not allow_all and f"!{folder}/" not in ignore_lines and f"!{folder}" not in ignore_lines:
            out.append(f".dockerignore keeps {folder}/ out of the build context")
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        if not allow_all and f"!{f}" not in ignore_lines:
            out.append(f".dockerignore keeps {f} out of the build context (pip needs it)")
    # lockd and nodeagent need the server extra; a plain `timeslice` is the lean job client.
    if not re.search(r"pip wheel[^\n]*\.\[server\]", dockerfile) or "timeslice[server]" not in dockerfile:
        out.append("the image must build and install timeslice[server] (lockd and the agent need it)")
    return out


def package_roots() -> set[str]:
    """Top-level folders the packages come from, per [tool.setuptools.package-dir]."""
    tomllib = pytest.importorskip("tomllib")
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {folder.split("/")[0] for folder in dirs.values()}


def manifest_programs() -> set[str]:
    return {c["command"][0] for w in of_kind(DOCS, *WORKLOAD_KINDS) for c in containers(w)
            if is_timeslice_image(c.get("image", "")) and c.get("command")}


def test_dockerfile_entrypoints_are_console_scripts():
    problems = dockerfile_problems(DOCKERFILE.read_text(), DOCKERIGNORE.read_text(),
                                   console_scripts(), manifest_programs())
    assert problems == [], "\n".join(problems)


def test_components_run_their_own_program():
    for name in COMPONENTS:
        w = find(DOCS, COMPONENTS[name]["kind"], name)
        c = main_container(w) if w else {}
        assert (c.get("command") or [None])[0] == name and (c.get("args") or [None])[0] == "serve", \
            f"{name} must run `{name} serve ...`"


# --------------------------------------------------------------------------- no registry host anywhere

# Image references written as text (docs, Dockerfile, commented YAML): after
# image:/newName:, FROM, or a docker build/tag/push/pull command.
IMAGE_TEXT_RE = re.compile(
    r"(?:\b(?:image|newName):\s*[\"']?(?P<a>[^\s\"']+))"
    r"|(?:^\s*FROM\s+(?P<b>\S+))"
    r"|(?:\bdocker\s+(?:build|tag|push|pull)\b(?P<c>[^\n]*))",
    re.MULTILINE,
)


def registry_hosts_in_text(text: str) -> list[str]:
    refs = []
    for m in IMAGE_TEXT_RE.finditer(text):
        if m.group("c") is not None:
            refs += [t for t in m.group("c").split() if not t.startswith("-") and t not in (".", "..")]
        else:
            refs.append(m.group("a") or m.group("b"))
    return [r for r in refs if image_parts(r)[0] is not None]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in DEPLOY.rglob("*") if p.is_file()) + [DOCKERFILE, DOCKERIGNORE],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_registry_host_written(path: Path):
    hits = registry_hosts_in_text(path.read_text())
    assert not hits, f"{path.relative_to(ROOT)} names images with a registry host: {hits}"


# --------------------------------------------------------------------------- local.env

LOCAL_ENV = DEPLOY / "local.env"


def parse_env_file(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ValueError(f"line {n}: not KEY=VALUE: {line!r}")
        if key in values:
            raise ValueError(f"line {n}: {key} set twice")
        values[key] = value
    return values


def local_env_problems(values: dict[str, str]) -> list[str]:
    out = []
    ints = ["ETCD_MEMBERS", "LOCKD_REPLICAS", "SIM_DEVICES", "SIM_DEVICE_CAPACITY_BYTES",
            "SIM_SNAPSHOT_BYTES_PER_S", "SIM_RESTORE_BYTES_PER_S"]
    ports = [k for k in values if k.endswith("_PORT")]
    for k in ints + ports:
        if not re.fullmatch(r"\d+", values.get(k, "")):
            out.append(f"{k} must be a whole number, is {values.get(k)!r}")
    for k in ports:
        if values[k].isdigit() and not 0 <= int(values[k]) <= 65535:
            out.append(f"{k} {values[k]} is no port (0 = free port)")
    if values.get("ETCD_MEMBERS", "").isdigit() and int(values["ETCD_MEMBERS"]) % 2 == 0:
        out.append("ETCD_MEMBERS must be odd")
    if values.get("LOCKD_REPLICAS") != "3":
        out.append("LOCKD_REPLICAS defaults to 3 (a leader and two standbys)")
    if values.get("ETCD_MEMBERS") != "1":
        out.append("ETCD_MEMBERS defaults to 1 (three with a flag)")
    if values.get("PREFIX") != defaults.KEY_PREFIX:
        out.append(f"PREFIX must be {defaults.KEY_PREFIX!r} (timeslice.common.defaults.KEY_PREFIX)")
    if values.get("BACKEND") not in ("auto", "cuda-driver", "cuda-checkpoint", "sim"):
        out.append(f"BACKEND {values.get('BACKEND')!r} is not auto|cuda-driver|cuda-checkpoint|sim")
    if values.get("GROUP_SHARING") not in ("exclusive", "fit"):
        out.append(f"GROUP_SHARING {values.get('GROUP_SHARING')!r} is not exclusive|fit")
    for k in ("LOCKD_PORT", "LOCKD_METRICS_PORT", "NODEAGENT_PORT", "NODEAGENT_METRICS_PORT",
              "ETCD_CLIENT_PORT", "ETCD_PEER_PORT"):
        if k not in values:
            out.append(f"{k} is missing")
    return out


def test_local_env_defaults():
    problems = local_env_problems(parse_env_file(LOCAL_ENV.read_text()))
    assert problems == [], "\n".join(problems)


# --------------------------------------------------------------------------- the checks can fail

def _doc(docs, kind, name):
    d = find(docs, kind, name)
    assert d is not None, f"{kind}/{name} not in deploy/"
    return d


def _first_container(docs, kind, name):
    return containers(_doc(docs, kind, name))[0]


def _set_env(c, name, value):
    for e in c["env"]:
        if e["name"] == name:
            e.clear()
            e.update({"name": name, "value": value})
            return
    c["env"].append({"name": name, "value": value})


def _pod_reader_rbac() -> list[Doc]:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "timeslice-nodeagent"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "timeslice-nodeagent"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "timeslice-nodeagent"},
               "subjects": [{"kind": "ServiceAccount", "name": "nodeagent", "namespace": "timeslice"}]}
    return [Doc("rbac.yaml", 90, role), Doc("rbac.yaml", 91, binding)]


def _etcd_env(docs):
    return _first_container(docs, "StatefulSet", "etcd")


# (description, mutation of a deep copy of DOCS, check, (kind, name) of the subject)
MUTATIONS = [
    ("no apiVersion", lambda ds: _doc(ds, "Service", "lockd").body.pop("apiVersion"),
     check_identity, ("Service", "lockd")),
    ("wrong apiVersion", lambda ds: _doc(ds, "DeviceClass", "timeslice-gpu").body.update(apiVersion="resource.k8s.io/v1alpha3"),
     check_identity, ("DeviceClass", "timeslice-gpu")),
    ("no namespace", lambda ds: _doc(ds, "Deployment", "lockd").body["metadata"].pop("namespace"),
     check_identity, ("Deployment", "lockd")),
    ("selector off template", lambda ds: pod_labels(_doc(ds, "Deployment", "lockd")).update({"app.kubernetes.io/name": "x"}),
     check_workload_selector, ("Deployment", "lockd")),
    ("service selects nothing", lambda ds: _doc(ds, "Service", "lockd").body["spec"]["selector"].update({"app.kubernetes.io/name": "lockdd"}),
     check_service, ("Service", "lockd")),
    ("service selects two workloads", lambda ds: _doc(ds, "Service", "lockd").body["spec"].update(
        selector={"app.kubernetes.io/part-of": "timeslice"}), check_service, ("Service", "lockd")),
    ("service targetPort unknown", lambda ds: _doc(ds, "Service", "etcd").body["spec"]["ports"][0].update(targetPort="clients"),
     check_service, ("Service", "etcd")),
    ("pdb selects nothing", lambda ds: _doc(ds, "PodDisruptionBudget", "lockd").body["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/name": "nope"}), check_pdb, ("PodDisruptionBudget", "lockd")),
    ("pdb blocks drains", lambda ds: _doc(ds, "PodDisruptionBudget", "lockd").body["spec"].update(minAvailable=3),
     check_pdb, ("PodDisruptionBudget", "lockd")),
    ("lockd container port", lambda ds: _first_container(ds, "Deployment", "lockd")["ports"][0].update(containerPort=50055),
     check_component_ports, ("Deployment", "lockd")),
    ("lockd probe port", lambda ds: _first_container(ds, "Deployment", "lockd")["readinessProbe"]["grpc"].update(port=50052),
     check_component_ports, ("Deployment", "lockd")),
    ("lockd probe service", lambda ds: _first_container(ds, "Deployment", "lockd")["livenessProbe"]["grpc"].update(service="x"),
     check_component_ports, ("Deployment", "lockd")),
    ("lockd --listen", lambda ds: _first_container(ds, "Deployment", "lockd").update(args=["serve", "--listen=0.0.0.0:1", "--metrics-port=9464"]),
     check_component_ports, ("Deployment", "lockd")),
    ("nodeagent metrics port", lambda ds: _first_container(ds, "DaemonSet", "nodeagent")["ports"][1].update(containerPort=9464),
     check_component_ports, ("DaemonSet", "nodeagent")),
    ("nodeagent service port", lambda ds: _doc(ds, "Service", "nodeagent").body["spec"]["ports"][0].update(port=50051),
     check_component_ports, ("DaemonSet", "nodeagent")),
    ("scrape annotation port", lambda ds: pod_annotations(_doc(ds, "StatefulSet", "etcd")).update({"prometheus.io/port": "1"}),
     check_prometheus_annotation, ("StatefulSet", "etcd")),
    ("unknown TIMESLICE_ variable", lambda ds: _set_env(_first_container(ds, "Deployment", "lockd"), "TIMESLICE_ETCD_ENDPOINT", "x"),
     check_env, ("Deployment", "lockd")),
    ("foreign variable in our container", lambda ds: _set_env(_first_container(ds, "DaemonSet", "nodeagent"), "NODE_NAME", "x"),
     check_env, ("DaemonSet", "nodeagent")),
    ("arg refers to undefined variable", lambda ds: _first_container(ds, "DaemonSet", "nodeagent")["args"].append("--x=$(NODE_NAME)"),
     check_env, ("DaemonSet", "nodeagent")),
    ("configmap prefix", lambda ds: _doc(ds, "ConfigMap", "timeslice-config").body["data"].update(TIMESLICE_PREFIX="/ts/"),
     check_configmap, ("ConfigMap", "timeslice-config")),
    ("etcd member missing", lambda ds: _set_env(_etcd_env(ds), "ETCD_INITIAL_CLUSTER",
        ",".join(str(env_map(_etcd_env(ds))["ETCD_INITIAL_CLUSTER"]["value"]).split(",")[:2])),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("etcd replicas off", lambda ds: _doc(ds, "StatefulSet", "etcd").body["spec"].update(replicas=5),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("etcd wrong headless name", lambda ds: _doc(ds, "StatefulSet", "etcd").body["spec"].update(serviceName="etcd"),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("etcd url typo", lambda ds: _set_env(_etcd_env(ds), "ETCD_INITIAL_CLUSTER",
        str(env_map(_etcd_env(ds))["ETCD_INITIAL_CLUSTER"]["value"]).replace("etcd-1.etcd-peer", "etcd-1.etcd-peers")),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("etcd ordered start", lambda ds: _doc(ds, "StatefulSet", "etcd").body["spec"].pop("podManagementPolicy"),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("etcd gets service links", lambda ds: pod_spec(_doc(ds, "StatefulSet", "etcd")).pop("enableServiceLinks"),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("etcd data off the volume", lambda ds: _set_env(_etcd_env(ds), "ETCD_DATA_DIR", "/data"),
     check_etcd_cluster, ("StatefulSet", "etcd")),
    ("endpoints name a non-member", lambda ds: _doc(ds, "ConfigMap", "timeslice-config").body["data"].update(
        TIMESLICE_ETCD_ENDPOINTS="etcd-0.etcd-peer:2379,etcd-1.etcd-peer:2379,etcd-3.etcd-peer:2379"),
     check_etcd_endpoints, ("ConfigMap", "timeslice-config")),
    ("lockd two replicas", lambda ds: _doc(ds, "Deployment", "lockd").body["spec"].update(replicas=2),
     check_lockd, ("Deployment", "lockd")),
    ("lockd preferred anti-affinity", lambda ds: pod_spec(_doc(ds, "Deployment", "lockd"))["affinity"]["podAntiAffinity"].update(
        preferredDuringSchedulingIgnoredDuringExecution=pod_spec(_doc(ds, "Deployment", "lockd"))["affinity"]["podAntiAffinity"].pop(
            "requiredDuringSchedulingIgnoredDuringExecution")),
     check_lockd, ("Deployment", "lockd")),
    ("lockd replica id not the pod name", lambda ds: _set_env(_first_container(ds, "Deployment", "lockd"), "TIMESLICE_REPLICA_ID", "a"),
     check_lockd, ("Deployment", "lockd")),
    ("lockd without PDB", lambda ds: ds.remove(_doc(ds, "PodDisruptionBudget", "lockd")),
     check_lockd, ("Deployment", "lockd")),
    ("nodeagent without hostPID", lambda ds: pod_spec(_doc(ds, "DaemonSet", "nodeagent")).pop("hostPID"),
     check_nodeagent, ("DaemonSet", "nodeagent")),
    ("nodeagent unprivileged", lambda ds: _first_container(ds, "DaemonSet", "nodeagent")["securityContext"].update(privileged=False),
     check_nodeagent, ("DaemonSet", "nodeagent")),
    ("nodeagent node name", lambda ds: _set_env(_first_container(ds, "DaemonSet", "nodeagent"), "TIMESLICE_NODE_NAME", "n"),
     check_nodeagent, ("DaemonSet", "nodeagent")),
    ("nodeagent mounts host /proc", lambda ds: pod_spec(_doc(ds, "DaemonSet", "nodeagent"))["volumes"].append(
        {"name": "host-proc", "hostPath": {"path": "/proc"}}), check_nodeagent, ("DaemonSet", "nodeagent")),
    ("nodeagent may read pods", lambda ds: ds.extend(_pod_reader_rbac()), check_nodeagent, ("DaemonSet", "nodeagent")),
    ("nodeagent token mounted", lambda ds: pod_spec(_doc(ds, "DaemonSet", "nodeagent")).pop("automountServiceAccountToken"),
     check_nodeagent, ("DaemonSet", "nodeagent")),

    ("registry host in image", lambda ds: _first_container(ds, "StatefulSet", "etcd").update(image="registry.example:5000/etcd:3.5.17"),
     check_images, ("StatefulSet", "etcd")),
    ("image tag differs from defaults", lambda ds: _first_container(ds, "Deployment", "lockd").update(image="timeslice:9.9"),
     check_images, ("Deployment", "lockd")),
    ("claim names a missing class", lambda ds: _doc(ds, "ResourceClaim", "tsgroup-trainer-group").body["spec"]["devices"]["requests"][0]
        ["exactly"].update(deviceClassName="nope"), check_dra_request, ("ResourceClaim", "tsgroup-trainer-group")),
    ("deviceclass selects another driver", lambda ds: _doc(ds, "DeviceClass", "timeslice-gpu").body["spec"]["selectors"][0]["cel"].update(
        expression='device.driver == "gpu.example.com"'), check_deviceclass, ("DeviceClass", "timeslice-gpu")),
    ("pod claim refers to a missing claim", lambda ds: pod_spec(_doc(ds, "Job", "rl-job-a"))["resourceClaims"][0].update(resourceClaimName="x"),
     check_pod_claims, ("Job", "rl-job-a")),
    ("claim used by one job only", lambda ds: pod_spec(_doc(ds, "Job", "rl-job-b"))["resourceClaims"][0].update(resourceClaimName="x"),
     check_shared_claim, ("ResourceClaim", "tsgroup-trainer-group")),
]


@pytest.mark.parametrize("what, mutate, check, subject", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_check_catches(what, mutate, check, subject):
    docs = copy.deepcopy(DOCS)
    assert check(_doc(docs, *subject), docs) == [], f"{check.__name__} must pass before the mutation"
    mutate(docs)
    assert check(_doc(docs, *subject), docs), f"{check.__name__} did not notice: {what}"


def test_rbac_binding_check_catches():
    docs = copy.deepcopy(DOCS) + _pod_reader_rbac()
    binding = _doc(docs, "ClusterRoleBinding", "timeslice-nodeagent")
    assert check_rbac_binding(binding, docs) == []
    binding.body["roleRef"]["name"] = "x"
    assert check_rbac_binding(binding, docs)


def test_kustomize_check_catches(tmp_path):
    broken = tmp_path / "deploy"
    shutil.copytree(DEPLOY, broken)
    assert kustomize_problems(broken) == []
    (broken / "lockd" / "extra.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert any("extra.yaml" in p for p in kustomize_problems(broken))
    (broken / "lockd" / "extra.yaml").unlink()
    k = broken / "kustomization.yaml"
    k.write_text(k.read_text().replace("  - lockd/pdb.yaml\n", ""))
    assert any("lockd/pdb.yaml" in p for p in kustomize_problems(broken))


def test_dockerfile_check_catches():
    text, ignore = DOCKERFILE.read_text(), DOCKERIGNORE.read_text()
    scripts, progs = console_scripts(), manifest_programs()
    assert dockerfile_problems(text, ignore, scripts, progs) == []
    assert dockerfile_problems(text.replace("nodeagent timeslice;", "timeslice;"), ignore, scripts, progs)
    assert dockerfile_problems(text, ignore, scripts - {"lockd"}, progs)
    assert dockerfile_problems(text, ignore, scripts, progs | {"lockd-server"})
    assert dockerfile_problems(text.replace("FROM python:3.12-slim\n", "FROM registry.example.org/python:3.12-slim\n"), ignore, scripts, progs)
    assert dockerfile_problems(text, ignore.replace("!proto/\n", ""), scripts, progs)
    assert dockerfile_problems(text.replace("COPY proto/ proto/\n", ""), ignore, scripts, progs)
    assert dockerfile_problems(text.replace("USER 10001:10001", "USER root"), ignore, scripts, progs)


def test_local_env_check_catches():
    good = parse_env_file(LOCAL_ENV.read_text())
    assert local_env_problems(good) == []
    for key, bad in (("ETCD_MEMBERS", "2"), ("LOCKD_REPLICAS", "1"), ("LOCKD_PORT", "x"),
                     ("NODEAGENT_PORT", "70000"), ("PREFIX", "/t/"), ("BACKEND", "gpu"),
                     ("GROUP_SHARING", "shared")):
        assert local_env_problems({**good, key: bad}), f"{key}={bad} not noticed"
    with pytest.raises(ValueError):
        parse_env_file("LOCKD_REPLICAS=3\nLOCKD_REPLICAS=4\n")


def test_registry_host_check_catches():
    assert registry_hosts_in_text("    image: registry.example.org/coreos/etcd:v3.5.17\n")
    assert registry_hosts_in_text("FROM registry.example:5000/python:3.12-slim\n")
    assert registry_hosts_in_text("docker push registry.example.org/timeslice:0.1.0\n")
    assert not registry_hosts_in_text("docker push <your-registry>/timeslice:0.1.0\n    image: etcd:3.5.17\n")
    assert image_parts("registry.example:5000/etcd:3.5.17")[0] == "registry.example:5000"
    assert image_parts("localhost/timeslice:0.1.0")[0] == "localhost"
    assert image_parts("etcd:3.5.17") == (None, "etcd")
    assert image_parts("library/etcd:3.5.17") == (None, "library/etcd")
