"""A synthetic NVIDIA GPU for tests: a test CA shaped like NVIDIA's (a 5-certificate P-384 device
chain whose leaf carries the FWID extension 2.23.133.5.4.1), SPDM 1.1 reports signed for any
nonce with chosen driver/VBIOS versions and measurements, RIMs signed with XML-DSig under a test
CoRIM root, and OCSP responses / CRLs for the revocation bundle.

Nothing here is trusted by default: a verifier accepts it only when a test pins the synthetic
roots (`SyntheticGpuSetup.trust()`), exactly as a deployment pins NVIDIA's.

Typical use (an end-to-end boot test):

    setup = synthetic_gpu_setup(tmp_path, num_gpus=2)
    evidence = setup.collect(nonces)                     # like collect_gpu_evidence(nonces)
    verdict = verify_gpu_evidence(evidence, expected_nonces=nonces,
                                  policy=setup.policy(), trust=setup.trust(), at=now)
    setup.collect(nonces, driver_version="999.99")       # a report that violates the policy
    setup.collect(nonces, dev_tools_mode=True)           # NVML state that violates it
    setup.collect(nonces, measurements={5: bytes(48)})   # a measurement no RIM allows
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509 import ocsp
from cryptography.x509.oid import NameOID
from lxml import etree

from attestation.gpu.chain import FWID_OID
from attestation.gpu.evidence import GpuEvidence
from attestation.gpu.policy import GpuPolicy
from attestation.gpu.revocation import RevocationBundle
from attestation.gpu.roots import CORIM_ROOT_FILE, DEVICE_IDENTITY_CA_FILE
from attestation.gpu.trust import GpuTrust
from attestation.gpu.xmldsig import DS, canonicalize, document_without_signature

NUM_BLOCKS = 64
EPOCH = datetime(2024, 1, 1, tzinfo=UTC)
FAR_FUTURE = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
DEFAULT_DRIVER = "550.90.07"
DEFAULT_VBIOS = "96.00.9F.00.01"
DEFAULT_BOARD = ("1010", "0200", "882")
# RIM index i covers measurement block i+1: the VBIOS RIM the first 12, the driver RIM the next 21
# (33 active measurements, as in NVIDIA's 545 RIMs); the remaining blocks are not compared.
VBIOS_INDICES = tuple(range(0, 12))
DRIVER_INDICES = tuple(range(12, 33))


@dataclass
class Issued:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Inferno Test GPU Vendor"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def issue(
    common_name: str,
    issuer: Issued | None,
    *,
    ca: bool,
    not_before: datetime = EPOCH,
    not_after: datetime = FAR_FUTURE,
    path_length: int | None = None,
    extra: Sequence[x509.ExtensionType] = (),
    key_usage: x509.KeyUsage | None = None,
) -> Issued:
    """A P-384 certificate signed with ECDSA-SHA384 by `issuer` (self-signed when None)."""
    key = ec.generate_private_key(ec.SECP384R1())
    subject = _name(common_name)
    signer_key = issuer.key if issuer else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(
            key_usage
            or x509.KeyUsage(
                digital_signature=not ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(True, path_length), critical=True)
    for extension in extra:
        builder = builder.add_extension(extension, critical=False)
    return Issued(builder.sign(signer_key, hashes.SHA384()), key)


def fwid_extension(fwid: bytes) -> x509.UnrecognizedExtension:
    """A DICE TcbInfo (2.23.133.5.4.1) holding one SHA-384 FWID, like NVIDIA's leaf certificates."""
    sha384_oid = bytes.fromhex("0609608648016503040202")
    fwid_seq = b"\x30" + bytes([len(sha384_oid) + 2 + len(fwid)]) + sha384_oid + b"\x04\x30" + fwid
    fwids = b"\xa6" + bytes([len(fwid_seq)]) + fwid_seq
    return x509.UnrecognizedExtension(FWID_OID, b"\x30" + bytes([len(fwids)]) + fwids)


def measurement(index: int, salt: bytes = b"") -> bytes:
    """A deterministic 48-byte measurement value for block `index`."""
    return hashlib.sha384(b"synthetic measurement %d" % index + salt).digest()


