# syntax=docker/dockerfile:1
# One image for every gpushare entry point: `docker run IMAGE extender --port 12345`, `... binder`,
# `... accounting`, `... node-agent`, `... migrate`, `... inspect`, `... ledger rebuild`.
# Slim, non-root (uid 10001), no writes outside /tmp at run time (readOnlyRootFilesystem: true works;
# mount an emptyDir on /tmp).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gpushare
ENV PATH=/opt/gpushare/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY migrations ./migrations
RUN pip install --upgrade pip && pip install .
# Compile the kubelet gRPC stubs into the installed package (generated code is never committed); run from /
# so that the installed copy, not /src, is the one imported and written to.
RUN cd / && python -m shared.kubelet_api --force \
 && python -c "import shared.kubelet_api.deviceplugin_pb2, shared.kubelet_api.podresources_pb2"
# Byte-compile once at build time: the root filesystem is read-only at run time.
RUN python -m compileall -q /opt/gpushare/lib

FROM python:3.11-slim
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
