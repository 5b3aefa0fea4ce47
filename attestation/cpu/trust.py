"""What CPU verification trusts: the pinned AMD ARKs (one per processor line), an offline cache
of AMD ASK/VCEK certificates for reports that carry none, the pinned Intel SGX Root CA, and the
bundled Intel DCAP collateral (per platform FMSPC) for TDX quotes.

The roots are built in (`attestation.cpu.roots`: AMD's ARKs, Intel's SGX Root CA). On disk
(`CpuTrust.load(directory)`), every part is optional:
  snp/ark-<product>.pem    an ARK pinned instead of AMD's for that product (a test CA); each
                           self-signed (RSA-PSS SHA-384), CN "ARK-<product>"
  snp/certificates/*       ASK and VCEK certificates (PEM or DER) for reports without any
  snp/crl-<product>.der    AMD's CRL for that product (PEM or DER; `attestation.cpu.revocation`)
  tdx/root_ca.pem          a root pinned instead of Intel's SGX Root CA
  tdx/collateral/*.json    dcap-qvl QuoteCollateralV3 JSON, one file per FMSPC
Without collateral, TDX evidence can never verify (an air-gapped appliance cannot fetch it);
that is reported by verification, not refused at load, so an SNP-only appliance needs no Intel
files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from attestation.cpu.roots import amd_arks, intel_sgx_root_ca_der
from attestation.cpu.snp import PRODUCTS, Product, load_amd_certificate, verify_amd_signature
from attestation.errors import AttestationError, PolicyError
from attestation.input_limits import MAX_COLLATERAL_BYTES, parse_json, read_file


@dataclass(frozen=True, slots=True)
class CpuTrust:
    """Trust anchors and offline collateral: the pinned ARK per product, cached ASK/VCEK
    certificates, AMD's CRL per product, the pinned Intel root (DER), and `tdx_collateral`
    mapping an upper-case FMSPC hex string to dcap-qvl collateral JSON for that platform.
    An empty field means that part of verification can never pass (or, for CRLs, reports
    "unchecked"); it is never skipped."""

    snp_arks: Mapping[Product, x509.Certificate] = field(default_factory=dict)
    snp_certificates: tuple[x509.Certificate, ...] = ()
    snp_crls: Mapping[Product, x509.CertificateRevocationList] = field(default_factory=dict)
    tdx_root_ca_der: bytes | None = None
    tdx_collateral: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def builtin(cls) -> CpuTrust:
        """AMD's ARKs and Intel's SGX Root CA, and no collateral."""
        return cls(snp_arks=amd_arks(), tdx_root_ca_der=intel_sgx_root_ca_der())

    @classmethod
    def load(cls, directory: Path, *, builtin_roots: bool = True) -> CpuTrust:
        """Load the layout of the module docstring on top of the built-in roots (or of none,
        with `builtin_roots=False`): `snp/ark-<product>.pem` replaces AMD's ARK of that product
        only, `tdx/root_ca.pem` replaces Intel's root; a root the directory does not pin stays
        the built-in one. Raises PolicyError on an unreadable or malformed file, an ARK that is
        not self-signed, or collateral without an FMSPC."""
        directory = Path(directory)
        builtin = cls.builtin() if builtin_roots else cls()
        arks: dict[Product, x509.Certificate] = {}
        for path in sorted((directory / "snp").glob("ark-*.pem")):
            ark = _load_certificate(path)
            product = ark_product(ark)
            if product in arks:
                raise PolicyError(f"{path}: a second ARK for {product}")
            arks[product] = ark
        cache = tuple(
            _load_certificate(path)
            for path in sorted((directory / "snp" / "certificates").glob("*"))
            if path.is_file()
        )
        crls: dict[Product, x509.CertificateRevocationList] = {}
        for path in sorted((directory / "snp").glob("crl-*")):
            crl = _load_crl(path)
            crls[_crl_product(crl, path)] = crl
        # Each pinned root replaces only its own built-in counterpart: a directory that brings
        # only Intel's collateral (the usual case) keeps Intel's root, as one that pins a test
        # ARK for one product keeps AMD's ARKs for the others.
        root_path = directory / "tdx" / "root_ca.pem"
        root = (
            _load_certificate(root_path).public_bytes(Encoding.DER)
            if root_path.exists()
            else builtin.tdx_root_ca_der
        )
        collateral: dict[str, str] = {}
        for path in sorted((directory / "tdx" / "collateral").glob("*.json")):
            data = read_file(
                path, what="collateral file", error=PolicyError, max_bytes=MAX_COLLATERAL_BYTES
            )
            fmspc = collateral_fmspc(data, path)
            collateral[fmspc] = data.decode("utf-8")  # UTF-8: checked by collateral_fmspc
        return cls({**builtin.snp_arks, **arks}, cache, crls, root, collateral)


def ark_product(ark: x509.Certificate) -> Product:
    """The processor line a pinned ARK belongs to (from its CN "ARK-<product>"), after checking
    that it is self-signed. Raises PolicyError otherwise."""
    names = ark.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(names[0].value) if names else ""
    product = name.removeprefix("ARK-")
    if not name.startswith("ARK-") or product not in PRODUCTS:
        raise PolicyError(f"pinned ARK has CN {name!r}, expected ARK-<one of {PRODUCTS}>")
    try:
        verify_amd_signature(ark, ark, f"pinned ARK-{product}")
    except AttestationError as exc:
        raise PolicyError(f"pinned ARK-{product} is not validly self-signed: {exc}") from exc
    return product  # type: ignore[return-value]


def collateral_fmspc(data: bytes | str, source: Path | str) -> str:
    """The FMSPC (upper-case hex) of a QuoteCollateralV3 JSON document, read from its TCB info
    (itself a JSON string), each within the limits of attestation.input_limits. Raises
    PolicyError."""
    collateral = parse_json(
        data, what=f"collateral {source}", error=PolicyError, max_bytes=MAX_COLLATERAL_BYTES
    )
    tcb_info_text = collateral.get("tcb_info") if isinstance(collateral, dict) else None
    if not isinstance(tcb_info_text, str):
        raise PolicyError(f"{source}: not dcap-qvl collateral JSON with a TCB info FMSPC")
    tcb_info = parse_json(
        tcb_info_text, what=f"{source} tcb_info", error=PolicyError, max_bytes=MAX_COLLATERAL_BYTES
    )
    if not isinstance(tcb_info, dict) or not isinstance(tcb_info.get("fmspc"), str):
        raise PolicyError(f"{source}: not dcap-qvl collateral JSON with a TCB info FMSPC")
    return tcb_info["fmspc"].upper()


def _load_crl(path: Path) -> x509.CertificateRevocationList:
    try:
        data = path.read_bytes()
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_crl(data)
        return x509.load_der_x509_crl(data)
    except (OSError, ValueError) as exc:
        raise PolicyError(f"cannot load CRL {path}: {exc}") from exc


def _crl_product(crl: x509.CertificateRevocationList, path: Path) -> Product:
    names = crl.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    product = str(names[0].value).removeprefix("ARK-") if names else ""
    if product not in PRODUCTS:
        raise PolicyError(f"{path}: a CRL not issued by an ARK-<product> ({PRODUCTS})")
    return product  # type: ignore[return-value]


def _load_certificate(path: Path) -> x509.Certificate:
    try:
        return load_amd_certificate(path.read_bytes())
    except (OSError, AttestationError) as exc:
        raise PolicyError(f"cannot load certificate {path}: {exc}") from exc
