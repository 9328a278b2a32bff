"""`sidecar status --url https://...` through a proxy like the shipped kube-rbac-proxy: TLS with a
certificate of a private CA (made by the `openssl` CLI), a bearer token required, and only then
the real sidecar's `/v1/status` forwarded."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.ops.helpers import Rank, run_cli
from tests.support import Sidecar, wait_until

TOKEN = "s3cret-token"


def make_ca_and_server_cert(directory: Path) -> tuple[Path, Path, Path]:
    """(the CA's certificate, the server's certificate, the server's key): the server's for
    127.0.0.1 and localhost, signed by the CA."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca_usage = ("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", "-x509", *ec, *ca_usage, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test CA")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "server.ext")  # fmt: skip
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"


class _Proxy(BaseHTTPRequestHandler):
    """Forwards GET /v1/status to the sidecar when the request carries the bearer token; 401
    otherwise (kube-rbac-proxy's answer to a request without a valid token)."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}" or self.path != "/v1/status":
            body, code = b"Unauthorized\n", 401
        else:
            upstream = urlsplit(self.server.upstream)
            conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=10)
            try:
                conn.request("GET", self.path)
                resp = conn.getresponse()
                body, code = resp.read(), resp.status
            finally:
                conn.close()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> Iterator[tuple[str, Path, Path]]:
    """(the proxy's https URL, the CA's certificate, a file holding the token) in front of a live
    sidecar with one rank of job run-9."""
    work = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_ca_and_server_cert(work)
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    sidecar = Sidecar(work / "sidecar").start()
    rank = Rank(sidecar, "run-9", 0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    try:
        rank.push_step()
        wait_until(lambda: sidecar.status()["ranks"], 30, what="the rank registered")
        server.upstream = sidecar.url
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"https://127.0.0.1:{server.server_address[1]}", ca, token_file
    finally:
        server.shutdown()
        server.server_close()
        rank.close()
        sidecar.stop()


def test_status_reads_the_sidecar_through_a_tls_proxy_with_the_token_and_the_ca(proxy):
    url, ca, token_file = proxy
    out = run_cli("status", "--url", url, "--token-file", str(token_file), "--cacert", str(ca), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["target"] == url
    assert [(r["job_id"], r["rank"]) for r in doc["status"]["ranks"]] == [("run-9", 0)]


def test_without_the_token_the_proxy_refuses_and_status_says_to_give_one(proxy):
    url, ca, _ = proxy
    out = run_cli("status", "--url", url, "--cacert", str(ca))
    assert out.returncode == 2
    assert f"GET /v1/status at {url} answered HTTP 401" in out.stderr
    assert "--token-file" in out.stderr


def test_without_the_ca_the_proxys_certificate_is_not_trusted(proxy):
    url, _, token_file = proxy
    out = run_cli("status", "--url", url, "--token-file", str(token_file))
    assert out.returncode == 2
    assert "TLS certificate not trusted" in out.stderr and "--cacert" in out.stderr


def test_cacert_with_the_socket_is_refused_naming_the_flags(tmp_path):
    out = run_cli("status", "--socket", str(tmp_path / "s.sock"), "--cacert", str(tmp_path / "ca.pem"))
    assert out.returncode == 2
    assert "--token-file and --cacert go with --url" in out.stderr
