"""A real OpenID provider for the tests: panva's `oidc-provider` (pinned in idp/package.json,
installed by `./bootstrap test` with `npm ci`) on Node 22 from the `node` npm package, serving
HTTPS on 127.0.0.1 with a certificate from a test CA, as an enterprise IdP behind a customer CA.

Tokens come from it the way applications get them: client credentials, and the authorization
code flow with PKCE through its login page. It can be stopped (the IdP is down), started again
on the same port (same issuer), and restarted with other signing keys (key rotation).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import secrets
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

IDP_DIR = Path(__file__).resolve().parent / "idp"
NODE = IDP_DIR / "node_modules" / ".bin" / "node"

AUDIENCE = "urn:inferno:appliance"
"""The resource indicator whose tokens the IdP issues as JWTs; also the console's client_id, as
with a Keycloak client that is both (so its ID tokens name the same audience)."""


def node_available() -> bool:
    return NODE.exists()


@dataclass(frozen=True)
class IdpCa:
    cert_file: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, directory: Path) -> IdpCa:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Inferno test customer CA")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        cert_file = directory / "ca.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(cert_file, key, cert)

    def issue_server_certificate(self, directory: Path) -> tuple[Path, Path]:
        """A certificate for 127.0.0.1 signed by this CA: (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_file, key_file = directory / "idp-cert.pem", directory / "idp-key.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_file, key_file


def signing_key(kid: str) -> dict[str, Any]:
    """A fresh ES256 private JWK."""
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1())))
    return {**jwk, "kid": kid, "alg": "ES256", "use": "sig"}


def private_key(jwk: dict[str, Any]) -> ec.EllipticCurvePrivateKey:
    key = jwt.algorithms.ECAlgorithm.from_jwk(jwk)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


@dataclass
class OidcProvider:
    """One oidc-provider process (see the module docstring)."""

    directory: Path
    ca: IdpCa
    keys: list[dict[str, Any]]
    clients: list[dict[str, Any]]
    client_claims: dict[str, dict[str, Any]]
    users: dict[str, dict[str, Any]]
    port: int = 0
    issuer: str = ""
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> None:
        assert self.process is None, "already running"
        cert, key = self.ca.issue_server_certificate(self.directory)
        config = self.directory / "idp.json"
        config.write_text(
            json.dumps(
                {
                    "port": self.port,
                    "cert": str(cert),
                    "key": str(key),
                    "jwks": {"keys": self.keys},
                    "audience": AUDIENCE,
                    "clients": self.clients,
                    "clientClaims": self.client_claims,
                    "users": self.users,
                }
            )
        )
        self.process = subprocess.Popen(
            [str(NODE), str(IDP_DIR / "provider.mjs"), str(config)],
            stdout=subprocess.PIPE, text=True, cwd=IDP_DIR,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the OpenID provider did not start (status {self.process.wait()})")
        self.issuer = json.loads(line)["issuer"]
        self.port = int(self.issuer.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            assert self.process.stdout is not None
            self.process.stdout.close()
            self.process = None

    def rotate(self, new_key: dict[str, Any]) -> None:
        """Restart signing with `new_key`, still publishing the old keys (a rotation)."""
        self.stop()
        self.keys = [new_key, *self.keys]
        self.start()

    def http(self) -> httpx.Client:
        return httpx.Client(verify=ssl.create_default_context(cafile=self.ca.cert_file), timeout=10)

    def client_credentials_token(self, client_id: str, secret: str) -> str:
        with self.http() as http:
            response = http.post(
                f"{self.issuer}/token",
                data={"grant_type": "client_credentials", "scope": "api"},
                auth=(client_id, secret),
            )
        response.raise_for_status()
        return response.json()["access_token"]


def log_in(http: httpx.Client, authorization_url: str, login: str, password: str) -> httpx.Response:
    """Follow `authorization_url` through the IdP's login page as a browser would, signing in
    as `login`; return the response that leaves the IdP (the redirect to the client)."""
    idp_origin = httpx.URL(authorization_url).copy_with(path="/", query=None)
    response = http.get(authorization_url)
    while response.is_redirect and "/interaction/" in response.headers["location"]:
        response = http.get(response.url.join(response.headers["location"]))
    assert response.status_code == 200, response.text
    action = response.text.split('action="', 1)[1].split('"', 1)[0]
    response = http.post(response.url.join(action), data={"login": login, "password": password})
    # After the login the IdP resumes, asks for consent (granted at once), then redirects.
    while response.is_redirect:
        location = response.url.join(response.headers["location"])
        if not str(location).startswith(str(idp_origin)):
            return response
        response = http.get(location)
    raise AssertionError(f"the IdP did not redirect back: {response.status_code} {response.text}")


def authorization_code_tokens(
    idp: OidcProvider, client_id: str, secret: str, redirect_uri: str, login: str, password: str
) -> dict[str, Any]:
    """The token response of an authorization code flow with PKCE, run as a client would,
    signing in as `login` (for tests that need an ID token of the IdP)."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    query = {"client_id": client_id, "response_type": "code", "scope": "openid",
             "redirect_uri": redirect_uri, "state": "s", "nonce": "n",
             "code_challenge": challenge.decode(), "code_challenge_method": "S256"}  # fmt: skip
    with idp.http() as http:
        url = str(httpx.URL(f"{idp.issuer}/auth", params=query))
        back = log_in(http, url, login, password)
        code = httpx.URL(back.headers["location"]).params["code"]
        response = http.post(
            f"{idp.issuer}/token",
            data={"grant_type": "authorization_code", "code": code, "client_id": client_id,
                  "client_secret": secret, "redirect_uri": redirect_uri, "code_verifier": verifier},
        )  # fmt: skip
    response.raise_for_status()
    return response.json()
