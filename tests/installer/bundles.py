"""Small bundles for the installer's tests: a tiny `inferno` wheel made with zipfile (so no test
builds or downloads the real wheelhouse), a release key pair, and a bundle built from them."""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from installer.__main__ import main

TINY_VERSION = "0.1.0"
# The Python running the tests: the installer refuses a bundle made for another.
TINY_TARGET = f"linux-x86_64-py3.{sys.version_info.minor}-cpu"
# The tiny wheel's `inferno` command prints this, so a test can tell it ran.
TINY_GREETING = "inferno from the tiny wheel"


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
        "inferno_tiny/__init__.py": f"def main():\n    print({TINY_GREETING!r})\n".encode(),
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
    model = root / "tiny-model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"tiny": true}\n')
    (model / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 16)
    return BundleInputs(keys, wheelhouse, model)


def build_bundle(
    inputs: BundleInputs, out: Path, *, tar: bool = True, target: str = TINY_TARGET
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
    ]
    assert main([*argv, "--tar"] if tar else argv) == 0
    return out
