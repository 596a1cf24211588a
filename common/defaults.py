"""Defaults shared by every component, in one place.

The deploy manifests, the local launcher and the code all read these; a test
(tests/test_deploy_manifests.py) checks that the manifests agree with them.
"""

# etcd
ETCD_ENDPOINTS = "127.0.0.1:2379"   # comma-separated host:port list
KEY_PREFIX = "/timeslice/"          # every key of the system lives below this

# lockd
LOCKD_PORT = 50051                  # gRPC API (Acquire, Yield, ...)
LOCKD_METRICS_PORT = 9464           # Prometheus /metrics
LOCKD_TARGET = f"127.0.0.1:{LOCKD_PORT}"  # client default when TIMESLICE_TARGET is unset

# nodeagent
NODEAGENT_PORT = 50052              # direct gRPC API (Snapshot, Restore, ...)
NODEAGENT_METRICS_PORT = 9465

# Environment variables (documented in the README).
ENV_TARGET = "TIMESLICE_TARGET"           # client: lockd address(es), comma-separated
ENV_JOB_ID = "TIMESLICE_JOB_ID"           # client: this job's id
ENV_SLURM_JOB_ID = "SLURM_JOB_ID"         # client: the job id when TIMESLICE_JOB_ID is unset (set by Slurm)
ENV_ETCD_ENDPOINTS = "TIMESLICE_ETCD_ENDPOINTS"
ENV_PREFIX = "TIMESLICE_PREFIX"
ENV_NODE_NAME = "TIMESLICE_NODE_NAME"     # nodeagent + client worker registration
ENV_ADMIN_TOKEN_FILE = "TIMESLICE_ADMIN_TOKEN_FILE"   # lockd, nodeagent, CLI: the admin bearer token (mode 0400/0600)
ENV_AGENT_SOCKET = "TIMESLICE_AGENT_SOCKET"   # client + nodeagent: the node-local channel (timeslice.common.channel)
# client integrations: "0" leaves torch's allocator uncapped while holding a fit group's grant (default on)
ENV_ALLOCATOR_CAP = "TIMESLICE_ALLOCATOR_CAP"
ENV_TENANTS_FILE = "TIMESLICE_TENANTS_FILE"   # lockd: which credentials name which tenant (lockd/callers.py)
ENV_TENANT_TOKEN_FILE = "TIMESLICE_TENANT_TOKEN_FILE"   # client: the job's tenant token (timeslice.auth)
ENV_ETCD_USER = "TIMESLICE_ETCD_USER"
ENV_ETCD_PASSWORD = "TIMESLICE_ETCD_PASSWORD"
ENV_ETCD_PASSWORD_FILE = "TIMESLICE_ETCD_PASSWORD_FILE"   # a file holding it (per-node agent secrets)
ENV_ETCD_CA = "TIMESLICE_ETCD_CA"
ENV_ETCD_CERT = "TIMESLICE_ETCD_CERT"
ENV_ETCD_KEY = "TIMESLICE_ETCD_KEY"

# Container image name used by deploy/ (no registry host: operators prefix their own).
IMAGE = "timeslice:0.1.0"
