"""A synthetic AMD SEV-SNP platform for tests: a test ARK/ASK/VCEK chain shaped like AMD's
(RSA-PSS SHA-384 certificates, a P-384 VCEK with the TCB and hwID extensions) that signs
1184-byte attestation reports binding any report_data. It is pinned only by the `CpuTrust`
it hands out, so nothing outside a test ever trusts it.

Usage (the boot gate's tests build on this):

    platform = SyntheticSnp.create()
    evidence = platform.evidence(report_data)            # CpuEvidence with the cert table
    verdict = verify_cpu_evidence(evidence, expected_report_data=report_data,
                                  policy=platform.policy(), trust=platform.trust(), at=now)
    assert verdict.trusted
    platform.evidence(report_data, debug=True)            # violates the policy: debug
    platform.evidence(report_data, measurement=bytes(48)) # violates the policy: measurement

Test keys are RSA-2048 rather than AMD's RSA-4096, to keep tests fast; the verifier does not
depend on the key size. `FakeConfigfsTsm` emulates configfs-tsm for collection tests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID

from attestation.cpu import collect
from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.policy import CpuPolicy
from attestation.cpu.snp import (
    AMD_PSS,
    ARK_GUID,
    ASK_GUID,
    OID_BOOTLOADER_SPL,
    OID_FMC_SPL,
    OID_HWID,
    OID_MICROCODE_SPL,
    OID_PRODUCT_NAME,
    OID_SNP_SPL,
    OID_TEE_SPL,
    PLATFORM_SMT_EN,
    POLICY_DEBUG,
    POLICY_RESERVED_ONE,
    POLICY_SMT,
    SIGNED_SIZE,
    VCEK_GUID,
    Product,
    TcbVersion,
    build_certificate_table,
)
from attestation.cpu.trust import CpuTrust

DEFAULT_MEASUREMENT = hashlib.sha384(b"inferno synthetic SNP guest").digest()
DEFAULT_TCB = TcbVersion(bootloader=4, tee=0, snp=22, microcode=213)
NOT_BEFORE = datetime(2024, 1, 1, tzinfo=UTC)
NOT_AFTER = datetime(2049, 1, 1, tzinfo=UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Engineering"),
            x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
            x509.NameAttribute(NameOID.LOCALITY_NAME, "Santa Clara"),
            x509.NameAttribute(NameOID.STATE_OR_PROVINCE_NAME, "CA"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Inferno Test (not AMD)"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _der_integer(value: int) -> bytes:
    body = value.to_bytes(1, "big") if value < 0x80 else b"\x00" + value.to_bytes(1, "big")
    return b"\x02" + bytes([len(body)]) + body


def _ca_certificate(
    subject: str,
    issuer: str,
    key: rsa.RSAPrivateKey,
    public: rsa.RSAPublicKey,
    path_length: int | None,
) -> x509.Certificate:
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOT_BEFORE)
        .not_valid_after(NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA384(), rsa_padding=AMD_PSS)
    )


def _vcek_certificate(
    product: Product,
    ask_key: rsa.RSAPrivateKey,
    vcek_public: ec.EllipticCurvePublicKey,
    tcb: TcbVersion,
    chip_id: bytes,
) -> x509.Certificate:
    spls = [
        (OID_BOOTLOADER_SPL, tcb.bootloader),
        (OID_TEE_SPL, tcb.tee),
        (OID_SNP_SPL, tcb.snp),
        (OID_MICROCODE_SPL, tcb.microcode),
    ]
    if product == "Turin":
        spls.append((OID_FMC_SPL, tcb.fmc or 0))
    product_name = f"{product}-B0".encode()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name("SEV-VCEK"))
        .issuer_name(_name(f"SEV-{product}"))
        .public_key(vcek_public)
        .serial_number(1)
        .not_valid_before(NOT_BEFORE)
        .not_valid_after(NOT_AFTER)
        .add_extension(
            x509.UnrecognizedExtension(
                OID_PRODUCT_NAME, b"\x16" + bytes([len(product_name)]) + product_name
            ),
            critical=False,
        )
        .add_extension(
            x509.UnrecognizedExtension(OID_HWID, chip_id[:8] if product == "Turin" else chip_id),
            critical=False,
        )
    )
    for oid, value in spls:
        builder = builder.add_extension(
            x509.UnrecognizedExtension(oid, _der_integer(value)), critical=False
        )
    return builder.sign(ask_key, hashes.SHA384(), rsa_padding=AMD_PSS)


@dataclass(frozen=True)
class SyntheticSnp:
    """One synthetic SEV-SNP chip: its test chain and the TCB its VCEK certifies."""

    product: Product
    ark: x509.Certificate
    ark_key: rsa.RSAPrivateKey
    ask: x509.Certificate
    vcek: x509.Certificate
    vcek_key: ec.EllipticCurvePrivateKey
    chip_id: bytes
    tcb: TcbVersion

    @classmethod
    def create(
        cls,
        product: Product = "Milan",
        *,
        tcb: TcbVersion = DEFAULT_TCB,
        chip_id: bytes | None = None,
    ) -> SyntheticSnp:
        """A fresh test chain (new keys each time) for a chip of `product` at `tcb`."""
        if product == "Turin" and tcb.fmc is None:
            tcb = replace(tcb, fmc=1)
        ark_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ask_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        vcek_key = ec.generate_private_key(ec.SECP384R1())
        public_point = vcek_key.public_key().public_bytes(
            Encoding.X962, PublicFormat.UncompressedPoint
        )
        chip_id = chip_id or hashlib.sha512(public_point).digest()
        ark = _ca_certificate(
            f"ARK-{product}", f"ARK-{product}", ark_key, ark_key.public_key(), None
        )
        ask = _ca_certificate(f"SEV-{product}", f"ARK-{product}", ark_key, ask_key.public_key(), 0)
        vcek = _vcek_certificate(product, ask_key, vcek_key.public_key(), tcb, chip_id)
        return cls(product, ark, ark_key, ask, vcek, vcek_key, chip_id, tcb)

    def report(
        self,
        report_data: bytes,
        *,
        measurement: bytes = DEFAULT_MEASUREMENT,
        debug: bool = False,
        smt: bool = True,
        migrate_ma: bool = False,
        vmpl: int = 0,
        guest_svn: int = 0,
        host_data: bytes = bytes(32),
        reported_tcb: TcbVersion | None = None,
        current_tcb: TcbVersion | None = None,
        committed_tcb: TcbVersion | None = None,
        platform_info: int = PLATFORM_SMT_EN,
        version: int = 2,
    ) -> bytes:
        """A signed 1184-byte ATTESTATION_REPORT (ABI spec Table 23) for `report_data` (64
        bytes). `reported_tcb` other than the chip's TCB makes a report the VCEK does not
        certify; `current_tcb` and `committed_tcb` default to the chip's TCB too, and
        `platform_info` to SMT enabled only. Each keyword is a way to violate a policy while
        keeping a valid signature."""
        if len(report_data) != 64:
            raise ValueError("report_data is 64 bytes")
        policy = POLICY_RESERVED_ONE | (POLICY_SMT if smt else 0) | (POLICY_DEBUG if debug else 0)
        policy |= (1 << 18) if migrate_ma else 0
        tcb = (reported_tcb or self.tcb).to_bytes(self.product)
        body = bytearray(SIGNED_SIZE)
        struct.pack_into("<IIQ", body, 0x00, version, guest_svn, policy)
        struct.pack_into("<II", body, 0x30, vmpl, 1)
        body[0x38:0x40] = (current_tcb or self.tcb).to_bytes(self.product)
        struct.pack_into("<Q", body, 0x40, platform_info)
        body[0x50:0x90] = report_data
        body[0x90:0xC0] = measurement
        body[0xC0:0xE0] = host_data
        body[0x140:0x160] = hashlib.sha256(report_data).digest()
        body[0x160:0x180] = b"\xff" * 32
        body[0x180:0x188] = tcb
        body[0x1A0:0x1E0] = self.chip_id
        body[0x1E0:0x1E8] = (committed_tcb or self.tcb).to_bytes(self.product)
        body[0x1E8:0x1EB] = bytes([24, 55, 1])
        body[0x1EC:0x1EF] = bytes([24, 55, 1])
        body[0x1F0:0x1F8] = tcb
        return self.sign(bytes(body))

    def sign(self, signed_part: bytes) -> bytes:
        """The full report: `signed_part` (bytes 0x000-0x29F, possibly edited by a test) with
        the VCEK's signature (r, s little-endian in 72-byte fields) and zero padding."""
        r, s = decode_dss_signature(
            self.vcek_key.sign(signed_part[:SIGNED_SIZE], ec.ECDSA(hashes.SHA384()))
        )
        signature = r.to_bytes(72, "little") + s.to_bytes(72, "little")
        return signed_part[:SIGNED_SIZE] + signature + bytes(0x4A0 - SIGNED_SIZE - 144)

    def certificate_table(self, *, include_ark: bool = True) -> bytes:
        """The extended-report certificate table (configfs-tsm auxblob): VCEK, ASK, ARK."""
        certificates = {
            VCEK_GUID: self.vcek.public_bytes(Encoding.DER),
            ASK_GUID: self.ask.public_bytes(Encoding.DER),
        }
        if include_ark:
            certificates[ARK_GUID] = self.ark.public_bytes(Encoding.DER)
        return build_certificate_table(certificates)

    def evidence(self, report_data: bytes, **report_options: Any) -> CpuEvidence:
        """CpuEvidence as configfs-tsm's sev_guest provider returns it (report + auxblob)."""
        return CpuEvidence(
            kind="snp",
            report=self.report(report_data, **report_options),
            auxblob=self.certificate_table(),
            provider="sev_guest",
        )

    def crl(
        self, *, issued: datetime | None = None, revoke_ask: bool = False
    ) -> x509.CertificateRevocationList:
        """A CRL signed by the test ARK as AMD signs theirs (RSA-PSS SHA-384), issued at
        `issued` (default: an hour ago) with a week to its nextUpdate; it lists the ASK if
        `revoke_ask`."""
        issued = issued or datetime.now(UTC) - timedelta(hours=1)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.ark.subject)
            .last_update(issued)
            .next_update(issued + timedelta(days=7))
        )
        if revoke_ask:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(self.ask.serial_number)
                .revocation_date(issued)
                .build()
            )
        return builder.sign(self.ark_key, hashes.SHA384(), rsa_padding=AMD_PSS)

    def trust(self, at: datetime | None = None) -> CpuTrust:
        """A CpuTrust pinning only this test ARK, with a fresh CRL for a validation time `at`
        (default: now)."""
        issued = (at or datetime.now(UTC)) - timedelta(hours=1)
        return CpuTrust(
            snp_arks={self.product: self.ark}, snp_crls={self.product: self.crl(issued=issued)}
        )

    def policy_table(self, **overrides: Any) -> dict[str, Any]:
        """An `[snp]` table that the default `report()` satisfies; `overrides` replace keys."""
        table: dict[str, Any] = {
            "measurements": [DEFAULT_MEASUREMENT.hex()],
            "min_tcb": {k: v for k, v in self.tcb.to_json().items()},
            "allowed_vmpls": [0],
        }
        table.update(overrides)
        return table

    def policy(self, **overrides: Any) -> CpuPolicy:
        return CpuPolicy.from_tables({"snp": self.policy_table(**overrides)})

    def write_trust_directory(self, directory: Path, at: datetime | None = None) -> Path:
        """Write the `CpuTrust.load` layout pinning this test ARK, with a CRL fresh at `at`
        (default: now; the policy's default maximum age is a week); returns `directory`."""
        (directory / "snp").mkdir(parents=True, exist_ok=True)
        (directory / "snp" / f"ark-{self.product.lower()}.pem").write_bytes(
            self.ark.public_bytes(Encoding.PEM)
        )
        issued = (at or datetime.now(UTC)) - timedelta(hours=1)
        (directory / "snp" / f"crl-{self.product.lower()}.der").write_bytes(
            self.crl(issued=issued).public_bytes(Encoding.DER)
        )
        return directory


