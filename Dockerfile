# The one image for every timeslice component: lockd, nodeagent and the
# timeslice CLI are console scripts of the same package.
#
#   docker build -t timeslice:0.1.0 .
#
# Kubernetes picks the program with `command:` (deploy/); lockd runs as the
# non-root user below, nodeagent overrides it with root + privileged in its
# DaemonSet. No CUDA in the image: the NVIDIA container runtime injects the
# host driver's libcuda.so.1 and libnvidia-ml.so.1 into the nodeagent pod.
# A `cuda-checkpoint` binary, for that backend, is added by a derived image.

# --- build: turn the source tree and its dependencies into wheels ----------
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY client/ client/
COPY common/ common/
COPY testing/ testing/
COPY proto/ proto/
COPY launcher/ launcher/
COPY lockd/ lockd/
COPY nodeagent/ nodeagent/
# lockd and the node agent need the `server` extra (a plain `timeslice` is the lean job client)
RUN pip wheel --wheel-dir /wheels ".[server]"

# --- runtime ---------------------------------------------------------------
FROM python:3.12-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Installs only from the wheels built above (nothing is fetched here), then
# fails the build if an entry point is missing, then adds lockd's user.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "timeslice[server]" \
 && for program in lockd nodeagent timeslice; do command -v "$program"; done \
 && groupadd --system --gid 10001 timeslice \
 && useradd --system --uid 10001 --gid timeslice --no-create-home --shell /usr/sbin/nologin timeslice

USER 10001:10001
EXPOSE 50051 9464 50052 9465
CMD ["lockd", "serve"]
