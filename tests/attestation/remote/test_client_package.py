"""The client verifier ships alone: clients/attestation/pyproject.toml builds a wheel of the
`attestation` package only, requiring cryptography, httpx, lxml and dcap-qvl, and the wheel's
client modules import and run with the appliance, the audit log, torch and the web server
refused at import."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
REFUSED = ("appliance", "audit", "torch", "fastapi", "starlette", "uvicorn", "pydantic",
           "sqlalchemy", "numpy", "triton", "kernels")  # fmt: skip

# Runs in a fresh interpreter with only the unpacked wheel and the venv's third-party packages:
# any import of a refused package raises, and the CLI runs to its first check.
PROBE = f"""
import importlib.abc, sys
REFUSED = {REFUSED!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ImportError("the client package imported " + name)
        return None
sys.meta_path.insert(0, Refuse())
import attestation, attestation.remote.transport, attestation.remote.async_transport
from attestation.__main__ import main
assert attestation.__file__.startswith(sys.argv[1]), attestation.__file__
sys.exit(main(["verify-appliance", "http://127.0.0.1:9"]))
"""


def test_the_client_wheel_holds_only_attestation_and_runs_without_the_appliance(
    tmp_path: Path,
) -> None:
    # Build from a copy: the build writes its scratch files beside the sources.
    source = tmp_path / "source"
    shutil.copytree(REPO / "attestation", source / "attestation",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (source / "clients" / "attestation").mkdir(parents=True)
    shutil.copy(
        REPO / "clients" / "attestation" / "pyproject.toml", source / "clients" / "attestation"
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(source / "clients" / "attestation")],
        check=True, timeout=300,
    )  # fmt: skip
    [wheel] = wheels.glob("inferno_attestation-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
        unpacked = tmp_path / "site"
        archive.extractall(unpacked)
    assert {name.split("/")[0] for name in names} == {"attestation", wheel.name.split("-")[0]
                                                      + "-0.1.0.dist-info"}  # fmt: skip
    requires = {line.split(": ")[1].split(">")[0] for line in metadata.splitlines()
                if line.startswith("Requires-Dist")}  # fmt: skip
    assert requires == {"cryptography", "httpx", "lxml", "dcap-qvl"}
    probe = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(unpacked)!r})\n" + PROBE,
         str(unpacked)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Exit 2: http:// is refused as unusable input (only TLS can be attested), after every
    # module of the client was imported.
    assert probe.returncode == 2, probe.stderr
    assert "only a TLS channel can be attested" in probe.stdout