def default_measurements() -> dict[int, bytes]:
    """Block index (1..64) → value."""
    return {index: measurement(index) for index in range(1, NUM_BLOCKS + 1)}


def encode_vbios_version(version: str) -> bytes:
    """The inverse of GpuReport.vbios_version: "96.00.9F.00.01" → opaque type 6 bytes."""
    parts = [int(part, 16) for part in version.split(".")]
    if len(parts) != 5:
        raise ValueError(f"VBIOS version {version!r} is not five hex bytes")
    raw = bytearray(8)
    raw[3], raw[2], raw[1], raw[0], raw[4] = parts
    return bytes(raw)


def build_report(
    key: ec.EllipticCurvePrivateKey,
    nonce: bytes,
    *,
    driver_version: str,
    vbios_version: str,
    measurements: Mapping[int, bytes],
    board: tuple[str, str, str] = DEFAULT_BOARD,
    fwid: bytes | None = None,
) -> bytes:
    """An SPDM 1.1 GET_MEASUREMENTS request ‖ MEASUREMENTS response, signed by `key` (raw r ‖ s
    ECDSA-P384 over everything before the signature)."""
    if len(nonce) != 32:
        raise ValueError("the SPDM request nonce is 32 bytes")
    request = bytes([0x11, 0xE0, 0x01, 0xFF]) + nonce + b"\x00"
    record = b"".join(
        bytes([index, 0x01])
        + (51).to_bytes(2, "little")
        + b"\x01"
        + (48).to_bytes(2, "little")
        + measurements[index]
        for index in sorted(measurements)
    )
    opaque_fields = [
        (6, encode_vbios_version(vbios_version)),
        (17, board[0].encode() + b"\0"),
        (18, board[1].encode() + b"\0"),
        (15, board[2].encode() + b"\0"),
        (3, driver_version.encode() + b"\0"),
    ]
    if fwid is not None:
        opaque_fields.append((20, fwid))
    opaque = b"".join(
        t.to_bytes(2, "little") + len(v).to_bytes(2, "little") + v for t, v in opaque_fields
    )
    response = (
        bytes([0x11, 0x60, 0x00, 0x00, len(measurements)])
        + len(record).to_bytes(3, "little")
        + record
        + os.urandom(32)
        + len(opaque).to_bytes(2, "little")
        + opaque
    )
    r, s = decode_dss_signature(key.sign(request + response, ec.ECDSA(hashes.SHA384())))
    return request + response + r.to_bytes(48, "big") + s.to_bytes(48, "big")


@dataclass
class SyntheticGpu:
    """One device: its 5-certificate chain (leaf first, root last) and attestation key."""

    chain: tuple[Issued, ...]
    fwid: bytes

    @property
    def chain_pem(self) -> bytes:
        return b"".join(issued.pem for issued in self.chain)

    def evidence(
        self,
        nonce: bytes,
        *,
        driver_version: str = DEFAULT_DRIVER,
        vbios_version: str = DEFAULT_VBIOS,
        measurements: Mapping[int, bytes] | None = None,
        board: tuple[str, str, str] = DEFAULT_BOARD,
        include_fwid: bool = True,
        cc_mode: str | None = "on",
        dev_tools_mode: bool | None = False,
    ) -> GpuEvidence:
        report = build_report(
            self.chain[0].key,
            nonce,
            driver_version=driver_version,
            vbios_version=vbios_version,
            measurements=measurements if measurements is not None else default_measurements(),
            board=board,
            fwid=self.fwid if include_fwid else None,
        )
        return GpuEvidence(
            arch="HOPPER",
            nonce=nonce,
            report=report,
            certificate_chain=self.chain_pem,
            cc_mode=cc_mode,
            dev_tools_mode=dev_tools_mode,
        )


