"""End to end: the attested TLS channel, as an application team checks it.

A real appliance (uvicorn with TLS on a loopback socket, the TEE gate over the synthetic GPUs and
SEV-SNP guest of tests/appliance/attestation/synthetic_tee.py, the embedded SmolLM2) and, in
front of it, a relay on loopback that can do two things: terminate TLS with a certificate of its
own, which the client trusts, and forward the plaintext to the appliance (the attack: a
TLS-terminating proxy that relays the real appliance's attestation and reads every prompt), or
forward the bytes as they are (TLS end to end; then it is a plain TCP hop).

Shown: `python -m attestation verify-appliance` passes a direct connection and refuses the
relay, naming the channel; without a policy it reports what it saw and exits 1 (an insecure-dev
demo: UNVERIFIED); with `--attested-key-only` the attestation alone authenticates the key. The
`openai` client over `AttestedTransport` (and `AsyncOpenAI` over `AsyncAttestedTransport`)
completes a chat directly; pointed at the relay it sends no request (the relay saw only the
attestation's GET); a relay that turns from TCP hop into a terminating proxy after the
attestation gets a connection that is closed before a byte of the request. A changed TLS key,
a replayed nonce and an expired verdict fail, each with its own check. Each response names the
standing verdict, and so does each inference audit entry.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from cryptography.x509.oid import NameOID

from appliance.attestation.devices import EvidenceCollection, OfflineVerifier
from appliance.attestation.service import TeeService
from appliance.auth.roles import Role
from appliance.config import Settings, settings_from_mapping
from appliance.tls import certificate_spki_sha256
from attestation.remote.async_transport import AsyncAttestedTransport
from attestation.remote.connection import AttestationAnswer, fetch_attestation
from attestation.remote.errors import ApplianceNotTrustedError, ChannelMismatchError
from attestation.remote.policy import AppliancePolicy
from attestation.remote.transport import AttestedTransport
from attestation.remote.trust import ApplianceTrust
from attestation.remote.verify import verify_appliance
from tests.appliance.api.conftest import RunningServer, make_settings, running_server
from tests.appliance.attestation.synthetic_tee import SyntheticCpu, SyntheticGpus, write_policy
from tests.attestation.cpu.synthetic import SyntheticSnp
from tests.attestation.gpu.synthetic import SyntheticGpuSetup, synthetic_gpu_setup

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECRET_PROMPT = "The merger with Quokka Ltd closes on the 14th."


class Relay:
    """A relay on a loopback port in front of `upstream_port`, in its own event loop thread.

    `mode` is read as each connection is accepted: "terminate" answers TLS with the relay's own
    certificate, opens TLS to the appliance (verifying it, as a proxy would) and records every
    plaintext byte a client sent (`from_clients`); "tcp" forwards the bytes as they are."""

    def __init__(self, upstream_port: int, cert_file: Path, key_file: Path, upstream_ca: Path):
        self.upstream_port = upstream_port
        self.mode = "terminate"
        self.from_clients = bytearray()
        self.num_connections = 0
        self._server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_tls.load_cert_chain(cert_file, key_file)
        self._upstream_tls = ssl.create_default_context(cafile=upstream_ca)
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(10)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def drop_connections(self) -> None:
        """Close every open connection (as a re-route would end them)."""

        def close_all() -> None:
            for writer in list(self._writers):
                writer.close()

        self._loop.call_soon_threadsafe(close_all)
        time.sleep(0.2)

    def close(self) -> None:
        self.drop_connections()
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        terminate = self.mode == "terminate"
        self._writers.add(writer)
        try:
            if terminate:
                await writer.start_tls(self._server_tls)
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1",
                self.upstream_port,
                ssl=self._upstream_tls if terminate else None,
                server_hostname="127.0.0.1" if terminate else None,
            )
            self._writers.add(up_writer)
            await asyncio.gather(
                self._pipe(reader, up_writer, record=terminate), self._pipe(up_reader, writer)
            )
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass  # a client that hung up, or refused the relay's certificate
        finally:
            writer.close()

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, record: bool = False
    ) -> None:
        try:
            while data := await source.read(65536):
                if record:
                    self.from_clients.extend(data)
                sink.write(data)
                await sink.drain()
        except (OSError, ssl.SSLError):
            pass
        finally:
            sink.close()


@dataclass(frozen=True)
class Setup:
    server: RunningServer
    tee: TeeService
    gpus: SyntheticGpuSetup
    snp: SyntheticSnp
    relay: Relay
    client_tls: ssl.SSLContext  # trusts the appliance's certificate and the relay's
    ca_file: Path  # both certificates, for the command line
    trust_dir: Path
    policy_file: Path

    def policy(self, **appliance: Any) -> AppliancePolicy:
        tables = {
            "gpu": self.gpus.policy_table(),
            "snp": self.snp.policy_table(),
            "appliance": {"audit_vkeys": [self.vkey], **appliance},
        }
        return AppliancePolicy.from_tables(tables, "test policy")

    @property
    def vkey(self) -> str:
        return self.server.app.state.audit_trail.log.vkey

    def transport(self, **options: Any) -> AttestedTransport:
        policy = options.pop("policy", None) or self.policy()
        trust = ApplianceTrust.load(self.trust_dir)
        return AttestedTransport(policy, trust, verify=self.client_tls, **options)

    def openai_client(self, url: str, transport: AttestedTransport) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url}/v1",
            api_key=self.server.token(Role.USER, "app-team"),
            http_client=httpx.Client(transport=transport, timeout=120),
            max_retries=0,
        )

    def fetch(self, nonce: bytes) -> AttestationAnswer:
        with httpx.HTTPTransport(verify=self.client_tls) as transport:
            return fetch_attestation(transport, httpx.URL(self.server.url), nonce)


def _settings(
    directory: Path, model_dir: Path, gpus: SyntheticGpuSetup, snp: SyntheticSnp
) -> Settings:
    policy = write_policy(
        directory / "appliance-policy.toml", {"gpu": gpus.policy_table(), "snp": snp.policy_table()}
    )
    return settings_from_mapping(
        {
            "model": {"dir": str(model_dir), "name": "smollm2"},
            "engine": {"max_model_len": 256, "num_kv_blocks": 64},
            "server": {"host": "127.0.0.1", "port": 0},
            "tls": {"cert_file": "tls/cert.pem", "key_file": "tls/key.pem", "self_signed": True},
            "audit": {"origin": "inferno.test/attested-channel", "data_dir": "audit"},
            "auth": {"local_issuer": "demo", "local_issuer_key_file": "auth/issuer.pem"},
            "appliance": {"profile": "development"},
            "tee": {
                "mode": "required",
                "policy_file": str(policy),
                "gpu_rims_dir": str(gpus.rim_dir),
                "gpu_roots_dir": str(gpus.roots_dir),
                "cpu_trust_dir": str(snp.write_trust_directory(directory / "cpu-trust")),
                "reattest_interval_s": 3600,
            },
        },
        base_dir=directory,
    )


def _relay_certificate(directory: Path) -> tuple[Path, Path]:
    """The relay's own self-signed certificate for 127.0.0.1 (another subject than the
    appliance's, so that a client can trust both)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "A relay the client trusts")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True)
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(Encoding.PEM))
    key_file.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return cert_file, key_file


