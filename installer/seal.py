"""`python -m installer seal` and `seal-keys`: seal a model directory for the appliance, and make
the keys a development seal needs.

Sealing runs where the plaintext model already is (the security team's machine, never the
appliance): it draws a fresh data key, wraps it with the chosen key provider, encrypts every
*.safetensors file in AES-256-GCM chunks, copies the other files in the clear, and signs the
manifest (attestation.sealed.manifest describes the directory).

    python -m installer seal-keys KEYS_DIR --key-id KEK [--pkcs11-module SO --pkcs11-token L
        --pkcs11-pin-file F]
        writes KEYS_DIR/manifest-signing.pem (keep it off the appliance) and
        KEYS_DIR/manifest.pub (install it on the appliance); makes the key-encryption key KEK
        in KEYS_DIR (file provider, development) or on the token (pkcs11)
    python -m installer seal SRC OUT --model-id ID --key-id KEK --signing-key PEM
        [--key-provider file --key-dir DIR | --key-provider pkcs11 --pkcs11-module SO
         --pkcs11-token LABEL --pkcs11-pin-file F] [--chunk-mib N] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm.auto import tqdm

from attestation.keys import Pkcs11KeySettings
from attestation.keys.file import FileKeyProvider
from attestation.keys.pkcs11 import Pkcs11KeyProvider
from attestation.sealed import (
    DEFAULT_CHUNK_SIZE,
    load_manifest_signing_key,
    seal_model,
    source_files,
)
from installer.errors import SealingError

SIGNING_KEY_NAME = "manifest-signing.pem"
PUBLIC_KEY_NAME = "manifest.pub"


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `seal` and `seal-keys` on the installer's command line."""
    seal = commands.add_parser("seal", help="seal a model directory for the appliance")
    seal.add_argument("source", type=Path, help="the plaintext model directory")
    seal.add_argument("out", type=Path, help="the sealed model directory to create")
    seal.add_argument("--model-id", required=True, help="the model's name, bound into every chunk")
    seal.add_argument("--key-id", required=True, help="the key-encryption key that wraps the key")
    seal.add_argument("--signing-key", required=True, type=Path, help="Ed25519 PEM private key")
    seal.add_argument(
        "--chunk-mib", type=int, default=DEFAULT_CHUNK_SIZE >> 20, help="chunk size in MiB"
    )
    seal.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    _add_provider_options(seal)
    seal.set_defaults(run=run_seal)

    keys = commands.add_parser("seal-keys", help="make a manifest signing key and a KEK")
    keys.add_argument("keys_dir", type=Path, help="where the signing key (and a file KEK) go")
    keys.add_argument("--key-id", required=True, help="the key-encryption key to create")
    _add_provider_options(keys)
    keys.set_defaults(run=run_seal_keys)


def _add_provider_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-provider", choices=("file", "pkcs11"), default="file")
    parser.add_argument("--key-dir", type=Path, help="file provider: the KEK directory")
    parser.add_argument("--pkcs11-module", type=Path, help="pkcs11: the PKCS#11 module (.so)")
    parser.add_argument("--pkcs11-token", help="pkcs11: the token label")
    parser.add_argument("--pkcs11-pin-file", type=Path, help="pkcs11: a file holding the PIN")


def _provider(
    args: argparse.Namespace, default_key_dir: Path | None = None
) -> FileKeyProvider | Pkcs11KeyProvider:
    if args.key_provider == "file":
        key_dir = args.key_dir or default_key_dir
        if key_dir is None:
            raise SystemExit("installer seal: the file key provider needs --key-dir")
        # Sealing happens off the appliance; the file provider is refused there in production.
        return FileKeyProvider(key_dir, production=False)
    missing = [
        option
        for option, value in (
            ("--pkcs11-module", args.pkcs11_module),
            ("--pkcs11-token", args.pkcs11_token),
            ("--pkcs11-pin-file", args.pkcs11_pin_file),
        )
        if value is None
    ]
    if missing:
        raise SystemExit(f"installer seal: the pkcs11 key provider needs {', '.join(missing)}")
    return Pkcs11KeyProvider.from_settings(
        Pkcs11KeySettings(args.pkcs11_module, args.pkcs11_token, args.pkcs11_pin_file)
    )


def run_seal(args: argparse.Namespace) -> int:
    try:
        provider = _provider(args)
        signing_key = load_manifest_signing_key(args.signing_key)
        total = sum(path.stat().st_size for path in source_files(args.source))
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="sealing", disable=not sys.stderr.isatty()
        ) as bar:
            lock = threading.Lock()  # chunks finish on several threads; tqdm counts on one

            def advance(num_bytes: int) -> None:
                with lock:
                    bar.update(num_bytes)

            manifest = seal_model(
                args.source,
                args.out,
                model_id=args.model_id,
                key_id=args.key_id,
                wrap_data_key=provider.wrap_data_key,
                signing_key=signing_key,
                chunk_size=args.chunk_mib << 20,
                workers=args.workers,
                progress=advance,
            )
    except OSError as exc:
        raise SealingError(f"cannot seal {args.source}: {exc}") from exc
    num_sealed = len(manifest.sealed_files)
    print(
        f"sealed {args.model_id!r} into {args.out}: {num_sealed} weight file(s) encrypted, "
        f"{len(manifest.files) - num_sealed} plain file(s) listed, key {args.key_id!r}"
    )
    return 0


def run_seal_keys(args: argparse.Namespace) -> int:
    keys_dir: Path = args.keys_dir
    signing_path, public_path = keys_dir / SIGNING_KEY_NAME, keys_dir / PUBLIC_KEY_NAME
    if signing_path.exists():
        raise SealingError(f"{signing_path} already exists: keys are never overwritten")
    provider = _provider(args, default_key_dir=keys_dir)
    provider.create_key(args.key_id)
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    signing_key = Ed25519PrivateKey.generate()
    fd = os.open(signing_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            signing_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    public_path.write_bytes(
        signing_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    print(f"manifest signing key: {signing_path} (keep it off the appliance)")
    print(f"manifest public key:  {public_path} (install it on the appliance)")
    print(f"key-encryption key:   {args.key_id!r} ({args.key_provider} provider)")
    return 0
