"""RIMs: the XML signature, the signing chain, and the golden comparison, against real NVIDIA
RIMs altered by hand and synthetic RIMs signed under a test CoRIM root. Each defect is named."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.gpu import verify_gpu_evidence
from attestation.gpu.errors import RimChainError, RimFormatError, RimSignatureError
from attestation.gpu.rim import Rim, verify_rim
from attestation.gpu.roots import nvidia_corim_root
from attestation.verdict import Verdict
from tests.attestation.gpu.conftest import BEFORE_RIM_EXPIRY, VECTORS
from tests.attestation.gpu.synthetic import (
    SyntheticGpuSetup,
    issue,
    measurement,
    rim_document,
    sign_swid,
    synthetic_gpu_setup,
)

DRIVER_545 = (VECTORS / "h100-545" / "driver_rim_545.00.swidtag").read_bytes()
MEASUREMENT_7 = (
    b"0e0ee161b59bf124ce6b6dca6efa7616d28077862c0e57dca7d5efd63d00eeed"
    b"4851922941e846a38c464cbedbc168d9"
)
NOW = datetime(2026, 11, 22, tzinfo=UTC)


def verify_545(data: bytes) -> Rim:
    return verify_rim(data, name="driver_545", corim_root=nvidia_corim_root())


def test_real_driver_rim_yields_its_21_active_golden_values() -> None:
    rim = verify_545(DRIVER_545)
    assert rim.kind == "driver"
    assert rim.version == "545.00"
    assert len(rim.golden) == 21
    assert rim.golden[7] == (bytes.fromhex(MEASUREMENT_7.decode()),)
    assert rim.signer_chain[0].subject.rfc4514_string().startswith("CN=HCC RIM L4 Signer")


def test_flipped_golden_value_breaks_the_digest() -> None:
    tampered = DRIVER_545.replace(MEASUREMENT_7, b"1" + MEASUREMENT_7[1:])
    with pytest.raises(RimSignatureError, match="digest"):
        verify_545(tampered)


def test_flipped_activity_flag_breaks_the_digest() -> None:
    tampered = DRIVER_545.replace(b'index="8" active="False"', b'index="8" active="True"', 1)
    assert tampered != DRIVER_545
    with pytest.raises(RimSignatureError):
        verify_545(tampered)


def test_flipped_signature_value_breaks_the_signature() -> None:
    start = DRIVER_545.index(b"<ds:SignatureValue>") + len(b"<ds:SignatureValue>")
    char = DRIVER_545[start : start + 1]
    tampered = DRIVER_545[:start] + (b"A" if char != b"A" else b"B") + DRIVER_545[start + 1 :]
    with pytest.raises(RimSignatureError, match="does not verify"):
        verify_545(tampered)


def test_a_comment_is_not_signed_content_and_changes_nothing() -> None:
    commented = DRIVER_545.replace(b"<ns0:Payload", b"<!-- a comment --><ns0:Payload", 1)
    assert verify_545(commented).golden == verify_545(DRIVER_545).golden


def test_signature_wrapped_in_a_new_root_is_refused() -> None:
    wrapped = b"<Wrapper>" + DRIVER_545 + b"</Wrapper>"
    with pytest.raises(RimFormatError, match="not a child of the root"):
        verify_545(wrapped)


def test_second_signature_is_refused() -> None:
    start, end = DRIVER_545.index(b"<ds:Signature"), DRIVER_545.index(b"</ds:Signature>") + 15
    doubled = DRIVER_545[:end] + DRIVER_545[start:end] + DRIVER_545[end:]
    with pytest.raises(RimFormatError, match="2 ds:Signature"):
        verify_545(doubled)


def test_injected_payload_outside_the_signature_is_caught_by_the_digest() -> None:
    fake = b'<ns0:Payload><ns0:Resource type="Measurement" index="99"/></ns0:Payload>'
    injected = DRIVER_545.replace(b"<ds:Signature", fake + b"<ds:Signature", 1)
    with pytest.raises(RimSignatureError):
        verify_545(injected)


def test_doctype_with_an_entity_is_refused() -> None:
    doctype = b'<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]>'
    with pytest.raises(RimFormatError, match="DOCTYPE"):
        verify_545(doctype + DRIVER_545)


@pytest.mark.parametrize(
    ("defect", "old", "new"),
    [
        ("reference to a fragment", b'URI=""', b'URI="#payload"'),
        (
            "weaker signature method",
            b"xmldsig-more#ecdsa-sha384",
            b"xmldsig-more#ecdsa-sha256",
        ),
        (
            "C14N 1.0 instead of 1.1",
            b'CanonicalizationMethod Algorithm="http://www.w3.org/2006/12/xml-c14n11"',
            b'CanonicalizationMethod Algorithm="http://www.w3.org/TR/2001/REC-xml-c14n-20010315"',
        ),
        ("digest sha256", b"xmldsig-more#sha384", b"xmlenc#sha256"),
        ("no enveloped transform", b"xmldsig#enveloped-signature", b"xmldsig#base64"),
    ],
)
def test_unexpected_algorithm_or_reference_is_refused(defect: str, old: bytes, new: bytes) -> None:
    assert old in DRIVER_545, defect
    with pytest.raises(RimFormatError):
        verify_545(DRIVER_545.replace(old, new, 1))


def test_xml_attribute_on_the_root_is_refused_rather_than_canonicalized_by_guess() -> None:
    altered = DRIVER_545.replace(b"<SoftwareIdentity ", b'<SoftwareIdentity xml:base="x" ', 1)
    with pytest.raises(RimFormatError, match="xml:"):
        verify_545(altered)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGpuSetup:
    return synthetic_gpu_setup(tmp_path_factory.mktemp("gpu"))


def test_synthetic_rim_is_refused_under_the_nvidia_corim_root(setup: SyntheticGpuSetup) -> None:
    data = setup.ca.sign_rim("550.90.07", {0: [bytes(48)]})
    with pytest.raises(RimChainError, match="not the pinned CoRIM root"):
        verify_rim(data, name="synthetic", corim_root=nvidia_corim_root())


def test_rim_signer_without_digital_signature_usage_is_refused(setup: SyntheticGpuSetup) -> None:
    ca = setup.ca
    signer = issue("CA used as a signer", ca.corim_l3, ca=True, path_length=0)
    data = ca.sign_rim("1.0", {0: [bytes(48)]}, signer_chain=[signer, ca.corim_l3, ca.corim_ca])
    with pytest.raises(RimChainError, match="digital_signature"):
        verify_rim(data, name="ca-signed", corim_root=ca.corim_root.cert)


def test_rim_signed_by_an_unrelated_key_with_the_right_chain_is_refused(
    setup: SyntheticGpuSetup,
) -> None:
    ca = setup.ca
    impostor = issue("Synthetic RIM L4 Signer", None, ca=False)
    data = sign_swid(rim_document("1.0", {0: [bytes(48)]}), [impostor])
    with pytest.raises(RimChainError):
        verify_rim(data, name="impostor", corim_root=ca.corim_root.cert)


def test_duplicate_measurement_index_is_refused(setup: SyntheticGpuSetup) -> None:
    document = rim_document("1.0", {0: [bytes(48)]})
    line = document.split(b"\n")[4]
    assert b'index="0"' in line
    doubled = document.replace(line, line + b"\n" + line, 1)
    data = sign_swid(doubled, [setup.ca.rim_signer, setup.ca.corim_l3, setup.ca.corim_ca])
    with pytest.raises(RimFormatError, match="twice"):
        verify_rim(data, name="dup", corim_root=setup.ca.corim_root.cert)


def verify_setup(setup: SyntheticGpuSetup, **collect: object) -> Verdict:
    nonce = os.urandom(32)
    return verify_gpu_evidence(
        setup.collect([nonce], **collect),
        expected_nonces=[nonce],
        policy=setup.policy(),
        trust=setup.trust(),
        at=NOW,
    )


def test_one_matching_alternative_suffices(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    driver = next(setup.rim_dir.glob("NV_GPU_DRIVER_*"))
    alternative = measurement(20, b"alternative")
    golden = {i: [setup.measurements[i + 1]] for i in range(12, 33)}
    golden[19] = [setup.measurements[20], alternative]  # RIM index 19 <-> block 20
    driver.write_bytes(setup.ca.sign_rim(setup.driver_version, golden))
    verdict = verify_setup(setup, measurements={20: alternative})
    assert verdict.trusted, verdict.failures


def test_mismatch_fails_unless_policy_allows_that_block(setup: SyntheticGpuSetup) -> None:
    nonce = os.urandom(32)
    evidence = setup.collect([nonce], measurements={20: bytes(48)})
    strict = verify_gpu_evidence(
        evidence, expected_nonces=[nonce], policy=setup.policy(), trust=setup.trust(), at=NOW
    )
    failed = {c.name: c.detail for c in strict.failures}
    assert list(failed) == ["gpu0.measurements"]
    assert "[20]" in failed["gpu0.measurements"]
    lenient = verify_gpu_evidence(
        evidence,
        expected_nonces=[nonce],
        policy=setup.policy(allowed_mismatch_indices=[20]),
        trust=setup.trust(),
        at=NOW,
    )
    assert lenient.trusted
    assert lenient.claims["gpus"][0]["mismatched_blocks"] == [20]


def test_expired_rim_signer_fails_unless_policy_accepts_it(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path, rim_signer_not_after=datetime(2025, 6, 1, tzinfo=UTC))
    nonce = os.urandom(32)
    evidence = setup.collect([nonce])
    kwargs = {"expected_nonces": [nonce], "trust": setup.trust(), "at": NOW}
    strict = verify_gpu_evidence(evidence, policy=setup.policy(), **kwargs)
    assert {c.name for c in strict.failures} == {"gpu0.rim.driver", "gpu0.rim.vbios"}
    assert all("RimCertificateExpiredError" in c.detail for c in strict.failures)
    lenient = verify_gpu_evidence(
        evidence, policy=setup.policy(expired_rim_certificate="accept"), **kwargs
    )
    assert lenient.trusted
    before = verify_gpu_evidence(
        evidence, policy=setup.policy(), **{**kwargs, "at": BEFORE_RIM_EXPIRY}
    )
    assert before.trusted


def _driver_golden(setup: SyntheticGpuSetup) -> dict[int, list[bytes]]:
    return {i: [setup.measurements[i + 1]] for i in range(12, 33)}


def test_two_verifying_rims_of_one_version_that_differ_are_ambiguous(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    other = {**_driver_golden(setup), 19: [measurement(20, b"another build")]}
    (setup.rim_dir / "other.swidtag").write_bytes(setup.ca.sign_rim(setup.driver_version, other))
    verdict = verify_setup(setup)
    detail = {c.name: c.detail for c in verdict.failures}["gpu0.rim.driver"]
    assert "2 driver RIMs" in detail and "other.swidtag" in detail
    assert "RimNotFoundError" in detail


def test_identical_copies_of_a_rim_are_not_ambiguous(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    driver = next(setup.rim_dir.glob("NV_GPU_DRIVER_*"))
    (setup.rim_dir / "copy.swidtag").write_bytes(driver.read_bytes())
    verdict = verify_setup(setup)
    assert verdict.trusted, verdict.failures


@pytest.mark.parametrize("name", ["0-forged.swidtag", "z-forged.swidtag"])
def test_a_rim_failing_its_signature_beside_the_genuine_one_of_its_version_is_passed_over(
    tmp_path: Path, name: str
) -> None:
    """Issue 13, defect 6: a forged RIM of the same version must not make the genuine one
    ambiguous (in either file order): the one that verifies is chosen."""
    setup = synthetic_gpu_setup(tmp_path)
    driver = next(setup.rim_dir.glob("NV_GPU_DRIVER_*"))
    genuine = driver.read_bytes()
    value = setup.measurements[13].hex().encode()
    assert value in genuine
    (setup.rim_dir / name).write_bytes(genuine.replace(value, b"00" * 48, 1))
    verdict = verify_setup(setup)
    assert verdict.trusted, verdict.failures
    assert verdict.claims["gpus"][0]["rims"]["driver"] == driver.name


def test_a_rim_under_another_root_beside_the_genuine_one_is_passed_over(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    debug_root = issue("Debug CoRIM root", None, ca=True)
    debug_signer = issue("Synthetic RIM L4 Signer", debug_root, ca=False)
    (setup.rim_dir / "0-debug.swidtag").write_bytes(
        setup.ca.sign_rim(
            setup.driver_version, _driver_golden(setup), signer_chain=[debug_signer, debug_root]
        )
    )
    verdict = verify_setup(setup)
    assert verdict.trusted, verdict.failures


def test_when_no_rim_of_the_version_verifies_each_failure_is_named(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    driver = next(setup.rim_dir.glob("NV_GPU_DRIVER_*"))
    value = setup.measurements[13].hex().encode()
    forged = driver.read_bytes().replace(value, b"00" * 48, 1)
    driver.write_bytes(forged)
    (setup.rim_dir / "copy.swidtag").write_bytes(forged)
    verdict = verify_setup(setup)
    detail = {c.name: c.detail for c in verdict.failures}["gpu0.rim.driver"]
    assert detail.startswith("RimSignatureError")
    assert "copy.swidtag" in detail and driver.name in detail


def test_a_current_rim_is_preferred_to_an_expired_copy_of_the_same_values(tmp_path: Path) -> None:
    """NVIDIA re-signs a RIM when its signer expires: both copies verify and list the same
    values; the one valid at the validation time is chosen."""
    setup = synthetic_gpu_setup(tmp_path)
    expired_signer = issue(
        "Synthetic RIM L4 Signer",
        setup.ca.corim_l3,
        ca=False,
        not_after=datetime(2025, 6, 1, tzinfo=UTC),
    )
    chain = [expired_signer, setup.ca.corim_l3, setup.ca.corim_ca, setup.ca.corim_root]
    (setup.rim_dir / "0-expired.swidtag").write_bytes(
        setup.ca.sign_rim(setup.driver_version, _driver_golden(setup), signer_chain=chain)
    )
    verdict = verify_setup(setup)
    assert verdict.trusted, verdict.failures
    assert verdict.claims["gpus"][0]["rims"]["driver"] != "0-expired.swidtag"


def test_rim_is_chosen_by_its_signed_version_not_its_file_name(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    driver = next(setup.rim_dir.glob("NV_GPU_DRIVER_*"))
    driver.write_bytes(setup.ca.sign_rim("551.00", {12: [setup.measurements[13]]}))
    verdict = verify_setup(setup)
    assert "RimNotFoundError" in {c.name: c.detail for c in verdict.failures}["gpu0.rim.driver"]


def test_rim_under_a_debug_root_in_the_rim_directory_fails_the_rim_check(tmp_path: Path) -> None:
    setup = synthetic_gpu_setup(tmp_path)
    debug_root = issue("Debug CoRIM root", None, ca=True)
    debug_signer = issue("Synthetic RIM L4 Signer", debug_root, ca=False)
    driver = next(setup.rim_dir.glob("NV_GPU_DRIVER_*"))
    golden = {i: [setup.measurements[i + 1]] for i in range(12, 33)}
    driver.write_bytes(
        setup.ca.sign_rim(setup.driver_version, golden, signer_chain=[debug_signer, debug_root])
    )
    verdict = verify_setup(setup)
    detail = {c.name: c.detail for c in verdict.failures}["gpu0.rim.driver"]
    assert detail.startswith("RimChainError") and "not the pinned CoRIM root" in detail
