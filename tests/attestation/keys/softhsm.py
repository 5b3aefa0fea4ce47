"""A SoftHSM2 token for tests, one per test process.

A PKCS#11 module is initialised once per process and SoftHSM2 reads its configuration
(SOFTHSM2_CONF) and token directory at that moment, so every test in a process shares one token:
`softhsm_token()` creates it the first time (a temporary directory, a config file, an initialised
token with a known PIN) and returns its settings after that. Tests keep apart by key labels.
Other test packages (the boot gate's) may import it. Needs Debian's `softhsm2` package, which
`./bootstrap test` installs; without it `softhsm_module()` is None and the tests skip.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from attestation.keys import Pkcs11KeySettings

USER_PIN = "246810"
SO_PIN = "13579111"
TOKEN_LABEL = "inferno-test"
_MODULES = ("/usr/lib/softhsm/libsofthsm2.so", "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so")
_token: Pkcs11KeySettings | None = None


def softhsm_module() -> Path | None:
    """The SoftHSM2 PKCS#11 module, if installed (and softhsm2-util with it)."""
    if shutil.which("softhsm2-util") is None:
        return None
    return next((Path(path) for path in _MODULES if Path(path).exists()), None)


def softhsm_token() -> Pkcs11KeySettings:
    """The settings of this process's test token (created on first call)."""
    global _token
    if _token is not None:
        return _token
    module = softhsm_module()
    if module is None:
        raise RuntimeError("SoftHSM2 is not installed (apt-get install softhsm2)")
    base = Path(tempfile.mkdtemp(prefix="inferno-softhsm-"))
    atexit.register(shutil.rmtree, base, True)
    (base / "tokens").mkdir()
    conf = base / "softhsm2.conf"
    conf.write_text(
        f"directories.tokendir = {base / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n"
    )
    os.environ["SOFTHSM2_CONF"] = str(conf)
    subprocess.run(
        ["softhsm2-util", "--init-token", "--free", "--label", TOKEN_LABEL,
         "--so-pin", SO_PIN, "--pin", USER_PIN],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    pin_file = base / "pin"
    pin_file.write_text(USER_PIN + "\n")
    pin_file.chmod(0o600)
    _token = Pkcs11KeySettings(module_path=module, token_label=TOKEN_LABEL, pin_file=pin_file)
    return _token
