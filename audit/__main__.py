"""`python -m audit`: what an auditor, a client or a witness does, with no appliance database.

    verify BUNDLE --vkey VKEY [--state FILE] [--witness VKEY ... --min-witnesses K]
                                                  verify an export bundle (exit 0 ok, 1 failed,
                                                  2 unusable input)
    verify-proof PROOF --vkey VKEY (--entry FILE | --leaf-hash B64)
                                                  verify a c2sp.org/tlog-proof receipt
    vkey KEYFILE                                  print the verifier key of a log signing key
                                                  or of a witness key
    witness-key KEYFILE --name NAME               make a witness key (mode 0600), print its vkey
    witness --key KEYFILE --log-vkey VKEY --state FILE --listen HOST:PORT
                                                  run a witness (c2sp.org/tlog-witness)
    siem BUNDLE --vkey VKEY --format ocsf|syslog  verify a bundle, then print its entries as
                                                  OCSF 1.8 JSON lines or RFC 5424 syslog lines

Standard library and `cryptography` only (checked by an import-linter contract and a test).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from audit.bundle import MANIFEST, BundleReader, Manifest
from audit.bundle_json import MAX_MANIFEST_BYTES
from audit.cosignature import ALG_COSIGNATURE_V1, Cosigner, CosignerKey
from audit.encoding import decode_base64
from audit.errors import (
    AuditError,
    BundleFormatError,
    KeyFileError,
    NoteFormatError,
    VerificationError,
    WitnessStateError,
)
from audit.keyfile import create_secret_file, read_secret_file, write_file_atomically
from audit.merkle import hash_leaf
from audit.note import SKEY_PREFIX, NoteSigner, VerifierKey
from audit.siem import to_ocsf, to_syslog
from audit.tlog_proof import TlogProof
from audit.verify import VerificationReport, VerifiedState, verify_bundle
from audit.witness_server import WitnessServer

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


def _key_text(value: str) -> str:
    """A vkey given itself, or as a file holding it."""
    path = Path(value)
    return path.read_text(encoding="utf-8") if "+" not in value and path.is_file() else value


def _vkey(value: str) -> VerifierKey:
    return VerifierKey.parse(_key_text(value))


def _summary(path: Path, vkey: VerifierKey, report: VerificationReport) -> str:
    last = report.first_index + report.num_entries - 1
    lines = [
        f"bundle:      {path}",
        f"log:         {report.origin} (pinned key {vkey.name}+{vkey.key_id:08x})",
        f"entries:     {report.first_index} to {last} ({report.num_entries} entries), "
        f"{report.first_time} to {report.last_time}",
        f"checkpoints: {len(report.checkpoint_sizes)} signatures verified, roots recomputed at "
        f"sizes {', '.join(map(str, report.checkpoint_sizes))}",
    ]
    if report.witnessed_by:
        lines.append(f"witnesses:   the newest checkpoint is cosigned by "
                     f"{', '.join(report.witnessed_by)}")  # fmt: skip
    if report.state_checked_at is not None:
        lines.append(f"continuity:  extends the previously verified tree of size "
                     f"{report.state_checked_at}")  # fmt: skip
    lines.append("OK: every check passed")
    return "\n".join(lines)


def _verify(args: argparse.Namespace) -> int:
    vkey = _vkey(args.vkey)
    state = None
    if args.state is not None and args.state.exists():
        state = VerifiedState.parse(args.state.read_bytes(), str(args.state))
    witnesses = [CosignerKey.parse(_key_text(value)) for value in args.witness]
    report = verify_bundle(args.bundle, vkey, state, witnesses, args.min_witnesses)
    if args.state is not None:
        write_file_atomically(args.state, report.new_state.to_json(), mode=0o644)
    print(_summary(args.bundle, vkey, report))
    if args.state is not None:
        print(f"state:       {args.state} now records size {report.new_state.size}")
    return EXIT_OK


def _verify_proof(args: argparse.Namespace) -> int:
    vkey = _vkey(args.vkey)
    proof = TlogProof.from_text(args.proof.read_text(encoding="utf-8"))
    if args.entry is not None:
        leaf_hash = hash_leaf(args.entry.read_bytes().removesuffix(b"\n"))
    else:
        leaf_hash = decode_base64(args.leaf_hash, "leaf hash")
    checkpoint = proof.verify(leaf_hash, vkey)
    print(f"OK: entry {proof.index} is in {checkpoint.origin} at tree size {checkpoint.size}")
    return EXIT_OK


def _read_skey(path: Path) -> str:
    try:
        return read_secret_file(path).decode("ascii")
    except (FileNotFoundError, UnicodeDecodeError) as exc:
        raise BundleFormatError(f"{path} is not a readable signing key file") from exc


def _is_witness_skey(skey: str) -> bool:
    """A witness skey's key is of signature type 0x04 (audit.cosignature)."""
    # PRIVATE+KEY+<name>+<id>+<base64 key>: the name holds no "+", the base64 key may.
    encoded = skey.strip().removeprefix(SKEY_PREFIX).split("+", 2)[-1]
    try:
        return decode_base64(encoded, "key")[:1] == bytes([ALG_COSIGNATURE_V1])
    except NoteFormatError:
        return False


