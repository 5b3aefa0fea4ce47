"""The built-in roots are AMD's and Intel's: fingerprints as published, the real Milan report
chains to the built-in ARK-Milan, the built-in Intel root verifies the dcap-qvl quote, and a
trust directory adds to the built-in roots without dropping those it does not replace."""

from __future__ import annotations

import json
from pathlib import Path

import dcap_qvl

from attestation.cpu import CpuTrust, verify_cpu_evidence
from attestation.cpu.evidence import CpuEvidence
from attestation.cpu.policy import CpuPolicy
from attestation.cpu.roots import amd_arks, intel_sgx_root_ca_der
from tests.attestation.cpu.conftest import DCAP, SNP_AT, TDX_AT, RealSnp
from tests.attestation.cpu.synthetic import SyntheticSnp


def test_builtin_arks_are_self_signed_amd_roots_one_per_product(real_snp: RealSnp) -> None:
    arks = amd_arks()
    assert set(arks) == {"Milan", "Genoa", "Turin"}
    assert arks["Milan"] == real_snp.ark
    assert arks["Genoa"] == real_snp.genoa_ark
    for product, ark in arks.items():
        assert ark.subject == ark.issuer
        assert ark.subject.rfc4514_string().startswith(f"CN=ARK-{product},O=Advanced Micro Devices")


def test_builtin_intel_root_is_the_one_in_the_vectors(intel_root_der: bytes) -> None:
    assert intel_sgx_root_ca_der() == intel_root_der


def test_real_snp_report_chains_to_the_builtin_ark(real_snp: RealSnp) -> None:
    verdict = verify_cpu_evidence(
        real_snp.evidence(),
        expected_report_data=real_snp.parsed.report_data,
        policy=real_snp.policy(),
        trust=CpuTrust.builtin(),
        at=SNP_AT,
    )
    assert [check.name for check in verdict.failures] == ["snp.policy.debug"]


def test_builtin_intel_root_verifies_the_dcap_quote_as_dcap_qvls_own_root_does() -> None:
    quote = (DCAP / "tdx_quote").read_bytes()
    text = (DCAP / "tdx_quote_collateral.json").read_text()
    own = dcap_qvl.verify(
        quote, dcap_qvl.QuoteCollateralV3.from_json(text), int(TDX_AT.timestamp())
    )
    trust = CpuTrust(
        tdx_root_ca_der=CpuTrust.builtin().tdx_root_ca_der,
        tdx_collateral={"B0C06F000000": text},
    )
    td_report = json.loads(own.to_json())["report"]["TD10"]
    report_data, mr_td = bytes.fromhex(td_report["report_data"]), td_report["mr_td"]
    verdict = verify_cpu_evidence(
        CpuEvidence("tdx", quote),
        expected_report_data=report_data,
        policy=CpuPolicy.from_tables({"tdx": {"mrtd": [mr_td], "tcb_statuses": ["UpToDate"]}}),
        trust=trust,
        at=TDX_AT,
    )
    assert own.status == "UpToDate"
    assert verdict.trusted, verdict.failures


def test_trust_directory_of_collateral_only_keeps_the_builtin_intel_root(tmp_path: Path) -> None:
    """Issue 13, defect 1: a directory without tdx/root_ca.pem must not drop Intel's root."""
    (tmp_path / "tdx" / "collateral").mkdir(parents=True)
    (tmp_path / "tdx" / "collateral" / "b0c06f.json").write_text(
        (DCAP / "tdx_quote_collateral.json").read_text()
    )
    trust = CpuTrust.load(tmp_path)
    assert trust.tdx_root_ca_der == intel_sgx_root_ca_der()
    assert trust.snp_arks == amd_arks()


def test_trust_directory_pinning_one_ark_keeps_the_builtin_arks_of_the_other_products(
    tmp_path: Path,
) -> None:
    platform = SyntheticSnp.create()
    trust = CpuTrust.load(platform.write_trust_directory(tmp_path))
    builtin = amd_arks()
    assert trust.snp_arks[platform.product] == platform.ark
    assert {p: trust.snp_arks[p] for p in builtin if p != platform.product} == {
        p: ark for p, ark in builtin.items() if p != platform.product
    }
    assert trust.tdx_root_ca_der == intel_sgx_root_ca_der()


def test_an_empty_trust_directory_is_the_builtin_trust(tmp_path: Path) -> None:
    assert CpuTrust.load(tmp_path) == CpuTrust.builtin()
