"""NVIDIA H100/H200 confidential-computing evidence: collection through NVML
(`attestation.gpu.nvml`) and offline verification (`attestation.gpu.verify`) against pinned
roots, signed reference manifests, a revocation bundle and the `[gpu]` policy.

Importing this package touches no device: NVML is loaded only when evidence is collected.
"""

from attestation.gpu.evidence import GpuEvidence, gpu_evidence_digest
from attestation.gpu.nvml import collect_gpu_evidence, set_gpus_ready
from attestation.gpu.policy import GpuPolicy
from attestation.gpu.trust import GpuTrust
from attestation.gpu.verify import verify_gpu_evidence

__all__ = [
    "GpuEvidence",
    "GpuPolicy",
    "GpuTrust",
    "collect_gpu_evidence",
    "gpu_evidence_digest",
    "set_gpus_ready",
    "verify_gpu_evidence",
]
