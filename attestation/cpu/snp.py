"""AMD SEV-SNP attestation reports: strict parsing and signature verification (mechanism only;
what values are acceptable is `attestation.cpu.policy`'s business).

Layout: AMD SEV Secure Nested Paging Firmware ABI Specification (publication 56860), Table 23
"ATTESTATION_REPORT Structure"; all integers little-endian. Versions 2, 3 and 5 are accepted;
version 3 adds the CPUID family/model/stepping at 0x188, version 5 the mitigation vectors at
0x1F8. Reserved ranges must be zero, so a report with bits set where the spec says "MBZ" is
refused rather than half-understood.

Verification plan (`verify_snp_report`), one error type per step:
  1. parse the report strictly                      -> SnpReportFormatError (EvidenceError)
  2. VCEK <- ASK <- pinned ARK, RSA-PSS SHA-384,
     every certificate valid at the validation time -> SnpCertificateChainError
  3. the VCEK certifies this chip and this TCB       -> SnpVcekMismatchError
  4. ECDSA P-384 SHA-384 signature over 0x000-0x29F  -> SnpSignatureError
  5. report_data equals the expected value           -> ReportDataMismatchError (in `verify`)
"""

from __future__ import annotations

import struct
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.x509.oid import SignatureAlgorithmOID

from attestation.cpu.errors import (
    SnpCertificateChainError,
    SnpReportFormatError,
    SnpSignatureError,
    SnpVcekMismatchError,
)

REPORT_SIZE = 0x4A0
SIGNED_SIZE = 0x2A0
SIGNATURE_ALGO_ECDSA_P384_SHA384 = 1
SUPPORTED_VERSIONS = (2, 3, 5)

Product = Literal["Milan", "Genoa", "Turin"]
PRODUCTS: tuple[Product, ...] = ("Milan", "Genoa", "Turin")

# GUIDs of the extended-report certificate table (GHCB spec 56421, section 4.1.8.1), stored in
# RFC 4122 byte order as the host writes them and go-sev-guest reads them.
VCEK_GUID = uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd")
ASK_GUID = uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782")
ARK_GUID = uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae")
VLEK_GUID = uuid.UUID("a8074bc2-a25a-483e-aae6-39c045a0b8a1")

# VCEK certificate extensions (AMD "Versioned Chip Endorsement Key" spec 57230, section 3.1).
_AMD_OID = "1.3.6.1.4.1.3704.1"
OID_PRODUCT_NAME = x509.ObjectIdentifier(f"{_AMD_OID}.2")
OID_BOOTLOADER_SPL = x509.ObjectIdentifier(f"{_AMD_OID}.3.1")
OID_TEE_SPL = x509.ObjectIdentifier(f"{_AMD_OID}.3.2")
OID_SNP_SPL = x509.ObjectIdentifier(f"{_AMD_OID}.3.3")
OID_MICROCODE_SPL = x509.ObjectIdentifier(f"{_AMD_OID}.3.8")
OID_FMC_SPL = x509.ObjectIdentifier(f"{_AMD_OID}.3.9")
OID_HWID = x509.ObjectIdentifier(f"{_AMD_OID}.4")

# AMD signs ARK, ASK and VCEK with RSASSA-PSS, SHA-384, MGF1-SHA-384 and a 48-byte salt.
AMD_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)

# Guest policy bits (ABI spec, Table 9).
POLICY_SMT = 1 << 16
POLICY_RESERVED_ONE = 1 << 17
POLICY_MIGRATE_MA = 1 << 18
POLICY_DEBUG = 1 << 19
POLICY_SINGLE_SOCKET = 1 << 20
# PLATFORM_INFO bits (SNP ABI spec, ATTESTATION_REPORT offset 0x40). CIPHERTEXT_HIDING_EN is
# reserved (zero) before report version 3, so a policy requiring it refuses older reports.
PLATFORM_SMT_EN = 1 << 0
PLATFORM_TSME_EN = 1 << 1
PLATFORM_CIPHERTEXT_HIDING_EN = 1 << 4


