"""Offline verification of NVIDIA Hopper GPU evidence: mechanism (is the evidence genuine?) in
the numbered steps below, then policy (are its values acceptable?). Pure: evidence, expected
nonces, trust, policy and the validation time in; a `Verdict` out.

Per GPU `gpuN` (a step marked ■ gates the rest: once it fails, nothing later is claimed):
  1 ■ gpuN.report          parse the SPDM 1.1 request/response strictly (ReportFormatError) and
                           the PEM chain (GpuEvidenceFormatError)
  2   gpuN.nonce           request nonce == the expected nonce for this GPU (NonceMismatchError)
  3 ■ gpuN.certificate_chain
                           exactly 5 certificates; the 5th is replaced by the pinned Device
                           Identity CA; each link's signature, key usage, basic constraints and
                           validity at `at` (CertificateChainError)
  4   gpuN.fwid            FWID opaque field (type 20), when present, == the last 48 bytes of the
                           leaf's 2.23.133.5.4.1 extension (FwidMismatchError)
  5 ■ gpuN.signature       ECDSA-P384/SHA-384 over request ‖ response by the leaf key
                           (ReportSignatureError)
  6   gpuN.declared.driver_version, gpuN.declared.vbios_version
                           only for evidence that declares them (NVIDIA's PPCIe shape): each
                           equals the version the report signed (DeclaredVersionMismatchError)
  7   gpuN.rim.driver, gpuN.rim.vbios
                           the RIM matching the signed version (of several, those that verify;
                           ambiguous only if verifying RIMs differ), XML signature, chain to the
                           pinned CoRIM root, signer validity at `at` (RimNotFoundError,
                           RimFormatError, RimSignatureError, RimChainError,
                           RimCertificateExpiredError: accepted only if policy says so)
  8   gpuN.measurements    every active golden index i matches block i+1 (one alternative
                           suffices); mismatches outside policy's allowed indices fail
  9   gpuN.revocation      device chain and RIM signing chains against the revocation bundle:
                           good / revoked / stale / unchecked, accepted per policy
 10   gpuN.policy.*        architecture, chip, board (if listed), driver and VBIOS versions,
                           CC on, dev tools off
and once: gpu.count (number of GPUs allowed by policy, one expected nonce per GPU) and
gpu.distinct (no device key verified twice: one GPU's evidence cannot count as two).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.errors import AttestationError
from attestation.gpu.chain import leaf_fwid, validity_problems, verify_links
from attestation.gpu.errors import (
    CertificateChainError,
    DeclaredVersionMismatchError,
    FwidMismatchError,
    MeasurementMismatchError,
    NonceMismatchError,
    ReportSignatureError,
    RevocationError,
    RimCertificateExpiredError,
    RimNotFoundError,
)
from attestation.gpu.evidence import GpuEvidence
from attestation.gpu.policy import GpuPolicy
from attestation.gpu.report import GpuReport
from attestation.gpu.revocation import check_revocation, combine_states
from attestation.gpu.rim import Rim, compare_measurements, rim_version, verify_rim
from attestation.gpu.trust import GpuTrust, RimFile
from attestation.verdict import Check, Verdict

NUM_DEVICE_CERTS = 5


def verify_gpu_evidence(
    evidence: Sequence[GpuEvidence],
    *,
    expected_nonces: Sequence[bytes],
    policy: GpuPolicy,
    trust: GpuTrust,
    at: datetime,
) -> Verdict:
    """Verify every GPU's evidence (steps in the module docstring) at the validation time `at`
    (timezone-aware). `expected_nonces[i]` is the nonce GPU i must have signed. Never raises for
    hostile evidence: each failure is a failed `Check` whose detail says why."""
    if at.tzinfo is None:
        raise ValueError("the validation time must be timezone-aware")
    checks: list[Check] = []
    count_ok = len(evidence) in policy.num_gpus and len(evidence) == len(expected_nonces)
    count_detail = (
        f"{len(evidence)} GPUs with {len(expected_nonces)} expected nonces; "
        f"policy allows {sorted(policy.num_gpus)} GPUs"
    )
    checks.append(Check("gpu.count", count_ok, "" if count_ok else count_detail))
    gpus: list[dict[str, Any]] = []
    leaves: list[bytes] = []
    for index, item in enumerate(evidence):
        nonce = expected_nonces[index] if index < len(expected_nonces) else None
        run = _GpuRun(f"gpu{index}", item, nonce, policy, trust, at)
        run.verify()
        checks.extend(run.checks)
        gpus.append(run.claims)
        leaves.extend(run.verified_leaf)
    # One GPU's evidence listed twice must not count as two GPUs (a caller deriving the same
    # nonce for every GPU would otherwise accept it): each verified device key appears once.
    distinct = len(set(leaves)) == len(leaves)
    checks.append(
        Check(
            "gpu.distinct",
            distinct,
            "" if distinct else "the same GPU's evidence appears more than once",
        )
    )
    return Verdict(tuple(checks), at, {"num_gpus": len(evidence), "gpus": gpus})


class _GpuRun:
    """The checks and claims of one GPU's verification."""

    def __init__(
        self,
        name: str,
        evidence: GpuEvidence,
        nonce: bytes | None,
        policy: GpuPolicy,
        trust: GpuTrust,
        at: datetime,
    ) -> None:
        self.name, self.evidence, self.nonce = name, evidence, nonce
        self.policy, self.trust, self.at = policy, trust, at
        self.checks: list[Check] = []
        self.claims: dict[str, Any] = {"arch": evidence.arch}
        self.verified_leaf: list[bytes] = []  # the leaf's DER, once its signature verified

    def step(self, label: str, body: Callable[[], str | None]) -> bool:
        """Run one step; record it as a check. Returns whether it passed."""
        try:
            detail = body() or ""
        except AttestationError as exc:
            self.checks.append(Check(f"{self.name}.{label}", False, f"{type(exc).__name__}: {exc}"))
            return False
        self.checks.append(Check(f"{self.name}.{label}", True, detail))
        return True

    def verify(self) -> None:
        if not self.step("report", self._parse):
            return
        self.step("nonce", self._nonce)
        if not self.step("certificate_chain", self._chain):
            return
        self.step("fwid", self._fwid)
        if not self.step("signature", self._signature):
            return
        self.verified_leaf.append(self.certs[0].public_bytes(Encoding.DER))
        self._claim_report()
        for field, declared in (
            ("driver_version", self.evidence.driver_version),
            ("vbios_version", self.evidence.vbios_version),
        ):
            if declared is not None:
                self.step(f"declared.{field}", lambda f=field, d=declared: self._declared(f, d))
        rims = [rim for kind in ("driver", "vbios") if (rim := self._rim(kind)) is not None]
        if len(rims) == 2:
            self.step("measurements", lambda: self._measurements(rims))
        self.step("revocation", lambda: self._revocation(rims))
        self._policy()

    # Mechanism ---------------------------------------------------------------------------

    def _parse(self) -> None:
        self.report = GpuReport.parse(self.evidence.report)
        self.certs = self.evidence.certificates()

    def _nonce(self) -> None:
        if self.nonce is None:
            raise NonceMismatchError("no expected nonce for this GPU")
        if self.report.nonce != self.nonce:
            raise NonceMismatchError(
                f"report nonce {self.report.nonce.hex()} is not the expected {self.nonce.hex()}"
            )
        if self.evidence.nonce != self.nonce:
            raise NonceMismatchError("the evidence's nonce field differs from the expected nonce")

    def _chain(self) -> str:
        if len(self.certs) != NUM_DEVICE_CERTS:
            raise CertificateChainError(
                f"device chain has {len(self.certs)} certificates, not {NUM_DEVICE_CERTS}"
            )
        root = self.trust.device_identity_ca
        verify_links(self.certs[:4], root, error=CertificateChainError, what="device")
        problems = validity_problems([*self.certs[:4], root], self.at)
        if problems:
            raise CertificateChainError(
                "device chain not valid at the validation time: " + "; ".join(problems)
            )
        same_root = self.certs[4].public_bytes(Encoding.DER) == root.public_bytes(Encoding.DER)
        return (
            "" if same_root else "the presented root differs from the pinned one and was replaced"
        )

    def _fwid(self) -> str:
        fwid = self.report.fwid
        if fwid is None:
            return "the report carries no FWID (drivers before 550)"
        expected = leaf_fwid(self.certs[0])
        if expected is None:
            raise FwidMismatchError("the report has an FWID but the leaf certificate has none")
        if fwid != expected:
            raise FwidMismatchError(
                f"report FWID {fwid.hex()} != leaf certificate FWID {expected.hex()}"
            )
        return ""

    def _signature(self) -> None:
        key = self.certs[0].public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
            raise ReportSignatureError("the leaf certificate's key is not ECDSA P-384")
        raw = self.report.signature
        der = encode_dss_signature(int.from_bytes(raw[:48], "big"), int.from_bytes(raw[48:], "big"))
        try:
            key.verify(der, self.report.signed_bytes, ec.ECDSA(hashes.SHA384()))
        except InvalidSignature:
            raise ReportSignatureError(
                "the report signature does not verify with the leaf key"
            ) from None

    def _claim_report(self) -> None:
        leaf_cn = self.certs[0].subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        self.chip = str(leaf_cn[0].value).split()[0] if leaf_cn else ""
        board = self.report.board
        self.claims.update(
            chip=self.chip,
            driver_version=self.report.driver_version,
            vbios_version=self.report.vbios_version,
            board="_".join(board) if board else None,
            fwid=self.report.fwid.hex() if self.report.fwid else None,
            cc_mode=self.evidence.cc_mode,
            dev_tools_mode=self.evidence.dev_tools_mode,
        )

    def _declared(self, field: str, declared: str) -> None:
        signed = self.claims[field]
        if signed is None or not _same_version(field.removesuffix("_version"), declared, signed):
            raise DeclaredVersionMismatchError(
                f"the evidence declares {field} {declared}, the signed report {signed}"
            )

    def _rim(self, kind: str) -> Rim | None:
        version = self.report.driver_version if kind == "driver" else self.report.vbios_version
        found: list[Rim] = []

        def verify() -> str:
            rim = self._select_rim(kind, version)
            problems = validity_problems(rim.signer_chain, self.at)
            found.append(rim)
            self.claims.setdefault("rims", {})[kind] = rim.name
            if problems:
                message = f"RIM certificate expired: {rim.name}: " + "; ".join(problems)
                if not self.policy.accept_expired_rim_certificate:
                    raise RimCertificateExpiredError(message)
                return message + " (accepted: expired_rim_certificate = accept)"
            return rim.name

        self.step(f"rim.{kind}", verify)
        return found[0] if found else None

    def _select_rim(self, kind: str, version: str | None) -> Rim:
        """The RIM for the signed `version`. Candidates are the files whose (unverified) version
        names it; only those that verify count (signature, chain to the pinned CoRIM root,
        signed version and kind), so a forged or foreign file beside the genuine one is passed
        over. Of those, a VBIOS RIM named for this board wins, then those whose signer is valid
        at `at` (NVIDIA re-signs a RIM whose signer expires). Raises the candidate's own error
        when none verifies, and RimNotFoundError when there is no candidate or the remaining
        ones list different golden values (ambiguous: never guess between two signed RIMs)."""
        if version is None:
            raise RimNotFoundError(f"the report carries no {kind} version")
        candidates = [
            f
            for f in self.trust.rims
            if (v := rim_version(f.data)) is not None and _same_version(kind, v, version)
        ]
        if not candidates:
            raise RimNotFoundError(f"no {kind} RIM for version {version} in the RIM directory")
        verified: list[Rim] = []
        failures: list[tuple[str, AttestationError]] = []
        for candidate in candidates:
            try:
                verified.append(self._verify_candidate(candidate, kind, version))
            except AttestationError as exc:
                failures.append((candidate.name, exc))
        if not verified:
            raise _no_rim_verifies(failures)
        if kind == "vbios" and len(verified) > 1 and self.report.board:
            board_id = "_".join([*self.report.board, version.replace(".", "")]).upper()
            verified = [rim for rim in verified if board_id in rim.name.upper()] or verified
        current = [rim for rim in verified if not validity_problems(rim.signer_chain, self.at)]
        verified = current or verified
        if len({tuple(sorted(rim.golden.items())) for rim in verified}) > 1:
            names = ", ".join(rim.name for rim in verified)
            raise RimNotFoundError(
                f"{len(verified)} {kind} RIMs for version {version} verify but list different "
                f"golden values: {names}"
            )
        return verified[0]

    def _verify_candidate(self, candidate: RimFile, kind: str, version: str) -> Rim:
        rim = verify_rim(candidate.data, name=candidate.name, corim_root=self.trust.corim_root)
        if not _same_version(kind, rim.version, version) or rim.kind != kind:
            raise RimNotFoundError(f"verified RIM {rim.name} is for {rim.version}, not {version}")
        return rim

    def _measurements(self, rims: list[Rim]) -> str:
        num_compared, mismatched = compare_measurements(self.report.measurements, rims)
        self.claims.update(num_measurements_compared=num_compared, mismatched_blocks=mismatched)
        refused = [i for i in mismatched if i not in self.policy.allowed_mismatch_indices]
        if refused:
            raise MeasurementMismatchError(f"measurement blocks {refused} match no golden value")
        allowed = f"; blocks {mismatched} differ, allowed by policy" if mismatched else ""
        return f"{num_compared} measurements match{allowed}"

    def _revocation(self, rims: list[Rim]) -> str:
        max_age = timedelta(seconds=self.policy.revocation_max_age_s)
        pairs = [(self.certs[i], self.certs[i + 1]) for i in range(3)]
        pairs.append((self.certs[3], self.trust.device_identity_ca))
        for rim in rims:
            chain = [*rim.signer_chain, self.trust.corim_root]
            pairs.extend(itertools.pairwise(chain))
        statuses = [
            check_revocation(cert, issuer, self.trust.revocation, at=self.at, max_age=max_age)
            for cert, issuer in pairs
        ]
        state = combine_states([s.state for s in statuses])
        self.claims["revocation"] = state
        detail = f"{state} ({len(pairs)} certificates)"
        if state not in self.policy.revocation_accept:
            reasons = "; ".join(sorted({s.detail for s in statuses if s.state != "good"}))
            raise RevocationError(f"revocation state {state} not accepted by policy: {reasons}")
        return detail

    # Policy ------------------------------------------------------------------------------

    def _policy(self) -> None:
        policy, claims = self.policy, self.claims
        self._policy_check(
            "architecture",
            claims["arch"] in policy.architectures,
            f"architecture {claims['arch']} not in {sorted(policy.architectures)}",
        )
        self._policy_check(
            "chip", self.chip in policy.chips, f"chip {self.chip} not in {sorted(policy.chips)}"
        )
        if policy.boards is not None:
            board = (claims["board"] or "").upper()
            self._policy_check(
                "board", board in policy.boards, f"board {board} not in {sorted(policy.boards)}"
            )
        self._policy_check(
            "driver_version",
            claims["driver_version"] in policy.driver_versions,
            f"driver {claims['driver_version']} not in {sorted(policy.driver_versions)}",
        )
        vbios = (claims["vbios_version"] or "").upper()
        self._policy_check(
            "vbios_version",
            vbios in policy.vbios_versions,
            f"VBIOS {vbios} not in {sorted(policy.vbios_versions)}",
        )
        if policy.require_cc_on:
            cc = self.evidence.cc_mode
            self._policy_check(
                "cc_mode",
                cc == "on",
                "CC mode unknown: the evidence carries no NVML state"
                if cc is None
                else f"CC mode is {cc}, policy requires on",
            )
        if policy.require_dev_tools_off:
            dev = self.evidence.dev_tools_mode
            self._policy_check(
                "dev_tools",
                dev is False,
                "dev-tools mode unknown: the evidence carries no NVML state"
                if dev is None
                else "dev-tools mode is on, policy requires off",
            )

    def _policy_check(self, label: str, passed: bool, failure: str) -> None:
        self.checks.append(Check(f"{self.name}.policy.{label}", passed, "" if passed else failure))


def _same_version(kind: str, a: str, b: str) -> bool:
    """VBIOS versions are hex bytes, compared without regard to case; driver versions exactly."""
    return a.upper() == b.upper() if kind == "vbios" else a == b


def _no_rim_verifies(failures: list[tuple[str, AttestationError]]) -> AttestationError:
    """The error of a RIM check where no candidate verified: the candidate's own error when
    there was one, else the first one's type naming every candidate's failure."""
    if len(failures) == 1:
        return failures[0][1]
    first = failures[0][1]
    return type(first)("; ".join(f"{name}: {exc}" for name, exc in failures))