@dataclass
class SyntheticGpuCa:
    """A device identity root with its two NVIDIA-like intermediates, and a CoRIM signing root
    with the RIM signing chain (CA, L3, L4 signer)."""

    device_root: Issued
    identity: Issued
    provisioner: Issued
    corim_root: Issued
    corim_ca: Issued
    corim_l3: Issued
    rim_signer: Issued

    @classmethod
    def create(cls, *, rim_signer_not_after: datetime = FAR_FUTURE) -> SyntheticGpuCa:
        device_root = issue("Synthetic Device Identity CA", None, ca=True)
        identity = issue("Synthetic GH100 Identity", device_root, ca=True)
        provisioner = issue("Synthetic GH100 Provisioner ICA 1", identity, ca=True)
        corim_root = issue("Synthetic CoRIM signing Root CA", None, ca=True)
        corim_ca = issue("Synthetic Reference Value GH100 CA", corim_root, ca=True)
        corim_l3 = issue("Synthetic Reference Value L3 GH100", corim_ca, ca=True, path_length=0)
        rim_signer = issue(
            "Synthetic RIM L4 Signer", corim_l3, ca=False, not_after=rim_signer_not_after
        )
        return cls(device_root, identity, provisioner, corim_root, corim_ca, corim_l3, rim_signer)

    def device(self, *, chip: str = "GH100") -> SyntheticGpu:
        brom = issue(f"{chip} A01 GSP BROM", self.provisioner, ca=True)
        fwid = os.urandom(48)
        leaf = issue(f"{chip} A01 GSP FMC LF", brom, ca=False, extra=[fwid_extension(fwid)])
        return SyntheticGpu((leaf, brom, self.provisioner, self.identity, self.device_root), fwid)

    def write_roots(self, directory: Path) -> Path:
        """Write both roots under the file names GpuTrust.from_paths(roots_dir=...) reads."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / DEVICE_IDENTITY_CA_FILE).write_bytes(self.device_root.pem)
        (directory / CORIM_ROOT_FILE).write_bytes(self.corim_root.pem)
        return directory

    def sign_rim(
        self,
        version: str,
        golden: Mapping[int, Sequence[bytes]],
        *,
        signer_chain: Sequence[Issued] | None = None,
    ) -> bytes:
        """A RIM (SWID tag shaped like NVIDIA's) listing `golden[i]` (the alternatives of RIM
        index i, active) for each given index and an inactive zero entry for every other of
        0..63, with an enveloped XML signature by the L4 signer (or `signer_chain[0]`)."""
        chain = list(
            signer_chain or [self.rim_signer, self.corim_l3, self.corim_ca, self.corim_root]
        )
        return sign_swid(rim_document(version, golden), chain)

    def ocsp_response(
        self,
        cert: x509.Certificate,
        issuer: Issued,
        *,
        revoked: bool = False,
        this_update: datetime,
        next_update: datetime | None = None,
    ) -> bytes:
        """A DER OCSP response about `cert`, signed directly by its issuer."""
        builder = ocsp.OCSPResponseBuilder().add_response(
            cert=cert,
            issuer=issuer.cert,
            algorithm=hashes.SHA1(),
            cert_status=ocsp.OCSPCertStatus.REVOKED if revoked else ocsp.OCSPCertStatus.GOOD,
            this_update=this_update,
            next_update=next_update,
            revocation_time=this_update if revoked else None,
            revocation_reason=x509.ReasonFlags.key_compromise if revoked else None,
        )
        builder = builder.responder_id(ocsp.OCSPResponderEncoding.HASH, issuer.cert)
        return builder.sign(issuer.key, hashes.SHA384()).public_bytes(serialization.Encoding.DER)

    @staticmethod
    def crl(
        issuer: Issued,
        *,
        revoked_serials: Sequence[int] = (),
        last_update: datetime,
        next_update: datetime,
    ) -> bytes:
        """A DER CRL by `issuer` listing `revoked_serials`."""
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(issuer.cert.subject)
            .last_update(last_update)
            .next_update(next_update)
        )
        for serial in revoked_serials:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(serial)
                .revocation_date(last_update)
                .build()
            )
        return builder.sign(issuer.key, hashes.SHA384()).public_bytes(serialization.Encoding.DER)


_SWID = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
_SHA384_NS = "http://www.w3.org/2001/04/xmlenc#sha384"
_TCG = "https://trustedcomputinggroup.org/resource/tcg-reference-integrity-manifest-rim-information-model/"


def rim_document(version: str, golden: Mapping[int, Sequence[bytes]]) -> bytes:
    """An unsigned RIM in NVIDIA's SWID shape (see the module docstring of attestation.gpu.rim)."""
    resources = []
    for index in range(NUM_BLOCKS):
        alternatives = list(golden.get(index, [bytes(48)]))
        hashes_xml = " ".join(
            f'ns2:Hash{n}="{value.hex()}"' for n, value in enumerate(alternatives)
        )
        resources.append(
            f'        <ns0:Resource type="Measurement" index="{index}" '
            f'active="{"True" if index in golden else "False"}" '
            f'alternatives="{len(alternatives)}" {hashes_xml} name="Measurement_{index}" '
            'size="48"/>'
        )
    return (
        f'<SoftwareIdentity xmlns="{_SWID}" xmlns:ns0="{_SWID}" xmlns:ns2="{_SHA384_NS}" '
        'corpus="false" name="GH100" patch="false" supplemental="false" '
        f'tagId="{hashlib.sha384(version.encode()).hexdigest()}" version="1.0" tagVersion="0">\n'
        '    <ns0:Entity name="Inferno Test GPU Vendor" role="softwareCreator tagCreator"/>\n'
        f'    <ns0:Meta xmlns:ns1="{_TCG}" colloquialVersion="{version}" edition="GPU" '
        'product="GH100" revision="r1" PayloadType="direct" ns1:BindingSpec="RIMIM"/>\n'
        f'    <ns0:Payload xmlns:SHA384="{_SHA384_NS}">\n'
        + "\n".join(resources)
        + "\n    </ns0:Payload>\n</SoftwareIdentity>"
    ).encode("utf-8")


