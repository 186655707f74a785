"""Kubernetes API clients from a kubeconfig file or the in-cluster service account."""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes_asyncio import client, config
from kubernetes_asyncio.config.config_exception import ConfigException


async def api_client(kubeconfig: str | None = None, *, context: str | None = None) -> client.ApiClient:
    """An `ApiClient` for `kubeconfig` (default: $KUBECONFIG, then in-cluster, then ~/.kube/config).

    `context` picks a kubeconfig context other than the current one. Raises `ConfigException` with a message
    naming what was tried when nothing works.
    """
    path = kubeconfig or os.environ.get("KUBECONFIG")
    configuration = client.Configuration()
    if path:
        await config.load_kube_config(config_file=path, context=context, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            default = Path.home() / ".kube" / "config"
            if not default.exists():
                raise ConfigException(
                    "no Kubernetes configuration: set KUBECONFIG, run in a cluster, or create ~/.kube/config"
                ) from None
            await config.load_kube_config(config_file=str(default), context=context, client_configuration=configuration)
    # kubernetes_asyncio reads bearer tokens from the `BearerToken` key in some versions and from
    # `authorization` in others; make both present.
    token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
    if token:
        configuration.api_key["authorization"] = token
        configuration.api_key["BearerToken"] = token
    api = client.ApiClient(configuration)
    skip_environment_lookups(api)
    return api


PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "ws_proxy", "wss_proxy")


def skip_environment_lookups(api: client.ApiClient) -> None:
    """Turn off aiohttp's `trust_env` when there is nothing in the environment to trust.

    kubernetes_asyncio always creates its session with `trust_env=True`, which makes aiohttp read ~/.netrc
    in a worker thread on every request: most of the binder's CPU per binding went there. Proxy variables
    or a netrc file keep the lookups on.
    """
    if any(os.environ.get(v) or os.environ.get(v.upper()) for v in PROXY_VARIABLES):
        return
    netrc = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    if Path(netrc).exists():
        return
    session = getattr(getattr(api, "rest_client", None), "pool_manager", None)
    if session is not None and hasattr(session, "_trust_env"):
        session._trust_env = False


def user_kubeconfig(explicit: str | None = None) -> str | None:
    """The kubeconfig a user's command reads, in kubectl's order: `explicit` (--kubeconfig), $KUBECONFIG, then
    ~/.kube/config when it exists; None when there is none (only the in-cluster configuration remains)."""
    if explicit or os.environ.get("KUBECONFIG"):
        return explicit or os.environ["KUBECONFIG"]
    default = Path.home() / ".kube" / "config"
    return str(default) if default.exists() else None


def kubeconfig_exists(path: str) -> bool:
    """Whether any file of a kubeconfig path list (`a:b`, as in $KUBECONFIG) exists."""
    return any(os.path.exists(os.path.expanduser(p)) for p in path.split(os.pathsep) if p)
