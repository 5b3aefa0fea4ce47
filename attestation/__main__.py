"""`python -m attestation`: verify TEE evidence offline, as an operator or a relying party does.

    verify-gpu --evidence FILE.json --rims DIR --policy FILE [--at RFC3339] [--roots DIR]
               [--revocation DIR] [--nonce HEX ...]
    verify-cpu --evidence FILE.json --policy FILE --trust DIR [--at RFC3339]
               (--report-data HEX | --binding NONCE GPU_DIGEST PUBLIC_KEY)
    verify-appliance https://HOST:PORT [--policy FILE --trust DIR]
                     [--ca FILE | --attested-key-only]

prints the JSON verdict (`Verdict.to_json()`: result, validation time, failed checks with their
reasons, every check, per-GPU claims) and exits 0 when trusted, 1 when not trusted, 2 when the
input is unusable (unreadable or malformed evidence, policy, roots or bundle; for
verify-appliance also an appliance that cannot be reached or answers no attestation).
verify-appliance without a policy still connects and shows what it saw, and exits 1: nothing is
trusted without a policy.

Each subcommand is one `add_*` function registering its arguments and its `run` function in
SUBCOMMANDS; adding one (`verify-cpu`) touches nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from attestation.errors import EvidenceError, PolicyError
from attestation.input_limits import (
    MAX_CPU_EVIDENCE_BYTES,
    MAX_GPU_EVIDENCE_BYTES,
    parse_json,
    read_file,
)
from attestation.verdict import Verdict

EXIT_TRUSTED, EXIT_NOT_TRUSTED, EXIT_UNUSABLE = 0, 1, 2

Runner = Callable[[argparse.Namespace], Verdict]
SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Runner]] = {}


def validation_time(text: str | None) -> datetime:
    """`--at`: an RFC 3339 time with an offset (e.g. 2025-05-01T00:00:00Z); default now (UTC)."""
    if text is None:
        return datetime.now(UTC)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise PolicyError(f"--at {text!r} is not an RFC 3339 time") from None
    if at.tzinfo is None:
        raise PolicyError(f"--at {text!r} has no UTC offset (write Z or +00:00)")
    return at.astimezone(UTC)


def _add_verify_gpu(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--evidence", type=Path, required=True, help="GPU evidence JSON list")
    parser.add_argument("--rims", type=Path, required=True, help="directory of signed RIMs")
    parser.add_argument("--policy", type=Path, required=True, help="policy TOML with a [gpu] table")
    parser.add_argument("--at", help="validation time, RFC 3339 (default: now)")
    parser.add_argument("--roots", type=Path, help="pinned roots (default: NVIDIA's, built in)")
    parser.add_argument("--revocation", type=Path, help="directory of *.ocsp and *.crl files")
    parser.add_argument(
        "--nonce",
        action="append",
        help="expected nonce (hex), once per GPU in order; default: the nonces the evidence "
        "file names, which proves only that each report signed the nonce it claims",
    )


def _run_verify_gpu(args: argparse.Namespace) -> Verdict:
    from attestation.gpu.evidence import evidence_list_from_json
    from attestation.gpu.policy import GpuPolicy
    from attestation.gpu.trust import GpuTrust
    from attestation.gpu.verify import verify_gpu_evidence

    data = read_file(
        args.evidence, what="evidence file", error=EvidenceError, max_bytes=MAX_GPU_EVIDENCE_BYTES
    )
    evidence = evidence_list_from_json(data)
    try:
        nonces = (
            [bytes.fromhex(n) for n in args.nonce] if args.nonce else [e.nonce for e in evidence]
        )
    except ValueError:
        raise EvidenceError("--nonce must be hex") from None
    policy = GpuPolicy.from_file(args.policy)
    trust = GpuTrust.from_paths(
        rim_dir=args.rims, roots_dir=args.roots, revocation_dir=args.revocation
    )
    return verify_gpu_evidence(
        evidence, expected_nonces=nonces, policy=policy, trust=trust, at=validation_time(args.at)
    )


SUBCOMMANDS["verify-gpu"] = (_add_verify_gpu, _run_verify_gpu)


def _add_verify_cpu(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--evidence", type=Path, required=True, help="CPU evidence JSON object")
    parser.add_argument("--policy", type=Path, required=True, help="policy TOML, [snp]/[tdx]")
    parser.add_argument("--trust", type=Path, required=True, help="CpuTrust directory")
    parser.add_argument("--at", help="validation time, RFC 3339 (default: now)")
    parser.add_argument("--report-data", help="expected report_data (128 hex digits)")
    parser.add_argument(
        "--binding",
        nargs=3,
        metavar=("NONCE", "GPU_DIGEST", "PUBLIC_KEY"),
        help="expected report_data as attestation.binding.report_data (the v1 domain, which "
        "binds no TLS channel) of these three hex values",
    )


def _run_verify_cpu(args: argparse.Namespace) -> Verdict:
    from attestation.binding import report_data
    from attestation.cpu import CpuEvidence, CpuPolicy, CpuTrust, verify_cpu_evidence
    from attestation.policy import read_policy_file

    if (args.report_data is None) == (args.binding is None):
        raise PolicyError("give exactly one of --report-data and --binding")
    data = read_file(
        args.evidence, what="evidence file", error=EvidenceError, max_bytes=MAX_CPU_EVIDENCE_BYTES
    )
    evidence = CpuEvidence.from_json(
        parse_json(
            data, what="the CPU evidence", error=EvidenceError, max_bytes=MAX_CPU_EVIDENCE_BYTES
        )
    )
    try:
        if args.binding is not None:
            expected = report_data(*(bytes.fromhex(value) for value in args.binding))
        else:
            expected = bytes.fromhex(args.report_data)
    except ValueError as exc:
        raise EvidenceError(f"unusable expected report_data: {exc}") from exc
    if len(expected) != 64:
        raise EvidenceError("the expected report_data must be 64 bytes")
    return verify_cpu_evidence(
        evidence,
        expected_report_data=expected,
        policy=CpuPolicy.from_tables(read_policy_file(args.policy)),
        trust=CpuTrust.load(args.trust),
        at=validation_time(args.at),
    )


SUBCOMMANDS["verify-cpu"] = (_add_verify_cpu, _run_verify_cpu)


def _add_verify_appliance(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the appliance, https://HOST:PORT")
    parser.add_argument(
        "--policy", type=Path, help="client policy TOML: [gpu], [snp]/[tdx], [appliance]"
    )
    parser.add_argument(
        "--trust", type=Path, help="trust directory: gpu/rims, gpu/roots, gpu/revocation, cpu"
    )
    ca = parser.add_mutually_exclusive_group()
    ca.add_argument(
        "--ca", type=Path, help="CA file for the appliance's certificate (default: the system's)"
    )
    ca.add_argument(
        "--attested-key-only",
        action="store_true",
        help="check the certificate against no CA: only the attestation, which must bind the "
        "key this connection presented, authenticates it (an appliance's per-boot key)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")


def _run_verify_appliance(args: argparse.Namespace) -> Verdict:
    import ssl

    import httpx

    from attestation.remote.connection import fetch_attestation, new_nonce
    from attestation.remote.errors import ApplianceAttestationError
    from attestation.remote.policy import AppliancePolicy
    from attestation.remote.trust import ApplianceTrust
    from attestation.remote.verify import channel_checks, verify_appliance
    from attestation.verdict import Check

    if (args.policy is None) != (args.trust is None):
        raise PolicyError("give --policy and --trust together (or neither, to only look)")
    policy = None if args.policy is None else AppliancePolicy.from_file(args.policy)
    trust = None if args.trust is None else ApplianceTrust.load(args.trust)
    origin = httpx.URL(args.url)
    if origin.scheme != "https":
        raise PolicyError(f"{args.url} is not https://: only a TLS channel can be attested")
    try:
        verify = ssl.create_default_context(cafile=args.ca) if args.ca else True
    except (OSError, ssl.SSLError) as exc:
        raise PolicyError(f"--ca {args.ca}: {exc}") from exc
    if args.attested_key_only:
        verify = False  # the key is checked below, against the evidence, and nothing else
    nonce = new_nonce()
    with httpx.HTTPTransport(verify=verify) as transport:
        try:
            answer = fetch_attestation(transport, origin, nonce, timeout_s=args.timeout)
        except (httpx.HTTPError, ApplianceAttestationError) as exc:
            raise EvidenceError(f"cannot attest {args.url}: {exc}") from exc
    at = datetime.now(UTC)
    document, peer = answer.document, answer.peer_spki_sha256
    seen = {"url": args.url, "tls_spki_sha256": peer.hex()}
    if document is not None and policy is not None and trust is not None:
        return verify_appliance(
            document, nonce=nonce, peer_spki_sha256=peer, policy=policy, trust=trust, at=at
        )
    if document is None:
        checks = [Check("appliance.tee", False, "the appliance says UNVERIFIED (tee.mode = "
                        "insecure-dev): its TEE is not attested")]  # fmt: skip
        seen["tee"] = "UNVERIFIED"
    elif document.evidence is None:
        checks = [Check("appliance.evidence", False, f"no evidence ({document.tee})")]
        seen["tee"] = document.tee
    else:
        checks = channel_checks(document, nonce, peer)
        seen |= {"tee": document.tee, "appliance_verdict": document.appliance_result}
    if policy is None:
        checks.append(Check("policy", False, "no client policy (--policy): nothing is trusted "
                            "without one; the checks above need none"))  # fmt: skip
    return Verdict(tuple(checks), at, {"appliance": seen})


SUBCOMMANDS["verify-appliance"] = (_add_verify_appliance, _run_verify_appliance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attestation", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(commands.add_parser(name))
    args = parser.parse_args(argv)
    try:
        verdict = SUBCOMMANDS[args.command][1](args)
    except (EvidenceError, PolicyError) as exc:
        error = {"result": "unusable input", "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(error) + "\n")
        return EXIT_UNUSABLE
    sys.stdout.write(json.dumps(verdict.to_json(), indent=2) + "\n")
    return EXIT_TRUSTED if verdict.trusted else EXIT_NOT_TRUSTED


if __name__ == "__main__":
    sys.exit(main())