def sign_swid(document: bytes, chain: Sequence[Issued]) -> bytes:
    """Append an enveloped XML signature (C14N 1.1, ecdsa-sha384) by `chain[0]` to the root of
    `document`, with every certificate of `chain` in KeyInfo."""
    root = etree.fromstring(document)
    certificates = "".join(
        "<ds:X509Certificate>"
        + base64.b64encode(issued.cert.public_bytes(serialization.Encoding.DER)).decode()
        + "</ds:X509Certificate>"
        for issued in chain
    )
    signature = etree.fromstring(
        f'<ds:Signature xmlns:ds="{DS}"><ds:SignedInfo>'
        '<ds:CanonicalizationMethod Algorithm="http://www.w3.org/2006/12/xml-c14n11"/>'
        '<ds:SignatureMethod Algorithm="http://www.w3.org/2001/04/xmldsig-more#ecdsa-sha384"/>'
        '<ds:Reference URI=""><ds:Transforms>'
        '<ds:Transform Algorithm="http://www.w3.org/2000/09/xmldsig#enveloped-signature"/>'
        '<ds:Transform Algorithm="http://www.w3.org/2006/12/xml-c14n11"/></ds:Transforms>'
        '<ds:DigestMethod Algorithm="http://www.w3.org/2001/04/xmldsig-more#sha384"/>'
        "<ds:DigestValue></ds:DigestValue></ds:Reference></ds:SignedInfo>"
        "<ds:SignatureValue></ds:SignatureValue>"
        f"<ds:KeyInfo><ds:X509Data>{certificates}</ds:X509Data></ds:KeyInfo></ds:Signature>"
    )
    root.append(signature)
    digest = hashlib.sha384(document_without_signature(etree.tostring(root))).digest()
    signature.find(f".//{{{DS}}}DigestValue").text = base64.b64encode(digest).decode()
    signed_info = signature.find(f"{{{DS}}}SignedInfo")
    der = chain[0].key.sign(canonicalize(signed_info), ec.ECDSA(hashes.SHA384()))
    r, s = decode_dss_signature(der)
    signature.find(f"{{{DS}}}SignatureValue").text = base64.b64encode(
        r.to_bytes(48, "big") + s.to_bytes(48, "big")
    ).decode()
    return etree.tostring(root)


