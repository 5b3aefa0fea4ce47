"""Verifying an appliance's `/v1/attestation` answer on the client's side: pure, values in and
a Verdict out (docs/ATTESTATION.md, "For application teams").

The plan (each step a named check; ■ gates the rest):
 1 ■ `appliance.evidence`  the appliance collected evidence at all (else its failure is shown)
 2   `appliance.tee`       the appliance's own state is VERIFIED (not FAILED, PENDING, ...)
 3   `appliance.nonce`     the evidence answers the client's fresh nonce (no replayed answer)
 4   `channel.binding`     the evidence uses report_data v2, which binds a channel
 5   `channel.tls_spki`    the TLS key the evidence binds is the one the client's own
                           connection presented (no relay with a certificate of its own)
 6   `channel.audit_vkey`  the audit log the evidence binds is one the policy names
 7   `appliance.verdict_age`  the standing verdict is at most max_verdict_age_s old (if set)
 8   `gpu*`                the GPU evidence, for nonces derived from the client's nonce
                           (attestation.gpu.verify)
 9   `cpu`/`snp.*`/`tdx.*` the CPU report, whose report_data must equal report_data_v2 of the
                           client's nonce, the GPU evidence digest, the attestation key, the
                           connection's own SPKI hash and the bound vkey (attestation.cpu.verify)

Step 9 recomputes the binding from what the client saw, never from what the appliance claims:
a report that binds another nonce, other GPU evidence, or another TLS key fails
`snp.report_data`/`tdx.report_data` even if steps 3-5 were fooled.
"""

from __future__ import annotations

from datetime import datetime

from attestation.binding import Channel, gpu_nonces, report_data_v2
from attestation.cpu.verify import verify_cpu_evidence
from attestation.gpu.evidence import gpu_evidence_digest
from attestation.gpu.verify import verify_gpu_evidence
from attestation.remote.document import AttestationDocument
from attestation.remote.policy import AppliancePolicy
from attestation.remote.trust import ApplianceTrust
from attestation.verdict import Check, Verdict


def verify_appliance(
    document: AttestationDocument,
    *,
    nonce: bytes,
    peer_spki_sha256: bytes,
    policy: AppliancePolicy,
    trust: ApplianceTrust,
    at: datetime,
) -> Verdict:
    """Every check of the plan above, at the validation time `at`. `nonce` is the one the
    client drew for this request; `peer_spki_sha256` the SHA-256 of the DER SubjectPublicKeyInfo
    of the certificate the TLS connection that carried `document` presented. Raises EvidenceError
    only for a CPU report that cannot be parsed at all (as verify_cpu_evidence does); every
    other problem is a failed check."""
    evidence = document.evidence
    if evidence is None:
        detail = f"the appliance ({document.tee}) collected no evidence; its verdict: " + (
            document.appliance_result or "none"
        )
        return Verdict((Check("appliance.evidence", False, detail),), at)
    checks = [Check("appliance.evidence", True), *channel_checks(document, nonce, peer_spki_sha256)]
    checks.append(_audit_vkey_check(evidence.channel.audit_vkey, policy))
    if policy.max_verdict_age_s is not None:
        checks.append(_age_check(document.standing_at, policy.max_verdict_age_s, at))
    gpu = verify_gpu_evidence(
        evidence.gpu,
        expected_nonces=gpu_nonces(nonce, len(evidence.gpu)),
        policy=policy.gpu,
        trust=trust.gpu,
        at=at,
    )
    expected = report_data_v2(
        nonce,
        gpu_evidence_digest(evidence.gpu),
        evidence.attestation_public_key,
        Channel(peer_spki_sha256, evidence.channel.audit_vkey),
    )
    cpu = verify_cpu_evidence(
        evidence.cpu, expected_report_data=expected, policy=policy.cpu, trust=trust.cpu, at=at
    )
    claims = {
        "tee": document.tee,
        "tls_spki_sha256": peer_spki_sha256.hex(),
        "audit_vkey": evidence.channel.audit_vkey,
        "attestation_public_key": evidence.attestation_public_key.hex(),
    }
    appliance = Verdict(tuple(checks), at, claims)
    return Verdict.combine([("appliance", appliance), ("gpu", gpu), ("cpu", cpu)], at)


def channel_checks(
    document: AttestationDocument, nonce: bytes, peer_spki_sha256: bytes
) -> list[Check]:
    """Steps 2 to 5: what needs no policy. `verify-appliance` without a policy shows these."""
    evidence = document.evidence
    assert evidence is not None, "step 1 gates the rest"
    bound = evidence.channel.tls_spki_sha256
    if bound is None:
        spki_detail = "the appliance binds no TLS key (it serves plain HTTP, or predates v2)"
    else:
        spki_detail = (
            f"the evidence binds the TLS key {bound.hex()[:16]}…, but this connection's peer "
            f"presented {peer_spki_sha256.hex()[:16]}…: a relay or another server answered"
        )
    answers_nonce = evidence.challenge == nonce and document.nonce == nonce
    return [
        _check("appliance.tee", document.tee == "VERIFIED",
               f"the appliance says its TEE is {document.tee}"),
        _check("appliance.nonce", answers_nonce,
               "the evidence answers another nonce than this client's (a replayed answer)"),
        _check("channel.binding", evidence.binding == "v2",
               f"report_data {evidence.binding} binds no TLS channel"),
        _check("channel.tls_spki", bound == peer_spki_sha256, spki_detail),
    ]  # fmt: skip


def _check(name: str, passed: bool, failure_detail: str) -> Check:
    return Check(name, passed, "" if passed else failure_detail)


def _audit_vkey_check(vkey: str | None, policy: AppliancePolicy) -> Check:
    if vkey in policy.audit_vkeys:
        return Check("channel.audit_vkey", True)
    shown = "none" if vkey is None else vkey.split("+", 1)[0] + "+…"
    return Check(
        "channel.audit_vkey",
        False,
        f"the appliance's audit log ({shown}) is not one the policy's audit_vkeys names",
    )


def _age_check(standing_at: datetime | None, max_age_s: int, at: datetime) -> Check:
    if standing_at is None:
        return Check("appliance.verdict_age", False, "the appliance has no standing verdict")
    age_s = int((at - standing_at).total_seconds())
    if age_s > max_age_s:
        return Check(
            "appliance.verdict_age",
            False,
            f"the appliance's standing verdict is {age_s} s old; the policy allows "
            f"{max_age_s} s (max_verdict_age_s): it has not re-attested since",
        )
    if age_s < -60:
        return Check("appliance.verdict_age", False, "the standing verdict is dated in the future")
    return Check("appliance.verdict_age", True, f"{max(age_s, 0)} s old")
