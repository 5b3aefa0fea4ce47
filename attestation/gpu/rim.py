"""NVIDIA reference integrity manifests (RIMs): SWID tags (ISO/IEC 19770-2) listing the golden
SHA-384 measurements of a driver or a VBIOS, signed with an enveloped XML signature under the
CoRIM signing root.

Shape read (from the verified, canonical bytes only):

    <SoftwareIdentity xmlns=SWID ...>
      <Meta colloquialVersion="550.90.07" product="GH100" .../>        driver: dotted decimal
                                                                        VBIOS: five hex bytes
      <Payload>
        <Resource type="Measurement" index="i" active="True|False" alternatives="n"
                  xmlenc-sha384:Hash0="hex" ... Hash{n-1}="hex" size="48"/>   i = 0..63
      </Payload>
      <ds:Signature>...</ds:Signature>
    </SoftwareIdentity>

Golden index i is compared with measurement block i+1 of the report (only active entries).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from lxml import etree

from attestation.gpu.chain import verify_links
from attestation.gpu.errors import RimChainError, RimFormatError
from attestation.gpu.xmldsig import parse_xml, verify_enveloped_signature

SWID = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
HASH_NS = "http://www.w3.org/2001/04/xmlenc#sha384"
_VBIOS_VERSION = re.compile(r"^[0-9A-Fa-f]{2}(\.[0-9A-Fa-f]{2}){4}$")


@dataclass(frozen=True, slots=True)
class Rim:
    """A RIM whose signature verified and whose chain leads to the pinned CoRIM root (validity
    at a given time is the caller's check). `golden[i]` holds the alternatives of active entry i;
    `signer_chain` is the KeyInfo chain without the root, signer first."""

    name: str
    version: str
    product: str
    golden: Mapping[int, tuple[bytes, ...]]
    signer_chain: tuple[x509.Certificate, ...]

    @property
    def kind(self) -> str:
        return "vbios" if _VBIOS_VERSION.match(self.version) else "driver"


def rim_version(data: bytes) -> str | None:
    """The colloquialVersion of an UNVERIFIED RIM, to choose which file to verify; None if it
    has none. Never use it as a claim: the verified `Rim.version` is re-read and compared."""
    try:
        meta = parse_xml(data).getroot().find(f"{{{SWID}}}Meta")
    except RimFormatError:
        return None
    return None if meta is None else meta.get("colloquialVersion")


def verify_rim(data: bytes, *, name: str, corim_root: x509.Certificate) -> Rim:
    """Verify the XML signature of `data`, its signing chain up to `corim_root` (links, key
    usage, basic constraints; not validity), and parse the measurements from the signed bytes.
    Raises RimFormatError, RimSignatureError or RimChainError."""
    signed = verify_enveloped_signature(data)
    chain = list(signed.certificates)
    root_der = corim_root.public_bytes(Encoding.DER)
    if chain and chain[-1].public_bytes(Encoding.DER) == root_der:
        chain.pop()
    for cert in chain:
        if cert.subject == cert.issuer:
            raise RimChainError(
                f"RIM {name} is signed under the root {cert.subject.rfc4514_string()}, "
                "not the pinned CoRIM root"
            )
    if not chain:
        raise RimChainError(f"RIM {name} is signed by the root itself, not a RIM signer")
    verify_links(chain, corim_root, error=RimChainError, what=f"RIM {name} signing")
    root = etree.fromstring(signed.canonical)
    return _parse_signed(root, name, tuple(chain))


def _parse_signed(root: etree._Element, name: str, chain: tuple[x509.Certificate, ...]) -> Rim:
    if root.tag != f"{{{SWID}}}SoftwareIdentity":
        raise RimFormatError(f"RIM {name}: root element is {root.tag}, not SoftwareIdentity")
    metas, payloads = root.findall(f"{{{SWID}}}Meta"), root.findall(f"{{{SWID}}}Payload")
    if len(metas) != 1 or len(payloads) != 1:
        raise RimFormatError(f"RIM {name}: needs exactly one Meta and one Payload")
    version = metas[0].get("colloquialVersion")
    if not version:
        raise RimFormatError(f"RIM {name}: Meta has no colloquialVersion")
    golden: dict[int, tuple[bytes, ...]] = {}
    seen: set[int] = set()
    for resource in payloads[0].findall(f"{{{SWID}}}Resource"):
        if resource.get("type") != "Measurement":
            continue
        index, active, alternatives = _resource_fields(resource, name)
        if index in seen:
            raise RimFormatError(f"RIM {name}: measurement index {index} appears twice")
        seen.add(index)
        if active:
            golden[index] = alternatives
    return Rim(name, version, metas[0].get("product", ""), MappingProxyType(golden), chain)


def _resource_fields(resource: etree._Element, name: str) -> tuple[int, bool, tuple[bytes, ...]]:
    try:
        index = int(resource.get("index", ""))
        count = int(resource.get("alternatives", ""))
    except ValueError:
        raise RimFormatError(
            f"RIM {name}: a measurement has a non-integer index or count"
        ) from None
    active = resource.get("active")
    if active not in ("True", "False") or not 0 <= index < 255 or not 1 <= count <= 16:
        raise RimFormatError(
            f"RIM {name}: measurement {index} has active={active!r}, count {count}"
        )
    values = []
    for n in range(count):
        text = resource.get(f"{{{HASH_NS}}}Hash{n}")
        if text is None or len(text) != 96:
            raise RimFormatError(f"RIM {name}: measurement {index} lacks a 48-byte Hash{n}")
        try:
            values.append(bytes.fromhex(text))
        except ValueError:
            raise RimFormatError(f"RIM {name}: measurement {index} Hash{n} is not hex") from None
    return index, active == "True", tuple(values)


def compare_measurements(
    measurements: Mapping[int, bytes], rims: Sequence[Rim]
) -> tuple[int, list[int]]:
    """Compare report blocks with the golden values of `rims` (index i ↔ block i+1). Returns the
    number of blocks compared and the block indices that match no alternative (a block the
    report lacks counts as mismatched). Raises RimFormatError if two RIMs claim one index."""
    golden: dict[int, tuple[bytes, ...]] = {}
    for rim in rims:
        for index, alternatives in rim.golden.items():
            if index in golden:
                raise RimFormatError(f"RIMs overlap: two define golden measurement index {index}")
            golden[index] = alternatives
    mismatched = [
        index + 1
        for index, alternatives in sorted(golden.items())
        if measurements.get(index + 1) not in alternatives
    ]
    return len(golden), mismatched