@pytest.fixture(scope="module")
def setup(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("attested-channel")
    gpus = synthetic_gpu_setup(directory / "gpu", num_gpus=2)
    snp = SyntheticSnp.create()
    settings = _settings(directory, smollm2_dir, gpus, snp)
    tee = TeeService(
        "required",
        EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
        OfflineVerifier(settings.tee),
    )
    with running_server(settings, None, tee=tee) as server:
        deadline = time.monotonic() + 120
        while server.app.state.readiness.state()[0] != "ready":
            assert time.monotonic() < deadline, server.app.state.readiness.state()
            time.sleep(0.05)
        # The client's trust directory: the layout of attestation.remote.trust.
        trust_dir = directory / "client-trust"
        shutil.copytree(gpus.rim_dir, trust_dir / "gpu" / "rims")
        shutil.copytree(gpus.roots_dir, trust_dir / "gpu" / "roots")
        shutil.copytree(settings.tee.cpu_trust_dir, trust_dir / "cpu")  # type: ignore[arg-type]
        relay_cert, relay_key = _relay_certificate(directory / "relay")
        ca_file = directory / "trusted.pem"
        ca_file.write_bytes(server.cert_file.read_bytes() + relay_cert.read_bytes())
        client_tls = ssl.create_default_context(cafile=ca_file)
        port = int(server.url.rsplit(":", 1)[1])
        relay = Relay(port, relay_cert, relay_key, server.cert_file)
        vkey = server.app.state.audit_trail.log.vkey
        policy_file = write_policy(
            directory / "client-policy.toml",
            {"gpu": gpus.policy_table(), "snp": snp.policy_table(),
             "appliance": {"audit_vkeys": [vkey]}},
        )  # fmt: skip
        try:
            yield Setup(server, tee, gpus, snp, relay, client_tls, ca_file, trust_dir, policy_file)
        finally:
            relay.close()


def _verify_appliance_command(setup: Setup, url: str, *options: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "attestation", "verify-appliance", url, "--ca",
               str(setup.ca_file), *options]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, done.stdout


def test_verify_appliance_passes_a_direct_connection_and_refuses_the_relay(setup: Setup) -> None:
    policy = ("--policy", str(setup.policy_file), "--trust", str(setup.trust_dir))
    status, out = _verify_appliance_command(setup, setup.server.url, *policy)
    assert status == 0, out
    assert '"result": "trusted"' in out
    status, out = _verify_appliance_command(setup, setup.relay.url, *policy)
    assert status == 1, out
    assert '"name": "channel.tls_spki"' in out and "a relay or another server answered" in out
    # Without a policy: it still connects, shows the channel checks, and trusts nothing.
    status, out = _verify_appliance_command(setup, setup.server.url)
    assert status == 1, out
    assert '"detail": "no client policy (--policy): nothing is trusted' in out
    assert '"name": "channel.tls_spki",\n      "passed": true' in out


def test_an_unverified_demo_is_shown_as_such_and_never_trusted(
    setup: Setup,
    smollm2_dir: Path,
    smollm2_engine: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """`tee.mode = insecure-dev` (the demo): the command still connects and says what it saw,
    and exits 1; every response says UNVERIFIED; the transport refuses to send anything."""
    engine = smollm2_engine(max_model_len=256, num_kv_blocks=64)
    with running_server(make_settings(tmp_path, smollm2_dir), engine) as demo:
        ca = ("--ca", str(demo.cert_file))
        command = [sys.executable, "-m", "attestation", "verify-appliance", demo.url, *ca]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 1, done.stdout + done.stderr
        assert '"tee": "UNVERIFIED"' in done.stdout and '"name": "policy"' in done.stdout
        with httpx.Client(verify=demo.tls_context()) as plain:
            assert plain.get(f"{demo.url}/health").headers["x-inferno-attestation"] == "UNVERIFIED"
        transport = AttestedTransport(
            setup.policy(), ApplianceTrust.load(setup.trust_dir), verify=demo.tls_context()
        )
        with (
            httpx.Client(transport=transport) as client,
            pytest.raises(ApplianceNotTrustedError, match="UNVERIFIED"),
        ):
            client.post(f"{demo.url}/v1/chat/completions", json={"messages": SECRET_PROMPT})


def test_the_openai_client_chats_over_the_attested_channel_and_names_the_verdict(
    setup: Setup,
) -> None:
    transport = setup.transport()
    with setup.openai_client(setup.server.url, transport) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=[{"role": "user", "content": SECRET_PROMPT}],
            max_tokens=4,
            temperature=0,
        )
    assert raw.parse().choices[0].message.content
    assert transport.verdict is not None and transport.verdict.trusted
    assert transport.num_attestations == 1
    standing = setup.tee.verdict_in_force()
    assert standing is not None
    assert raw.headers["x-inferno-attestation"].startswith(f"id={standing}; age=")
    _, index, _ = raw.headers["audit-entry"].split(" ")
    log = setup.server.app.state.audit_trail.log
    [(_, leaf)] = list(log.store.entries(int(index), int(index)))
    assert b'"action":"inference.request"' in leaf
    assert f'"verdict_id":"{standing}"'.encode() in leaf


def test_without_a_ca_the_attestation_alone_authenticates_the_key(setup: Setup) -> None:
    """The appliance's per-boot self-signed key, trusted through no CA: the command and the
    transport accept it because the evidence binds it, and still refuse the relay."""
    options = ("--policy", str(setup.policy_file), "--trust", str(setup.trust_dir))
    command = [sys.executable, "-m", "attestation", "verify-appliance", "--attested-key-only"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for url, expected in ((setup.server.url, 0), (setup.relay.url, 1)):
        done = subprocess.run(
            [*command, url, *options], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == expected, done.stdout + done.stderr
    setup.relay.mode = "terminate"
    policy, trust = setup.policy(), ApplianceTrust.load(setup.trust_dir)
    direct = AttestedTransport(policy, trust, verify=False)
    with httpx.Client(transport=direct) as client:
        assert client.get(f"{setup.server.url}/v1/models").status_code == 401  # no token sent
    relayed = AttestedTransport(policy, trust, verify=False)
    with httpx.Client(transport=relayed) as client, pytest.raises(ApplianceNotTrustedError):
        client.get(f"{setup.relay.url}/v1/models")


def test_the_async_openai_client_chats_directly_and_sends_the_relay_nothing(
    setup: Setup,
) -> None:
    policy, trust = setup.policy(), ApplianceTrust.load(setup.trust_dir)

    async def chat(url: str) -> str | None:
        transport = AsyncAttestedTransport(policy, trust, verify=setup.client_tls)
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key=setup.server.token(Role.USER, "app-team"),
            http_client=httpx.AsyncClient(transport=transport, timeout=120),
            max_retries=0,
        ) as client:
            reply = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": SECRET_PROMPT}],
                max_tokens=2,
            )  # fmt: skip
        return reply.choices[0].message.content

    assert asyncio.run(chat(setup.server.url)) is not None
    setup.relay.mode = "terminate"
    seen_before = len(setup.relay.from_clients)
    with pytest.raises(ApplianceNotTrustedError, match=r"channel\.tls_spki"):
        asyncio.run(chat(setup.relay.url))
    seen = bytes(setup.relay.from_clients[seen_before:])
    assert seen.startswith(b"GET /v1/attestation?nonce=") and b"POST" not in seen


def test_the_openai_client_pointed_at_the_relay_sends_no_request(setup: Setup) -> None:
    setup.relay.mode = "terminate"
    seen_before = len(setup.relay.from_clients)
    transport = setup.transport()
    with (
        setup.openai_client(setup.relay.url, transport) as client,
        pytest.raises(ApplianceNotTrustedError) as refused,
    ):
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": SECRET_PROMPT}], max_tokens=4
        )
    # The openai client passes the error through as it is (it wraps and retries only httpx's).
    failed = {check.name for check in refused.value.verdict.failures}
    assert {"channel.tls_spki", "snp.report_data"} <= failed
    seen = bytes(setup.relay.from_clients[seen_before:])
    assert seen.startswith(b"GET /v1/attestation?nonce="), seen[:80]
    assert b"POST" not in seen and SECRET_PROMPT.encode() not in seen
    assert b"authorization" not in seen.lower(), "not even the token reached the relay"


