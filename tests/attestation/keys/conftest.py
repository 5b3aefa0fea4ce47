from __future__ import annotations

from datetime import UTC, datetime

import pytest

from attestation.keys import Pkcs11KeySettings
from attestation.verdict import Check, Verdict
from tests.attestation.keys.softhsm import softhsm_module, softhsm_token

AT = datetime(2026, 1, 1, tzinfo=UTC)
TRUSTED = Verdict(checks=(Check("gpu0.signature", True), Check("snp.policy.debug", True)), at=AT)
FAILED = Verdict(
    checks=(Check("gpu0.signature", True), Check("snp.policy.debug", False, "debug is on")), at=AT
)
EMPTY = Verdict(checks=(), at=AT)
UNTRUSTED = {"a failed check": FAILED, "no check at all": EMPTY}


@pytest.fixture(scope="session")
def softhsm() -> Pkcs11KeySettings:
    if softhsm_module() is None:
        pytest.skip("SoftHSM2 is not installed (./bootstrap test installs Debian's softhsm2)")
    return softhsm_token()