@dataclass(frozen=True, slots=True)
class TcbVersion:
    """A TCB_VERSION: the security patch levels of each firmware component. `fmc` exists only
    on Turin, whose byte layout differs from Milan's and Genoa's (ABI spec, Table 3)."""

    bootloader: int
    tee: int
    snp: int
    microcode: int
    fmc: int | None = None

    @classmethod
    def from_bytes(cls, raw: bytes, product: Product) -> TcbVersion:
        if len(raw) != 8:
            raise SnpReportFormatError(f"a TCB_VERSION is 8 bytes, got {len(raw)}")
        if product == "Turin":
            return cls(bootloader=raw[1], tee=raw[2], snp=raw[3], microcode=raw[7], fmc=raw[0])
        return cls(bootloader=raw[0], tee=raw[1], snp=raw[6], microcode=raw[7])

    def to_bytes(self, product: Product) -> bytes:
        if product == "Turin":
            return bytes(
                [self.fmc or 0, self.bootloader, self.tee, self.snp, 0, 0, 0, self.microcode]
            )
        return bytes([self.bootloader, self.tee, 0, 0, 0, 0, self.snp, self.microcode])

    def at_least(self, minimum: TcbVersion) -> bool:
        """Whether every component is at or above `minimum`'s (an absent fmc counts as 0)."""
        return (
            self.bootloader >= minimum.bootloader
            and self.tee >= minimum.tee
            and self.snp >= minimum.snp
            and self.microcode >= minimum.microcode
            and (self.fmc or 0) >= (minimum.fmc or 0)
        )

    def to_json(self) -> dict[str, int]:
        fields = {
            "bootloader": self.bootloader,
            "tee": self.tee,
            "snp": self.snp,
            "microcode": self.microcode,
        }
        if self.fmc is not None:
            fields["fmc"] = self.fmc
        return fields


@dataclass(frozen=True, slots=True)
class SnpReport:
    """A parsed ATTESTATION_REPORT. TCB fields are kept raw (8 bytes) because their layout
    depends on the product, which is known only once the chain says which ARK signed."""

    raw: bytes
    version: int
    guest_svn: int
    policy: int
    family_id: bytes
    image_id: bytes
    vmpl: int
    signature_algo: int
    current_tcb: bytes
    platform_info: int
    author_key_en: bool
    mask_chip_key: bool
    signing_key: int
    report_data: bytes
    measurement: bytes
    host_data: bytes
    id_key_digest: bytes
    author_key_digest: bytes
    report_id: bytes
    report_id_ma: bytes
    reported_tcb: bytes
    chip_id: bytes
    committed_tcb: bytes
    launch_tcb: bytes
    signature_r: int
    signature_s: int

    @property
    def signed_bytes(self) -> bytes:
        return self.raw[:SIGNED_SIZE]

    @property
    def debug_allowed(self) -> bool:
        return bool(self.policy & POLICY_DEBUG)

    @property
    def migrate_ma_allowed(self) -> bool:
        return bool(self.policy & POLICY_MIGRATE_MA)

    @property
    def smt_allowed(self) -> bool:
        return bool(self.policy & POLICY_SMT)

    @property
    def platform_smt_enabled(self) -> bool:
        return bool(self.platform_info & PLATFORM_SMT_EN)

    @property
    def tsme_enabled(self) -> bool:
        return bool(self.platform_info & PLATFORM_TSME_EN)

    @property
    def ciphertext_hiding_enabled(self) -> bool:
        return self.version >= 3 and bool(self.platform_info & PLATFORM_CIPHERTEXT_HIDING_EN)

    @classmethod
    def parse(cls, raw: bytes) -> SnpReport:
        """Parse `raw` strictly. Raises SnpReportFormatError on a wrong size, an unsupported
        version or signature algorithm, a non-zero reserved field, or an out-of-range value."""
        raw = bytes(raw)
        if len(raw) != REPORT_SIZE:
            raise SnpReportFormatError(f"an SEV-SNP report is {REPORT_SIZE} bytes, got {len(raw)}")
        version, guest_svn, policy = struct.unpack_from("<IIQ", raw, 0x00)
        if version not in SUPPORTED_VERSIONS:
            raise SnpReportFormatError(
                f"unsupported SEV-SNP report version {version} (supported: {SUPPORTED_VERSIONS})"
            )
        vmpl, signature_algo = struct.unpack_from("<II", raw, 0x30)
        if vmpl > 3:
            raise SnpReportFormatError(f"VMPL {vmpl} is out of range 0-3")
        if signature_algo != SIGNATURE_ALGO_ECDSA_P384_SHA384:
            raise SnpReportFormatError(
                f"signature algorithm {signature_algo} is not ECDSA P-384 with SHA-384 (1)"
            )
        if not policy & POLICY_RESERVED_ONE:
            raise SnpReportFormatError("guest policy bit 17 is reserved and must be 1")
        (key_info,) = struct.unpack_from("<I", raw, 0x48)
        if key_info & ~0x1F:
            raise SnpReportFormatError("reserved bits of the signing-key field are set")
        reserved = [(0x4C, 0x50), (0x1EB, 0x1EC), (0x1EF, 0x1F0)]
        reserved.append((0x18B if version >= 3 else 0x188, 0x1A0))
        reserved.append((0x208 if version >= 5 else 0x1F8, SIGNED_SIZE))
        reserved.append((SIGNED_SIZE + 144, REPORT_SIZE))
        for start, end in reserved:
            if any(raw[start:end]):
                raise SnpReportFormatError(
                    f"reserved bytes 0x{start:03X}-0x{end - 1:03X} must be zero"
                )
        r_field = raw[SIGNED_SIZE : SIGNED_SIZE + 72]
        s_field = raw[SIGNED_SIZE + 72 : SIGNED_SIZE + 144]
        if any(r_field[48:]) or any(s_field[48:]):
            raise SnpReportFormatError("signature r/s exceed 48 bytes (P-384)")
        return cls(
            raw=raw,
            version=version,
            guest_svn=guest_svn,
            policy=policy,
            family_id=raw[0x10:0x20],
            image_id=raw[0x20:0x30],
            vmpl=vmpl,
            signature_algo=signature_algo,
            current_tcb=raw[0x38:0x40],
            platform_info=struct.unpack_from("<Q", raw, 0x40)[0],
            author_key_en=bool(key_info & 1),
            mask_chip_key=bool(key_info & 2),
            signing_key=(key_info >> 2) & 0x7,
            report_data=raw[0x50:0x90],
            measurement=raw[0x90:0xC0],
            host_data=raw[0xC0:0xE0],
            id_key_digest=raw[0xE0:0x110],
            author_key_digest=raw[0x110:0x140],
            report_id=raw[0x140:0x160],
            report_id_ma=raw[0x160:0x180],
            reported_tcb=raw[0x180:0x188],
            chip_id=raw[0x1A0:0x1E0],
            committed_tcb=raw[0x1E0:0x1E8],
            launch_tcb=raw[0x1F0:0x1F8],
            signature_r=int.from_bytes(r_field, "little"),
            signature_s=int.from_bytes(s_field, "little"),
        )


