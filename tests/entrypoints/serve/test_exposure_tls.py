"""A real `jpaged serve` run for others: TLS with a self-signed certificate made here, the API key
from $JPAGED_API_KEY, behind a root path, with a small body bound; checked with httpx and the
official `openai` client."""

from __future__ import annotations

import datetime
import ipaddress
import ssl

import httpx
import openai
import pytest

from tests.helpers.server import MODEL, running_server

x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed (it makes the certificate)")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

KEY = "test-key-7f3a"
BODY_LIMIT = 64 * 1024


def self_signed(directory) -> tuple:
    """A key and a self-signed certificate for 127.0.0.1 / localhost, valid for a day; their paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jpaged test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    key_path, cert_path = self_signed(directory)
    trust = ssl.create_default_context(cafile=str(cert_path))
    with running_server(directory, "--ssl-keyfile", str(key_path), "--ssl-certfile", str(cert_path),
                        "--root-path", "/jpaged", "--max-request-body-bytes", str(BODY_LIMIT),
                        env={"JPAGED_API_KEY": KEY}, verify=trust) as server:
        yield server


def test_https_with_the_key_from_the_environment(tls_server):
    url, trust = tls_server.base_url, tls_server.verify
    assert url.startswith("https://")
    with httpx.Client(verify=trust, timeout=60) as client:
        assert client.get(url + "/health").status_code == 200  # open: load balancers call it
        assert client.get(url + "/metrics").status_code == 200
        refused = client.get(url + "/v1/models")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert client.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.post(url + "/tokenize", json={"prompt": "x"},
                           headers={"Authorization": f"Bearer {KEY}"}).json()["count"] > 0
        # --root-path: the schema names the prefix a proxy strips; routes answer without it.
        assert client.get(url + "/openapi.json").json()["servers"] == [{"url": "/jpaged"}]
    with httpx.Client(timeout=10) as untrusting:  # the certificate is checked: it is really TLS
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.get(url + "/health")
    with pytest.raises(httpx.HTTPError):  # plain http to the TLS port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    http_client = httpx.Client(verify=trust, timeout=60)
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=http_client)
    answer = good.completions.create(model=MODEL, prompt="import os", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, http_client=http_client)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="import os", max_tokens=4)


def test_uvicorn_refuses_a_body_past_the_bound(tls_server):
    url, headers = tls_server.base_url, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'", "max_tokens": 1}'

    def chunked():
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    with httpx.Client(verify=tls_server.verify, timeout=60) as client:
        declared = client.post(url + "/v1/completions", content=big, headers=headers)
        assert declared.status_code == 413 and declared.json()["error"]["code"] == 413
        streamed = client.post(url + "/v1/completions", content=chunked(), headers=headers)
        assert streamed.status_code == 413, streamed.text
        assert client.get(url + "/health").status_code == 200
        ok = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=headers)
        assert ok.status_code == 200, ok.text
