"""What a GPU verification trusts, apart from policy: the pinned roots (NVIDIA's Device Identity
CA and CoRIM signing root, or roots a deployment or a test pins instead), the reference
manifests (RIMs) available offline, and the revocation bundle. Read from disk once by
`from_paths`; verification itself touches no file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509

from attestation.errors import PolicyError
from attestation.gpu.revocation import RevocationBundle
from attestation.gpu.roots import (
    CORIM_ROOT_FILE,
    DEVICE_IDENTITY_CA_FILE,
    load_pinned_root,
    nvidia_corim_root,
    nvidia_device_identity_ca,
)

RIM_SUFFIXES = (".swidtag", ".xml")


@dataclass(frozen=True, slots=True)
class RimFile:
    """A RIM as found on disk: its file name and bytes, not yet verified."""

    name: str
    data: bytes


@dataclass(frozen=True, slots=True)
class GpuTrust:
    device_identity_ca: x509.Certificate
    corim_root: x509.Certificate
    rims: tuple[RimFile, ...]
    revocation: RevocationBundle = field(default_factory=RevocationBundle)

    @classmethod
    def from_paths(
        cls,
        *,
        rim_dir: Path,
        roots_dir: Path | None = None,
        revocation_dir: Path | None = None,
    ) -> GpuTrust:
        """Load the trust inputs. `roots_dir` holds `nvidia_device_identity_ca.pem` and
        `nvidia_corim_signing_root_ca.pem` (default: NVIDIA's roots compiled into
        attestation.gpu.roots, checked by fingerprint); `rim_dir` the `*.swidtag`/`*.xml` RIMs;
        `revocation_dir` the OCSP/CRL bundle (absent: every certificate is "unchecked").
        Raises PolicyError if a path is missing or unreadable."""
        if roots_dir is None:
            device_ca, corim_root = nvidia_device_identity_ca(), nvidia_corim_root()
        else:
            device_ca = load_pinned_root(_read(Path(roots_dir) / DEVICE_IDENTITY_CA_FILE))
            corim_root = load_pinned_root(_read(Path(roots_dir) / CORIM_ROOT_FILE))
        rim_dir = Path(rim_dir)
        if not rim_dir.is_dir():
            raise PolicyError(f"RIM directory {rim_dir} does not exist")
        rims = tuple(
            RimFile(path.name, path.read_bytes())
            for path in sorted(rim_dir.iterdir())
            if path.suffix in RIM_SUFFIXES and path.is_file()
        )
        revocation = (
            RevocationBundle()
            if revocation_dir is None
            else RevocationBundle.from_directory(revocation_dir)
        )
        return cls(device_ca, corim_root, rims, revocation)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"cannot read pinned root {path}: {exc}") from exc