def parse_certificate_table(blob: bytes) -> dict[uuid.UUID, bytes]:
    """The certificates of an extended-report certificate table (the configfs-tsm `auxblob` of
    an SNP report): entries of GUID (16 bytes), offset (u32), length (u32), ended by an
    all-zero entry; offsets are from the start of the table. Raises SnpReportFormatError."""
    certificates: dict[uuid.UUID, bytes] = {}
    position = 0
    while True:
        if position + 24 > len(blob):
            raise SnpReportFormatError("certificate table has no terminating all-zero entry")
        guid_bytes = blob[position : position + 16]
        offset, length = struct.unpack_from("<II", blob, position + 16)
        position += 24
        if not any(guid_bytes) and offset == 0 and length == 0:
            return certificates
        guid = uuid.UUID(bytes=guid_bytes)
        if offset < position or offset + length > len(blob):
            raise SnpReportFormatError(f"certificate table entry {guid} points outside the table")
        if guid in certificates:
            raise SnpReportFormatError(f"certificate table names {guid} twice")
        certificates[guid] = blob[offset : offset + length]


def build_certificate_table(certificates: Mapping[uuid.UUID, bytes]) -> bytes:
    """The inverse of `parse_certificate_table` (for tests and for tools that bundle a VCEK)."""
    header_size = 24 * (len(certificates) + 1)
    header = b""
    body = b""
    for guid, der in certificates.items():
        header += guid.bytes + struct.pack("<II", header_size + len(body), len(der))
        body += der
    return header + bytes(24) + body


def load_amd_certificate(data: bytes) -> x509.Certificate:
    """A certificate from DER or PEM bytes, with every field verification reads parsed now.
    AMD issues VCEKs with serial number 0, which RFC 5280 forbids and cryptography warns about;
    the warning is silenced here, for AMD's certificates only, because the serial plays no part
    in SNP verification. Raises SnpReportFormatError."""
    with warnings.catch_warnings():
        # cryptography warns (rather than fails) on a name attribute of the wrong length: here
        # that is a malformed certificate. (The later filter takes precedence.)
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        try:
            if data.lstrip().startswith(b"-----BEGIN"):
                cert = x509.load_pem_x509_certificate(data)
            else:
                cert = x509.load_der_x509_certificate(data)
            # cryptography parses names, extensions and keys lazily and raises a variety of
            # exception types (ValueError, KeyError, InvalidVersion, UnsupportedAlgorithm) on
            # malformed ones: touch them all here so that any defect is one typed error.
            _ = (cert.subject, cert.issuer, list(cert.extensions), cert.public_key())
            _ = (cert.not_valid_before_utc, cert.not_valid_after_utc, cert.signature_algorithm_oid)
            _ = cert.signature_hash_algorithm
        except Exception as exc:
            raise SnpReportFormatError(f"not a well-formed X.509 certificate: {exc!r}") from exc
    return cert


