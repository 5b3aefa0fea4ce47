"""CPU TEE evidence: AMD SEV-SNP reports and Intel TDX quotes, collected through configfs-tsm
and verified offline against pinned vendor roots, bundled collateral and the `[snp]`/`[tdx]`
policy.

Public API:
  collect_cpu_evidence(report_data, *, tsm_root=...) -> CpuEvidence    (edge: configfs-tsm)
  verify_cpu_evidence(evidence, *, expected_report_data, policy, trust, at) -> Verdict
  CpuEvidence (to_json / from_json), CpuPolicy.from_tables(tables), CpuTrust.load(directory)
"""

from attestation.cpu.collect import DEFAULT_TSM_ROOT, collect_cpu_evidence
from attestation.cpu.evidence import CpuEvidence, CpuKind
from attestation.cpu.policy import CpuPolicy, SnpPolicy, TdxPolicy
from attestation.cpu.trust import CpuTrust
from attestation.cpu.verify import verify_cpu_evidence

__all__ = [
    "DEFAULT_TSM_ROOT",
    "CpuEvidence",
    "CpuKind",
    "CpuPolicy",
    "CpuTrust",
    "SnpPolicy",
    "TdxPolicy",
    "collect_cpu_evidence",
    "verify_cpu_evidence",
]
