"""The part of W3C XML Signature 1.1 that NVIDIA's reference manifests use, and nothing more:
one enveloped signature over the whole document, ECDSA-P384 over SHA-384, Canonical XML 1.1.

Verification plan (each step raises the error named):
  1. Parse without DTDs, entities or network access; refuse a DOCTYPE (RimFormatError).
  2. Find exactly one ds:Signature in the document, a child of the root element, with exactly
     one ds:Reference whose URI is "" (the whole document) — the shape that leaves no room for
     signature-wrapping: nothing outside the signed node-set can be read later (RimFormatError).
  3. Require the algorithms: C14N 1.1 for SignedInfo, ecdsa-sha384, transforms exactly
     [enveloped-signature, C14N 1.1], digest sha384 (RimFormatError: any other is refused).
  4. Digest the document with the Signature element removed, canonicalized, and compare with
     DigestValue (RimSignatureError).
  5. Verify SignatureValue (raw r ‖ s, 96 bytes) over canonical SignedInfo with the public key of
     the first KeyInfo certificate (RimSignatureError). The chain is checked by the caller.

Canonicalization: lxml exposes only Canonical XML 1.0 (libxml2's 1.1 mode is not reachable
through it); 1.1 differs from 1.0 only in how
xml:id and xml:base attributes are inherited into a document subset from ancestors outside it.
For the whole document there is no such ancestor, and for SignedInfo the only ancestors are the
Signature and root elements; a document carrying any xml:* attribute on those is refused, so the
1.0 output this module computes equals the 1.1 output the signer computed, or verification fails.

The verified content is handed back as the canonical bytes that were digested; callers read
measurements only from those bytes, re-parsed, never from the tree the signature was found in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from lxml import etree

from attestation.gpu.chain import load_certificates
from attestation.gpu.errors import RimFormatError, RimSignatureError

DS = "http://www.w3.org/2000/09/xmldsig#"
C14N_11 = "http://www.w3.org/2006/12/xml-c14n11"
ENVELOPED = "http://www.w3.org/2000/09/xmldsig#enveloped-signature"
ECDSA_SHA384 = "http://www.w3.org/2001/04/xmldsig-more#ecdsa-sha384"
SHA384 = "http://www.w3.org/2001/04/xmldsig-more#sha384"
XML_NS = "http://www.w3.org/XML/1998/namespace"
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SignedDocument:
    """A document whose enveloped signature verified: `canonical` is exactly the digested
    content (the document without its Signature, canonicalized); `certificates` the KeyInfo
    certificates in document order, the first being the signer (its chain is not yet checked)."""

    canonical: bytes
    certificates: tuple[x509.Certificate, ...]


def parse_xml(data: bytes) -> etree._ElementTree:
    """Parse `data` with every network, DTD and entity feature off. Raises RimFormatError."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise RimFormatError(f"document of {len(data)} bytes exceeds {MAX_DOCUMENT_BYTES}")
    parser = etree.XMLParser(
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        remove_blank_text=False,
    )
    try:
        tree = etree.ElementTree(etree.fromstring(data, parser))
    except etree.XMLSyntaxError as exc:
        raise RimFormatError(f"not well-formed XML: {exc}") from exc
    if tree.docinfo.doctype or tree.docinfo.internalDTD is not None:
        raise RimFormatError("document has a DOCTYPE; reference manifests never do")
    return tree


def canonicalize(node: etree._Element | etree._ElementTree) -> bytes:
    """Inclusive canonical XML without comments of a document or of an element's subtree
    (with the namespace declarations in scope), see the module docstring on 1.0 versus 1.1."""
    return etree.tostring(node, method="c14n", exclusive=False, with_comments=False)


def document_without_signature(data: bytes) -> bytes:
    """The enveloped-signature transform followed by canonicalization: the canonical bytes of
    the document `data` with its one top-level ds:Signature element removed."""
    tree = parse_xml(data)
    root = tree.getroot()
    signature = _the_signature(root)
    _remove_keeping_tail(signature)
    return canonicalize(tree)