def verify_amd_signature(cert: x509.Certificate, issuer: x509.Certificate, role: str) -> None:
    """`cert` (named `role` in errors) is signed by `issuer`'s RSA key with AMD's RSASSA-PSS
    SHA-384 parameters. Raises SnpCertificateChainError."""
    if cert.signature_algorithm_oid != SignatureAlgorithmOID.RSASSA_PSS:
        raise SnpCertificateChainError(f"the {role} is not signed with RSASSA-PSS")
    if not isinstance(cert.signature_hash_algorithm, hashes.SHA384):
        raise SnpCertificateChainError(f"the {role} signature does not use SHA-384")
    issuer_key = issuer.public_key()
    if not isinstance(issuer_key, rsa.RSAPublicKey):
        raise SnpCertificateChainError(f"the issuer of the {role} has no RSA key")
    if _outer_algorithm(cert) != _inner_algorithm(cert):
        # RFC 5280 4.1.1.2: the two must be equal. The outer one is not signed, and the PSS
        # parameters used here are AMD's fixed ones, so a difference means tampering.
        raise SnpCertificateChainError(
            f"the {role}'s signature algorithm differs from the one its signed part names"
        )
    if cert.issuer != issuer.subject:
        raise SnpCertificateChainError(
            f"the {role}'s issuer is not {issuer.subject.rfc4514_string()}"
        )
    try:
        issuer_key.verify(cert.signature, cert.tbs_certificate_bytes, AMD_PSS, hashes.SHA384())
    except InvalidSignature:
        raise SnpCertificateChainError(
            f"the {role} signature does not verify under {issuer.subject.rfc4514_string()}"
        ) from None


def _der_children(data: bytes) -> list[bytes]:
    """The encoded elements inside one DER SEQUENCE `data` (tag, length, contents each)."""

    def element_end(position: int) -> tuple[int, int]:
        length = data[position + 1]
        header = 2
        if length & 0x80:
            num_bytes = length & 0x7F
            length = int.from_bytes(data[position + 2 : position + 2 + num_bytes], "big")
            header += num_bytes
        return position + header, position + header + length

    start, end = element_end(0)
    children = []
    while start < end:
        _, child_end = element_end(start)
        children.append(data[start:child_end])
        start = child_end
    return children


def _outer_algorithm(cert: x509.Certificate) -> bytes:
    return _der_children(cert.public_bytes(Encoding.DER))[1]


def _inner_algorithm(cert: x509.Certificate) -> bytes:
    fields = _der_children(cert.tbs_certificate_bytes)
    return fields[2] if fields[0][:1] == b"\xa0" else fields[1]


def _check_signing_ca(cert: x509.Certificate, role: str) -> None:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        raise SnpCertificateChainError(
            f"the {role} lacks basic constraints or key usage: not a signing CA"
        ) from None
    if not constraints.ca or not usage.key_cert_sign:
        raise SnpCertificateChainError(f"the {role} is not a CA allowed to sign certificates")


def _check_validity(cert: x509.Certificate, role: str, at: datetime) -> None:
    if not cert.not_valid_before_utc <= at <= cert.not_valid_after_utc:
        raise SnpCertificateChainError(
            f"the {role} is valid from {cert.not_valid_before_utc.isoformat()} to "
            f"{cert.not_valid_after_utc.isoformat()}, not at {at.isoformat()}"
        )


def verify_snp_chain(
    vcek: x509.Certificate,
    ask: x509.Certificate,
    arks: Mapping[Product, x509.Certificate],
    at: datetime,
) -> Product:
    """Step 2: the product whose pinned ARK signed `ask`, which signed `vcek`; the ARK is
    self-signed and every certificate is valid at `at`. An ARK presented with the evidence is
    never used: only `arks` (the pinned ones) can anchor the chain."""
    if not arks:
        raise SnpCertificateChainError("no ARK is pinned: SEV-SNP evidence can never verify")
    for product, ark in arks.items():
        if ask.issuer != ark.subject:
            continue
        try:
            verify_amd_signature(ask, ark, "ASK")
        except SnpCertificateChainError:
            continue
        verify_amd_signature(ark, ark, f"pinned ARK-{product}")
        _check_signing_ca(ask, "ASK")
        verify_amd_signature(vcek, ask, "VCEK")
        for cert, role in ((ark, f"ARK-{product}"), (ask, "ASK"), (vcek, "VCEK")):
            _check_validity(cert, role, at)
        if not isinstance(vcek.public_key(), ec.EllipticCurvePublicKey) or not isinstance(
            vcek.public_key().curve, ec.SECP384R1
        ):
            raise SnpCertificateChainError("the VCEK's key is not an ECDSA P-384 key")
        return product
    raise SnpCertificateChainError(
        f"the ASK ({ask.subject.rfc4514_string()}) is not signed by any pinned ARK "
        f"({', '.join(arks)})"
    )