@dataclass
class SyntheticGpuSetup:
    """Pinned synthetic roots, signed RIMs on disk, devices, and a policy that accepts them."""

    ca: SyntheticGpuCa
    gpus: list[SyntheticGpu]
    roots_dir: Path
    rim_dir: Path
    revocation_dir: Path | None = None
    driver_version: str = DEFAULT_DRIVER
    vbios_version: str = DEFAULT_VBIOS
    board: tuple[str, str, str] = DEFAULT_BOARD
    measurements: dict[int, bytes] = field(default_factory=default_measurements)

    def collect(
        self,
        nonces: Sequence[bytes],
        *,
        driver_version: str | None = None,
        vbios_version: str | None = None,
        measurements: Mapping[int, bytes] | None = None,
        cc_mode: str | None = "on",
        dev_tools_mode: bool | None = False,
    ) -> list[GpuEvidence]:
        """Evidence of every GPU, one nonce each, with the same contract as
        `collect_gpu_evidence`; keyword overrides change what the devices report. A
        `measurements` override replaces the given blocks only."""
        if len(nonces) != len(self.gpus):
            raise ValueError(f"{len(self.gpus)} synthetic GPUs need {len(self.gpus)} nonces")
        values = {**self.measurements, **(measurements or {})}
        return [
            gpu.evidence(
                nonce,
                driver_version=driver_version or self.driver_version,
                vbios_version=vbios_version or self.vbios_version,
                measurements=values,
                board=self.board,
                cc_mode=cc_mode,
                dev_tools_mode=dev_tools_mode,
            )
            for gpu, nonce in zip(self.gpus, nonces, strict=True)
        ]

    def trust(self) -> GpuTrust:
        return GpuTrust.from_paths(
            rim_dir=self.rim_dir, roots_dir=self.roots_dir, revocation_dir=self.revocation_dir
        )

    def policy_table(self, **overrides: Any) -> dict[str, Any]:
        """A `[gpu]` table accepting exactly these devices; keyword arguments replace keys."""
        table: dict[str, Any] = {
            "driver_versions": [self.driver_version],
            "vbios_versions": [self.vbios_version],
            "architectures": ["HOPPER"],
            "chips": ["GH100"],
            "num_gpus": [len(self.gpus)],
            "require_cc_on": True,
            "require_dev_tools_off": True,
            "allowed_mismatch_indices": [],
            "expired_rim_certificate": "reject",
            "revocation_accept": ["good", "unchecked"],
            "revocation_max_age_s": 7 * 24 * 3600,
        }
        table.update(overrides)
        return table

    def policy(self, **overrides: Any) -> GpuPolicy:
        return GpuPolicy.from_table(self.policy_table(**overrides))

    def revocation(self) -> RevocationBundle:
        return self.trust().revocation


def synthetic_gpu_setup(
    directory: Path,
    *,
    num_gpus: int = 1,
    driver_version: str = DEFAULT_DRIVER,
    vbios_version: str = DEFAULT_VBIOS,
    board: tuple[str, str, str] = DEFAULT_BOARD,
    rim_signer_not_after: datetime = FAR_FUTURE,
) -> SyntheticGpuSetup:
    """Create a CA, `num_gpus` devices, and write under `directory` the roots (`roots/`) and the
    driver and VBIOS RIMs golden for `default_measurements()` (`rims/`)."""
    ca = SyntheticGpuCa.create(rim_signer_not_after=rim_signer_not_after)
    gpus = [ca.device() for _ in range(num_gpus)]
    roots_dir = ca.write_roots(directory / "roots")
    rim_dir = directory / "rims"
    rim_dir.mkdir(parents=True, exist_ok=True)
    values = default_measurements()
    (rim_dir / f"NV_GPU_DRIVER_GH100_{driver_version}.swidtag").write_bytes(
        ca.sign_rim(driver_version, {i: [values[i + 1]] for i in DRIVER_INDICES})
    )
    vbios_id = "_".join([*board, vbios_version.replace(".", "")])
    (rim_dir / f"{vbios_id}.swidtag").write_bytes(
        ca.sign_rim(vbios_version, {i: [values[i + 1]] for i in VBIOS_INDICES})
    )
    return SyntheticGpuSetup(
        ca=ca,
        gpus=gpus,
        roots_dir=roots_dir,
        rim_dir=rim_dir,
        driver_version=driver_version,
        vbios_version=vbios_version,
        board=board,
        measurements=values,
    )
