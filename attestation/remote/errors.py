"""The client verifier's errors: one root for everything an application catches."""

from __future__ import annotations

from attestation.errors import AttestationError
from attestation.verdict import Verdict


class ApplianceAttestationError(AttestationError):
    """The appliance could not be attested, or the connection is not the attested one: no
    request body is sent."""


class ApplianceNotTrustedError(ApplianceAttestationError):
    """The appliance's evidence did not pass the client's verification; `verdict` has every
    check, and the message the failed ones."""

    def __init__(self, verdict: Verdict) -> None:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in verdict.failures) or "no check ran"
        super().__init__(f"the appliance is not trusted: {failed}")
        self.verdict = verdict


class ChannelMismatchError(ApplianceAttestationError):
    """A TLS connection's peer presented another key than the attested one (a relay, or a
    re-route after the attestation)."""


class StaleVerdictError(ApplianceAttestationError):
    """A response's `X-Inferno-Attestation` names a standing verdict older than the client
    allows, or none at all."""
