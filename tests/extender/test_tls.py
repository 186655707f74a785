"""The extender serves HTTPS when given a certificate (kube-scheduler's `enableHTTPS`)."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from devstack.embedded import free_port
from shared.events.bus import BusNames
from tests.extender.test_replicas_race import tail


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_extender_serves_tls_with_the_given_certificate(
    tmp_path: Path, database_url: str, nats_url: str, bus_names: BusNames
) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    log = tmp_path / "extender.log"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "extender",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--database-url",
        database_url,
        "--nats-url",
        nats_url,
        "--stream-name",
        bus_names.stream,
        "--subject-prefix",
        bus_names.prefix,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))  # noqa: ASYNC220
    try:
        response = None
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cert)), timeout=2) as client:
            # until it answers as the started service (while it waits for its servers it answers role `starting`)
            while time.monotonic() < deadline:
                assert proc.poll() is None, f"extender exited:\n{tail(log)}"
                try:
                    response = await client.get(f"https://127.0.0.1:{port}/healthz")
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)
                    continue
                if response.json().get("role") != "starting":
                    break
                await asyncio.sleep(0.2)
        assert response is not None, f"extender never answered over TLS:\n{tail(log)}"
        assert response.status_code == 200 and response.json() == {"status": "ok", "role": "active"}
        async with httpx.AsyncClient(timeout=2) as plain:
            refused = False
            try:
                await plain.get(f"http://127.0.0.1:{port}/healthz")
            except httpx.HTTPError:
                refused = True
            assert refused, "plain HTTP must not be answered on the TLS port"
    finally:
        proc.terminate()
        proc.wait(10)


def test_tls_flags_must_come_in_pairs() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "extender",
            "--tls-cert",
            "x.crt",
            "--database-url",
            "postgresql://u@h/d",
            "--nats-url",
            "nats://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--tls-cert and --tls-key go together" in result.stderr
