"""GpuReport.parse: strict SPDM 1.1, every length agreeing with the bytes present. Malformed
reports are synthetic (built by tests/attestation/gpu/synthetic.build_report, then altered)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from attestation.gpu.errors import ReportFormatError
from attestation.gpu.report import REQUEST_LEN, GpuReport
from tests.attestation.gpu.synthetic import build_report, default_measurements

KEY = ec.generate_private_key(ec.SECP384R1())
NONCE = bytes(range(32))
RESPONSE = REQUEST_LEN  # offset of the response


def report(**kwargs: object) -> bytes:
    args: dict = {
        "driver_version": "550.90.07",
        "vbios_version": "96.00.9F.00.01",
        "measurements": default_measurements(),
        "fwid": bytes(48),
    }
    args.update(kwargs)
    return build_report(KEY, NONCE, **args)


def put(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


def test_synthetic_report_parses_to_what_was_built() -> None:
    parsed = GpuReport.parse(report())
    assert parsed.nonce == NONCE
    assert parsed.driver_version == "550.90.07"
    assert parsed.vbios_version == "96.00.9F.00.01"
    assert parsed.fwid == bytes(48)
    assert dict(parsed.measurements) == default_measurements()
    assert parsed.signed_bytes == report_bytes_without_signature(parsed)


def report_bytes_without_signature(parsed: GpuReport) -> bytes:
    return (parsed.request + parsed.response)[:-96]


@pytest.mark.parametrize(
    ("defect", "alter", "message"),
    [
        ("SPDM 1.0 request", lambda r: put(r, 0, b"\x10"), "not SPDM 1.1 GET_MEASUREMENTS"),
        ("no signature requested", lambda r: put(r, 2, b"\x00"), "not SPDM 1.1"),
        ("one block only requested", lambda r: put(r, 3, b"\x01"), "not SPDM 1.1"),
        ("slot out of range", lambda r: put(r, 36, b"\x09"), "slot id 9"),
        ("response of another kind", lambda r: put(r, RESPONSE + 1, b"\x61"), "MEASUREMENTS"),
        ("response slot differs", lambda r: put(r, RESPONSE + 3, b"\x01"), "slot 1 differs"),
        ("block count too high", lambda r: put(r, RESPONSE + 4, b"\x41"), "truncated"),
        ("block count too low", lambda r: put(r, RESPONSE + 4, b"\x3f"), "trail 63"),
        ("record length too long", lambda r: put(r, RESPONSE + 5, b"\xff\xff\x00"), "truncated"),
        ("non-DMTF block", lambda r: put(r, RESPONSE + 9, b"\x02"), "not in DMTF format"),
        ("raw bit-stream block", lambda r: put(r, RESPONSE + 12, b"\x81"), "raw bit stream"),
        ("short digest", lambda r: put(r, RESPONSE + 13, b"\x20\x00"), "not a 48-byte"),
        ("indices out of order", lambda r: put(r, RESPONSE + 8 + 55, b"\x01"), "follows"),
        ("trailing byte", lambda r: r + b"\x00", "trail the signature"),
        ("truncated", lambda r: r[:-1], "truncated"),
        ("empty", lambda r: b"", "too short"),
    ],
)
def test_malformed_report_is_refused(
    defect: str, alter: Callable[[bytes], bytes], message: str
) -> None:
    with pytest.raises(ReportFormatError, match=message):
        GpuReport.parse(alter(report()))


def test_duplicate_opaque_field_is_refused() -> None:
    good = report()
    opaque_len_at = RESPONSE + 8 + 64 * 55 + 32  # header, record, responder nonce
    opaque_len = int.from_bytes(good[opaque_len_at : opaque_len_at + 2], "little")
    fwid_tlv = (20).to_bytes(2, "little") + (48).to_bytes(2, "little") + bytes(48)
    body_end = opaque_len_at + 2 + opaque_len
    duplicated = good[:body_end] + fwid_tlv + good[body_end:]
    duplicated = put(duplicated, opaque_len_at, (opaque_len + len(fwid_tlv)).to_bytes(2, "little"))
    with pytest.raises(ReportFormatError, match="appears twice"):
        GpuReport.parse(duplicated)


def test_non_ascii_driver_version_is_refused_when_parsing() -> None:
    good = report(driver_version="550.90.07")
    bad = good.replace(b"550.90.07\0", b"550.90.0\xff\0")
    with pytest.raises(ReportFormatError, match="driver version is not ASCII"):
        GpuReport.parse(bad)


def test_malformed_vbios_version_field_is_refused() -> None:
    parsed = GpuReport.parse(report())
    broken = GpuReport(
        **{**{f: getattr(parsed, f) for f in GpuReport.__slots__}, "opaque": {6: b"\x01\x02"}}
    )
    with pytest.raises(ReportFormatError, match="VBIOS version field"):
        _ = broken.vbios_version