def test_a_reroute_after_the_attestation_gets_nothing(setup: Setup) -> None:
    """The relay is a plain TCP hop while the client attests (TLS end to end: the attestation
    passes), then turns into a terminating proxy: the client's next connection is refused as
    its handshake completes, before the request is written."""
    relay = setup.relay
    relay.mode = "tcp"
    transport = setup.transport()
    with setup.openai_client(relay.url, transport) as client:
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content is not None
        relay.mode = "terminate"
        relay.drop_connections()
        seen_before = len(relay.from_clients)
        with pytest.raises(ChannelMismatchError, match="nothing was sent on it"):
            client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": SECRET_PROMPT}],
                max_tokens=2,
            )
    assert bytes(relay.from_clients[seen_before:]) == b"", "a byte of the request reached it"
    assert transport.num_attestations == 1


def test_a_reroute_after_the_attestation_gets_nothing_from_an_async_client(setup: Setup) -> None:
    relay = setup.relay
    relay.mode = "tcp"
    policy, trust = setup.policy(), ApplianceTrust.load(setup.trust_dir)
    transport = AsyncAttestedTransport(policy, trust, verify=setup.client_tls)

    async def two_requests() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=60) as client:
            assert (await client.get(f"{relay.url}/v1/models")).status_code == 401
            relay.mode = "terminate"
            relay.drop_connections()
            await client.post(f"{relay.url}/v1/chat/completions", content=SECRET_PROMPT)

    seen_before = len(relay.from_clients)
    with pytest.raises(ChannelMismatchError, match="nothing was sent on it"):
        asyncio.run(two_requests())
    assert bytes(relay.from_clients[seen_before:]) == b""
    assert transport.num_attestations == 1