class FakeConfigfsTsm:
    """A configfs-tsm report directory emulated in a temporary directory: `outblob`, `auxblob`,
    `provider` and `generation` are computed on read from what was written to `inblob`, the way
    the kernel does. `race=True` bumps the generation behind the reader's back."""

    def __init__(self, root: Path, platform: SyntheticSnp, *, race: bool = False) -> None:
        self.root = root
        self.platform = platform
        self.race = race
        self.writes: dict[Path, int] = {}
        self.entries_seen: list[Path] = []
        root.mkdir(parents=True, exist_ok=True)

    def read(self, path: Path) -> bytes:
        entry = path.parent
        if entry not in self.entries_seen:
            self.entries_seen.append(entry)
        if path.name == "generation":
            generation = self.writes.get(entry, 0)
            if self.race and generation:
                self.writes[entry] = generation + 1
            return f"{generation}\n".encode()
        if path.name == "provider":
            return b"sev_guest\n"
        inblob = (entry / "inblob").read_bytes()
        if path.name == "outblob":
            return self.platform.report(inblob)
        if path.name == "auxblob":
            return self.platform.certificate_table()
        raise AssertionError(f"unexpected configfs-tsm attribute {path.name}")

    def write(self, path: Path, data: bytes) -> None:
        path.write_bytes(data)
        self.writes[path.parent] = self.writes.get(path.parent, 0) + 1

    @contextmanager
    def installed(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeConfigfsTsm]:
        """Route `attestation.cpu.collect`'s attribute IO through this fake. The fake's entries
        are plain directories holding an `inblob` file, so the fake's `rmdir` needs help."""
        monkeypatch.setattr(collect, "_read_attribute", self.read)
        monkeypatch.setattr(collect, "_write_attribute", self.write)
        real_rmdir = Path.rmdir

        def rmdir(path: Path) -> None:
            if path.parent == self.root:
                (path / "inblob").unlink(missing_ok=True)
            real_rmdir(path)

        monkeypatch.setattr(Path, "rmdir", rmdir)
        yield self