def _extension_bytes(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> bytes | None:
    try:
        value = cert.extensions.get_extension_for_oid(oid).value
    except x509.ExtensionNotFound:
        return None
    assert isinstance(value, x509.UnrecognizedExtension)
    return value.value


def _der_small_integer(data: bytes | None, name: str) -> int:
    """A DER INTEGER 0-255 as AMD encodes SPLs (02 01 xx, or 02 02 00 xx above 127)."""
    if data is None:
        raise SnpVcekMismatchError(f"the VCEK lacks the {name} extension")
    if len(data) < 3 or data[0] != 0x02 or data[1] != len(data) - 2 or data[1] > 2:
        raise SnpVcekMismatchError(f"the VCEK's {name} extension is not a small DER INTEGER")
    return int.from_bytes(data[2:], "big", signed=True)


def vcek_tcb(vcek: x509.Certificate, product: Product) -> TcbVersion:
    """The TCB the VCEK was derived for, from its SPL extensions."""
    return TcbVersion(
        bootloader=_der_small_integer(_extension_bytes(vcek, OID_BOOTLOADER_SPL), "blSPL"),
        tee=_der_small_integer(_extension_bytes(vcek, OID_TEE_SPL), "teeSPL"),
        snp=_der_small_integer(_extension_bytes(vcek, OID_SNP_SPL), "snpSPL"),
        microcode=_der_small_integer(_extension_bytes(vcek, OID_MICROCODE_SPL), "ucodeSPL"),
        fmc=(
            _der_small_integer(_extension_bytes(vcek, OID_FMC_SPL), "fmcSPL")
            if product == "Turin"
            else None
        ),
    )


def verify_vcek_binding(report: SnpReport, vcek: x509.Certificate, product: Product) -> None:
    """Step 3: the VCEK is this chip's key for the report's REPORTED_TCB. A VCEK is derived
    from the chip's secret and the TCB, so a VCEK for another TCB signing means either a
    mismatched certificate or a chip claiming a TCB it does not run."""
    name = _extension_bytes(vcek, OID_PRODUCT_NAME)
    if name is None or product.encode() not in name:
        raise SnpVcekMismatchError(f"the VCEK's product name does not name {product}")
    if report.signing_key != 0:
        raise SnpVcekMismatchError(
            f"the report is signed by key type {report.signing_key} (1 = VLEK); only VCEK-signed "
            "reports are supported"
        )
    certified = vcek_tcb(vcek, product)
    reported = TcbVersion.from_bytes(report.reported_tcb, product)
    if certified != reported:
        raise SnpVcekMismatchError(
            f"the VCEK certifies TCB {certified.to_json()}, the report names {reported.to_json()}"
        )
    hwid = _extension_bytes(vcek, OID_HWID)
    if report.mask_chip_key:
        return
    # Turin VCEKs carry only the first 8 bytes of the chip id.
    expected = report.chip_id[:8] if product == "Turin" else report.chip_id
    # The extension holds the raw bytes; some issuers wrap them in one DER OCTET STRING.
    if hwid not in (expected, b"\x04" + bytes([len(expected)]) + expected):
        raise SnpVcekMismatchError("the VCEK is for another chip (hwID differs from CHIP_ID)")


def verify_report_signature(report: SnpReport, vcek: x509.Certificate) -> None:
    """Step 4: the ECDSA P-384 SHA-384 signature (r, s little-endian) over bytes 0x000-0x29F."""
    key = vcek.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)  # checked in step 2
    signature = encode_dss_signature(report.signature_r, report.signature_s)
    try:
        key.verify(signature, report.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise SnpSignatureError("the report signature does not verify under the VCEK") from None


def verify_snp_report(
    report: SnpReport,
    *,
    vcek: x509.Certificate,
    ask: x509.Certificate,
    arks: Mapping[Product, x509.Certificate],
    at: datetime,
) -> Product:
    """Steps 2-4 of the plan above; returns the product whose pinned ARK anchors the chain.
    Raises the step's VerificationError subclass. Says nothing about report_data or policy."""
    product = verify_snp_chain(vcek, ask, arks, at)
    verify_vcek_binding(report, vcek, product)
    verify_report_signature(report, vcek)
    return product
