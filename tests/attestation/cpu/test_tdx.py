"""TDX quotes through dcap-qvl: the dcap-qvl vector is UpToDate at a time inside its collateral
window and refused as expired collateral today; go-tdx-guest's production quotes parse and chain
to Intel's SGX root but have no bundled collateral; hostile quotes and roots are refused."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.cpu import CpuPolicy, CpuTrust, verify_cpu_evidence
from attestation.cpu.errors import (
    TdxCollateralError,
    TdxQuoteFormatError,
    TdxQuoteVerificationError,
)
from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.policy import TdxPolicy
from attestation.cpu.tdx import TdxClaims, TdxQuote, verify_pck_chain, verify_tdx_quote
from attestation.errors import EvidenceError, PolicyError
from attestation.input_limits import MAX_COLLATERAL_BYTES
from tests.attestation.cpu.conftest import DCAP, DCAP_MR_TD, DCAP_REPORT_DATA, TDX, TDX_AT
from tests.attestation.cpu.synthetic import SyntheticSnp

QUOTE = (DCAP / "tdx_quote").read_bytes()
MR_TD = DCAP_MR_TD
REPORT_DATA = DCAP_REPORT_DATA
# The TD report fields of QUOTE (`dcap_qvl.parse_quote(QUOTE).report`).
MR_SEAM = (
    "5b38e33a6487958b72c3c12a938eaa5e3fd4510c51aeeab5"
    "8c7d5ecee41d7c436489d6c8e4f92f160b7cad34207b00c1"
)
TEE_TCB_SVN = "06010300000000000000000000000000"
TD_FIELDS = {"mrseam": MR_SEAM, "mrconfigid": "00" * 48, "mrowner": "00" * 48,
             "mrownerconfig": "00" * 48}  # fmt: skip
GO_TDX_QUOTES = [
    "testing_testdata_tdx_prod_quote_SPR_E4.dat",
    "testing_testdata_ccel_cos-113-tdx-quote.dat",
    "testing_testdata_quote_v5_sample.dat",  # quote v5, TDX 1.5 TD report
]


def _policy(**overrides: object) -> CpuPolicy:
    table: dict[str, object] = {"mrtd": [MR_TD], "tcb_statuses": ["UpToDate"]}
    table.update(overrides)
    return CpuPolicy.from_tables({"tdx": table})


def _claims(td_attributes: bytes, tcb_status: str, advisory_ids: list[str]) -> TdxClaims:
    return TdxClaims(
        tcb_status=tcb_status,
        advisory_ids=tuple(advisory_ids),
        fmspc="B0C06F000000",
        td_attributes=td_attributes,
        xfam=bytes(8),
        mr_td=bytes.fromhex(MR_TD),
        mr_config_id=bytes(48),
        mr_owner=bytes(48),
        mr_owner_config=bytes(48),
        rtmrs=(bytes(48),) * 4,
        mr_seam=bytes(48),
        tee_tcb_svn=bytes(16),
        report_data=bytes(64),
    )


def _verify(trust: CpuTrust, at: datetime, quote: bytes = QUOTE, **policy: object):
    return verify_cpu_evidence(
        CpuEvidence("tdx", quote, provider="tdx_guest"),
        expected_report_data=REPORT_DATA,
        policy=_policy(**policy),
        trust=trust,
        at=at,
    )


def test_dcap_quote_is_up_to_date_inside_the_collateral_window(dcap_trust: CpuTrust) -> None:
    verdict = _verify(dcap_trust, TDX_AT)
    assert verdict.trusted, verdict.failures
    assert verdict.claims["tcb_status"] == "UpToDate"
    assert verdict.claims["mr_td"] == MR_TD
    assert verdict.claims["fmspc"] == "B0C06F000000"


def test_dcap_quote_is_refused_as_expired_collateral_today(dcap_trust: CpuTrust) -> None:
    verdict = _verify(dcap_trust, datetime.now(UTC))
    assert [check.name for check in verdict.failures] == ["tdx.quote"]
    assert "not valid at" in verdict.failures[0].detail
    assert "xpired" in verdict.failures[0].detail


def test_dcap_quote_is_refused_before_its_collateral_was_issued(dcap_trust: CpuTrust) -> None:
    verdict = _verify(dcap_trust, datetime(2025, 1, 1, tzinfo=UTC))
    assert [check.name for check in verdict.failures] == ["tdx.quote"]


def test_dcap_quote_for_another_challenge_fails_the_report_data_step(dcap_trust: CpuTrust) -> None:
    verdict = verify_cpu_evidence(
        CpuEvidence("tdx", QUOTE),
        expected_report_data=bytes(64),
        policy=_policy(),
        trust=dcap_trust,
        at=TDX_AT,
    )
    assert [check.name for check in verdict.failures] == ["tdx.report_data"]


@pytest.mark.parametrize(
    ("overrides", "failed"),
    [
        ({"mrtd": ["00" * 48]}, "tdx.policy.mrtd"),
        ({"rtmr0": ["00" * 48]}, "tdx.policy.rtmr0"),
    ],
)
def test_dcap_quote_outside_the_policy_fails_the_named_check(
    dcap_trust: CpuTrust, overrides: dict[str, object], failed: str
) -> None:
    verdict = _verify(dcap_trust, TDX_AT, **overrides)
    assert [check.name for check in verdict.failures] == [failed]


def test_dcap_quote_passes_allow_lists_and_minimum_tee_tcb_svn_it_meets(
    dcap_trust: CpuTrust,
) -> None:
    verdict = _verify(dcap_trust, TDX_AT, min_tee_tcb_svn=TEE_TCB_SVN,
                      **{key: [value] for key, value in TD_FIELDS.items()})  # fmt: skip
    assert verdict.trusted, verdict.failures
    names = {check.name for check in verdict.checks}
    assert {f"tdx.policy.{key}" for key in TD_FIELDS} | {"tdx.policy.min_tee_tcb_svn"} <= names
    assert verdict.claims["mr_seam"] == MR_SEAM
    assert verdict.claims["tee_tcb_svn"] == TEE_TCB_SVN


@pytest.mark.parametrize(
    ("key", "label"),
    [
        ("mrseam", "MRSEAM"),
        ("mrconfigid", "MRCONFIGID"),
        ("mrowner", "MROWNER"),
        ("mrownerconfig", "MROWNERCONFIG"),
    ],
)
def test_dcap_quote_outside_a_td_allow_list_fails_its_named_check(
    dcap_trust: CpuTrust, key: str, label: str
) -> None:
    verdict = _verify(dcap_trust, TDX_AT, **{key: ["ab" * 48]})
    assert [check.name for check in verdict.failures] == [f"tdx.policy.{key}"]
    assert verdict.failures[0].detail == f"{label} {TD_FIELDS[key]} is not an allowed value"


@pytest.mark.parametrize("component", [0, 1, 2, 15])
def test_dcap_quote_below_the_minimum_tee_tcb_svn_in_one_component_is_refused(
    dcap_trust: CpuTrust, component: int
) -> None:
    minimum = bytearray.fromhex(TEE_TCB_SVN)
    minimum[component] += 1
    verdict = _verify(dcap_trust, TDX_AT, min_tee_tcb_svn=minimum.hex())
    assert [check.name for check in verdict.failures] == ["tdx.policy.min_tee_tcb_svn"]
    assert verdict.failures[0].detail == (
        f"TEE_TCB_SVN {TEE_TCB_SVN} is below the minimum {minimum.hex()} in at least one component"
    )


def test_td_with_debug_attribute_is_refused_by_policy() -> None:
    policy = TdxPolicy.from_table({"mrtd": [MR_TD], "tcb_statuses": ["UpToDate"]})
    checks = policy.evaluate(_claims(bytes([1, 0, 0, 0x10, 0, 0, 0, 0]), "UpToDate", []))
    failed = [check for check in checks if not check.passed]
    assert [check.name for check in failed] == ["tdx.policy.debug"]
    assert "debug must be off" in failed[0].detail


def test_out_of_date_tcb_and_rejected_advisory_are_refused_by_policy() -> None:
    policy = TdxPolicy.from_table(
        {"mrtd": [MR_TD], "tcb_statuses": ["UpToDate"], "rejected_advisories": ["INTEL-SA-00837"]}
    )
    checks = policy.evaluate(_claims(bytes(8), "OutOfDate", ["INTEL-SA-00837"]))
    assert {c.name for c in checks if not c.passed} == {
        "tdx.policy.tcb_status",
        "tdx.policy.advisories",
    }


@pytest.mark.parametrize("offset", [48 + 136, 48 + 300, 48 + 584 - 1, 700, 1000, 4000])
def test_flipped_bit_in_the_dcap_quote_is_refused(dcap_trust: CpuTrust, offset: int) -> None:
    quote = bytearray(QUOTE)
    quote[offset] ^= 0x01
    try:
        verdict = _verify(dcap_trust, TDX_AT, quote=bytes(quote))
    except EvidenceError:
        return  # no longer parses as a TDX quote
    assert not verdict.trusted
    assert verdict.failures[0].name in {"tdx.quote", "tdx.report_data"}


def test_flipped_bit_in_the_td_report_fails_dcap_verification(dcap_trust: CpuTrust) -> None:
    quote = bytearray(QUOTE)
    quote[48 + 136] ^= 0x01  # inside MRTD of the TD report body
    with pytest.raises(TdxQuoteVerificationError, match="dcap-qvl rejected"):
        verify_tdx_quote(
            TdxQuote.parse(bytes(quote)),
            collateral=dcap_trust.tdx_collateral,
            root_ca_der=dcap_trust.tdx_root_ca_der,
            at=TDX_AT,
        )


def test_wrong_pinned_intel_root_is_refused(dcap_trust: CpuTrust) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding

    impostor = SyntheticSnp.create().ark.public_bytes(Encoding.DER)
    trust = CpuTrust(tdx_root_ca_der=impostor, tdx_collateral=dcap_trust.tdx_collateral)
    verdict = _verify(trust, TDX_AT)
    assert [check.name for check in verdict.failures] == ["tdx.quote"]


def test_no_pinned_intel_root_never_verifies(dcap_trust: CpuTrust) -> None:
    trust = CpuTrust(tdx_collateral=dcap_trust.tdx_collateral)
    verdict = _verify(trust, TDX_AT)
    assert "no Intel SGX Root CA is pinned" in verdict.failures[0].detail


@pytest.mark.parametrize("name", GO_TDX_QUOTES)
def test_go_tdx_guest_quotes_parse_and_chain_to_the_intel_root(
    name: str, intel_root_der: bytes
) -> None:
    quote = TdxQuote.parse((TDX / name).read_bytes())
    assert quote.version == (5 if "v5" in name else 4)
    chain = verify_pck_chain(quote, intel_root_der, datetime.now(UTC))
    assert len(chain) == 3
    assert "Intel SGX PCK Certificate" in chain[0].subject.rfc4514_string()


@pytest.mark.parametrize("name", GO_TDX_QUOTES)
def test_go_tdx_guest_quotes_have_no_bundled_collateral(name: str, dcap_trust: CpuTrust) -> None:
    quote = TdxQuote.parse((TDX / name).read_bytes())
    with pytest.raises(TdxCollateralError, match=f"FMSPC {quote.fmspc}"):
        verify_tdx_quote(
            quote,
            collateral=dcap_trust.tdx_collateral,
            root_ca_der=dcap_trust.tdx_root_ca_der,
            at=TDX_AT,
        )


def test_pck_chain_of_a_go_tdx_guest_quote_does_not_reach_an_impostor_root() -> None:
    from cryptography.hazmat.primitives.serialization import Encoding

    quote = TdxQuote.parse((TDX / GO_TDX_QUOTES[0]).read_bytes())
    impostor = SyntheticSnp.create().ark.public_bytes(Encoding.DER)
    with pytest.raises(TdxQuoteVerificationError, match="pinned Intel root"):
        verify_pck_chain(quote, impostor, datetime.now(UTC))


def test_an_snp_report_is_not_a_tdx_quote() -> None:
    report = SyntheticSnp.create().report(bytes(64))
    with pytest.raises(TdxQuoteFormatError):
        TdxQuote.parse(report)


def test_tdx_evidence_without_a_tdx_policy_table_is_a_policy_error(dcap_trust: CpuTrust) -> None:
    snp_only = CpuPolicy.from_tables(
        {
            "snp": {
                "measurements": ["00" * 48],
                "min_tcb": dict.fromkeys(("bootloader", "tee", "snp", "microcode"), 0),
            }
        }
    )
    with pytest.raises(PolicyError, match=r"no \[tdx\] table"):
        verify_cpu_evidence(
            CpuEvidence("tdx", QUOTE), expected_report_data=REPORT_DATA, policy=snp_only,
            trust=dcap_trust, at=TDX_AT,
        )  # fmt: skip


def test_trust_directory_with_intel_root_and_collateral_loads(tmp_path, dcap_trust) -> None:
    (tmp_path / "tdx" / "collateral").mkdir(parents=True)
    (tmp_path / "tdx" / "root_ca.pem").write_bytes((TDX / "verify_trusted_root.pem").read_bytes())
    (tmp_path / "tdx" / "collateral" / "b0c06f.json").write_text(
        (DCAP / "tdx_quote_collateral.json").read_text()
    )
    trust = CpuTrust.load(tmp_path)
    assert trust.tdx_root_ca_der == dcap_trust.tdx_root_ca_der
    assert set(trust.tdx_collateral) == {"B0C06F000000"}
    assert _verify(trust, TDX_AT).trusted


def test_tee_tcb_svn_of_the_wrong_length_fails_the_minimum_instead_of_raising() -> None:
    policy = TdxPolicy.from_table(
        {"mrtd": [MR_TD], "tcb_statuses": ["UpToDate"], "min_tee_tcb_svn": "00" * 16}
    )
    claims = replace(_claims(bytes(8), "UpToDate", []), tee_tcb_svn=bytes(15))
    failed = [check.name for check in policy.evaluate(claims) if not check.passed]
    assert failed == ["tdx.policy.min_tee_tcb_svn"]


def test_collateral_100000_levels_deep_is_a_policy_error(tmp_path: Path) -> None:
    """Issue 13, defect 2, for the operator's collateral files (and the JSON inside them)."""
    (tmp_path / "tdx" / "collateral").mkdir(parents=True)
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "tdx" / "collateral" / "b0c06f.json"
    path.write_text(deep)
    with pytest.raises(PolicyError, match="deeper than 64 levels"):
        CpuTrust.load(tmp_path)
    path.write_text(json.dumps({"tcb_info": deep}))
    with pytest.raises(PolicyError, match=r"tcb_info nests .* deeper than 64 levels"):
        CpuTrust.load(tmp_path)


def test_collateral_over_its_size_limit_is_a_policy_error(tmp_path: Path) -> None:
    (tmp_path / "tdx" / "collateral").mkdir(parents=True)
    (tmp_path / "tdx" / "collateral" / "b0c06f.json").write_bytes(b" " * (MAX_COLLATERAL_BYTES + 1))
    with pytest.raises(PolicyError, match="over the limit of 4194304 bytes"):
        CpuTrust.load(tmp_path)