def _print_vkey(args: argparse.Namespace) -> int:
    skey = _read_skey(args.keyfile)
    if _is_witness_skey(skey):
        print(Cosigner.from_skey(skey).verifier)
    else:
        print(NoteSigner.from_skey(skey).verifier)
    return EXIT_OK


def _witness_key(args: argparse.Namespace) -> int:
    cosigner = Cosigner.generate(args.name)
    try:
        create_secret_file(args.keyfile, cosigner.to_skey().encode())
    except FileExistsError:
        raise KeyFileError(f"{args.keyfile} exists; a witness key is never overwritten") from None
    print(cosigner.verifier)
    return EXIT_OK


def _listen_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _witness(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cosigner = Cosigner.from_skey(_read_skey(args.key))
    logs = [_vkey(value) for value in args.log_vkey]
    server = WitnessServer(cosigner, logs, args.state, args.listen)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_OK))
    host, port = server.server_address[:2]
    print(f"witness {cosigner.verifier}", flush=True)
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return EXIT_OK


def _siem(args: argparse.Namespace) -> int:
    verify_bundle(args.bundle, _vkey(args.vkey))  # only verified entries go to a SIEM
    with BundleReader(args.bundle) as bundle:
        origin = Manifest.parse(bundle.read(MANIFEST, max_bytes=MAX_MANIFEST_BYTES)).origin
        for line in bundle.entry_lines():
            data = line.removesuffix(b"\n")
            if args.format == "ocsf":
                print(json.dumps(to_ocsf(data, origin), ensure_ascii=False))
            else:
                print(to_syslog(data, origin, args.hostname))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audit", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="verify an export bundle offline")
    verify.add_argument("bundle", type=Path, help="bundle directory or tar")
    verify.add_argument("--vkey", required=True, help="the log's verifier key (or a file)")
    verify.add_argument("--state", type=Path, help="last verified state; updated on success")
    verify.add_argument(
        "--witness", action="append", default=[], help="a pinned witness's vkey (or a file)"
    )
    verify.add_argument(
        "--min-witnesses",
        type=int,
        default=0,
        help="how many pinned witnesses must have cosigned the newest checkpoint",
    )
    verify.set_defaults(run=_verify)

    proof = commands.add_parser("verify-proof", help="verify a tlog-proof receipt")
    proof.add_argument("proof", type=Path, help="the tlog-proof file")
    proof.add_argument("--vkey", required=True, help="the log's verifier key (or a file)")
    leaf = proof.add_mutually_exclusive_group(required=True)
    leaf.add_argument("--entry", type=Path, help="file holding the entry's exact bytes")
    leaf.add_argument("--leaf-hash", help="base64 leaf hash (from the Audit-Entry header)")
    proof.set_defaults(run=_verify_proof)

    vkey = commands.add_parser("vkey", help="print the verifier key of a signing key file")
    vkey.add_argument("keyfile", type=Path)
    vkey.set_defaults(run=_print_vkey)

    witness_key = commands.add_parser("witness-key", help="make a witness key, print its vkey")
    witness_key.add_argument("keyfile", type=Path, help="the new key file (made with mode 0600)")
    witness_key.add_argument("--name", required=True, help="the witness's name, e.g. a URL")
    witness_key.set_defaults(run=_witness_key)

    witness = commands.add_parser("witness", help="run a witness (c2sp.org/tlog-witness)")
    witness.add_argument("--key", type=Path, required=True, help="the witness key file")
    witness.add_argument(
        "--log-vkey", action="append", required=True, help="a witnessed log's vkey (or a file)"
    )
    witness.add_argument("--state", type=Path, required=True, help="the witness's state file")
    witness.add_argument("--listen", type=_listen_address, required=True, help="HOST:PORT")
    witness.set_defaults(run=_witness)

    siem = commands.add_parser("siem", help="verify a bundle, then print it for a SIEM")
    siem.add_argument("bundle", type=Path)
    siem.add_argument("--vkey", required=True, help="the log's verifier key (or a file)")
    siem.add_argument("--format", choices=["ocsf", "syslog"], required=True)
    siem.add_argument("--hostname", default="-", help="syslog HOSTNAME field")
    siem.set_defaults(run=_siem)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except VerificationError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (BundleFormatError, NoteFormatError, KeyFileError, WitnessStateError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except AuditError as exc:
        # A receipt that does not verify (bad signature, wrong inclusion proof).
        print(f"FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