def verify_enveloped_signature(data: bytes) -> SignedDocument:
    """Verify the enveloped XML signature of `data` (steps 1-5 of the module docstring) and
    return the signed content. Raises RimFormatError or RimSignatureError."""
    tree = parse_xml(data)
    root = tree.getroot()
    signature = _the_signature(root)
    for element in (root, signature):
        if any(name.startswith(f"{{{XML_NS}}}") for name in element.attrib):
            raise RimFormatError(
                "xml:* attribute on the root or Signature element: Canonical XML 1.0 and 1.1 "
                "could differ, so the signature is refused rather than guessed"
            )
    signed_info = _one(signature, "SignedInfo")
    _require_algorithm(_one(signed_info, "CanonicalizationMethod"), C14N_11)
    _require_algorithm(_one(signed_info, "SignatureMethod"), ECDSA_SHA384)
    reference = _one(signed_info, "Reference")
    if reference.get("URI") != "":
        raise RimFormatError(f'Reference URI is {reference.get("URI")!r}, not "" (the document)')
    transforms = [t.get("Algorithm") for t in _one(reference, "Transforms")]
    if transforms != [ENVELOPED, C14N_11]:
        raise RimFormatError(f"transforms {transforms} are not [enveloped-signature, C14N 1.1]")
    _require_algorithm(_one(reference, "DigestMethod"), SHA384)
    expected_digest = _base64(_one(reference, "DigestValue").text, "DigestValue")
    signature_value = _base64(_one(signature, "SignatureValue").text, "SignatureValue")
    certificates = _key_info_certificates(signature)

    canonical = document_without_signature(data)
    if hashlib.sha384(canonical).digest() != expected_digest:
        raise RimSignatureError("document digest differs from the signed DigestValue")
    if len(signature_value) != 96:
        raise RimSignatureError(f"SignatureValue is {len(signature_value)} bytes, not 96 (r ‖ s)")
    public_key = certificates[0].public_key()
    if (
        not isinstance(public_key, ec.EllipticCurvePublicKey)
        or public_key.curve.name != "secp384r1"
    ):
        raise RimSignatureError("the signer certificate's key is not ECDSA P-384")
    der = encode_dss_signature(
        int.from_bytes(signature_value[:48], "big"), int.from_bytes(signature_value[48:], "big")
    )
    try:
        public_key.verify(der, canonicalize(signed_info), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise RimSignatureError("SignatureValue does not verify over SignedInfo") from None
    return SignedDocument(canonical=canonical, certificates=certificates)


def _the_signature(root: etree._Element) -> etree._Element:
    signatures = root.findall(f".//{{{DS}}}Signature")
    if root.tag == f"{{{DS}}}Signature" or len(signatures) != 1:
        raise RimFormatError(f"document holds {len(signatures)} ds:Signature elements, not one")
    if signatures[0].getparent() is not root:
        raise RimFormatError("ds:Signature is not a child of the root element")
    return signatures[0]


def _remove_keeping_tail(element: etree._Element) -> None:
    """Remove `element` but keep the text that follows it (lxml stores it on the element)."""
    parent = element.getparent()
    tail = element.tail or ""
    previous = element.getprevious()
    if previous is not None:
        previous.tail = (previous.tail or "") + tail
    else:
        parent.text = (parent.text or "") + tail
    parent.remove(element)


def _one(parent: etree._Element, name: str) -> etree._Element:
    found = parent.findall(f"{{{DS}}}{name}")
    if len(found) != 1:
        raise RimFormatError(f"ds:{parent.tag.split('}')[-1]} has {len(found)} ds:{name}, not one")
    return found[0]


def _require_algorithm(element: etree._Element, algorithm: str) -> None:
    if element.get("Algorithm") != algorithm:
        name = element.tag.split("}")[-1]
        raise RimFormatError(f"{name} {element.get('Algorithm')!r} is not {algorithm}")


def _base64(text: str | None, what: str) -> bytes:
    try:
        return base64.b64decode("".join((text or "").split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RimFormatError(f"{what} is not base64") from exc


def _key_info_certificates(signature: etree._Element) -> tuple[x509.Certificate, ...]:
    elements = signature.findall(f"{{{DS}}}KeyInfo/{{{DS}}}X509Data/{{{DS}}}X509Certificate")
    if not elements:
        raise RimFormatError("KeyInfo carries no X509Certificate: the signer is unknown")
    return tuple(
        cert
        for element in elements
        for cert in load_certificates(
            _base64(element.text, "X509Certificate"), pem=False, error=RimFormatError
        )
    )