def _other_spki_sha256() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    return hashlib.sha256(
        key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    ).digest()


FAILURES = {
    "changed-tls-key": {"channel.tls_spki", "snp.report_data"},
    "replayed-nonce": {"appliance.nonce", "gpu0.nonce", "gpu1.nonce", "snp.report_data"},
    "expired-verdict": {"appliance.verdict_age"},
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_changed_key_a_replayed_nonce_and_an_expired_verdict_each_fail_with_their_reason(
    setup: Setup, failure: str
) -> None:
    nonce = os.urandom(32)
    answer = setup.fetch(nonce)
    assert answer.document is not None
    assert answer.peer_spki_sha256 == certificate_spki_sha256(setup.server.cert_file)
    trust = ApplianceTrust.load(setup.trust_dir)
    now = datetime.now(UTC)
    arguments: dict[str, Any] = {
        "nonce": nonce,
        "peer_spki_sha256": answer.peer_spki_sha256,
        "policy": setup.policy(max_verdict_age_s=3600),
        "at": now,
    }
    passing = verify_appliance(answer.document, trust=trust, **arguments)
    assert passing.trusted, passing.failures
    if failure == "changed-tls-key":
        arguments["peer_spki_sha256"] = _other_spki_sha256()
    elif failure == "replayed-nonce":
        arguments["nonce"] = os.urandom(32)  # this client's nonce; the answer is an old one's
    else:
        arguments["at"] = now + timedelta(hours=2)  # the appliance has not re-attested since
    verdict = verify_appliance(answer.document, trust=trust, **arguments)
    assert {check.name for check in verdict.failures} == FAILURES[failure]


def test_the_transport_attests_again_once_its_verdict_is_older_than_allowed(setup: Setup) -> None:
    now = [1000.0]
    transport = setup.transport(reattest_after_s=60, monotonic=lambda: now[0])
    with httpx.Client(transport=transport, timeout=60) as client:
        assert client.get(f"{setup.server.url}/v1/models").status_code in (200, 401)
        now[0] += 30
        client.get(f"{setup.server.url}/v1/models")
        assert transport.num_attestations == 1
        now[0] += 31
        client.get(f"{setup.server.url}/v1/models")
        assert transport.num_attestations == 2
