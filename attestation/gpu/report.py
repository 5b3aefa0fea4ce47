"""An NVIDIA Hopper attestation report: the SPDM 1.1 GET_MEASUREMENTS request the driver sent
and the MEASUREMENTS response the GPU signed (DSP0274 1.1.0 §10.11), parsed strictly.

Layout (all integers little-endian):

    request   0x11 0xE0 param1=0x01 (signature requested) param2=0xFF (all blocks)
              nonce[32] slot_id                                                  37 bytes
    response  0x11 0x60 param1 param2(slot) num_blocks u8 record_len u24
              record: num_blocks × (index u8, spec u8 = 0x01 DMTF, size u16,
                                    value_type u8, value_size u16, value[48] SHA-384)
              responder_nonce[32] opaque_len u16 opaque: TLVs (type u16, len u16, value)
              signature[96]  raw r ‖ s, ECDSA-P384 over request ‖ response-without-signature

Every length must agree with the bytes present and nothing may trail: a report that parses is
exactly the bytes that were signed. Opaque TLV types follow NVIDIA's nvtrust verifier (3 driver
version, 6 VBIOS version, 15 chip SKU, 17 project, 18 project SKU, 20 FWID).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from attestation.gpu.errors import ReportFormatError

SPDM_VERSION_1_1 = 0x11
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
REQUEST_LEN = 37
NONCE_LEN = 32
SIGNATURE_LEN = 96  # raw r ‖ s of ECDSA-P384
DIGEST_LEN = 48  # SHA-384
MAX_OPAQUE_LEN = 1024  # DSP0274 1.1 caps OpaqueLength at 1024

OPAQUE_DRIVER_VERSION = 3
OPAQUE_VBIOS_VERSION = 6
OPAQUE_CHIP_SKU = 15
OPAQUE_PROJECT = 17
OPAQUE_PROJECT_SKU = 18
OPAQUE_FWID = 20


@dataclass(frozen=True, slots=True)
class GpuReport:
    """A parsed report. `measurements[i]` is the 48-byte value of measurement block `i`
    (1-based, as the GPU numbers them); `opaque[t]` the value of opaque TLV type `t`."""

    request: bytes
    response: bytes
    nonce: bytes
    slot_id: int
    measurements: Mapping[int, bytes]
    responder_nonce: bytes
    opaque: Mapping[int, bytes]
    signature: bytes

    @property
    def signed_bytes(self) -> bytes:
        """What the signature covers: request ‖ response without its trailing signature."""
        return self.request + self.response[:-SIGNATURE_LEN]

    @classmethod
    def parse(cls, raw: bytes) -> GpuReport:
        """Parse `raw` strictly. Raises ReportFormatError naming the first field that is wrong."""
        raw = bytes(raw)
        if len(raw) < REQUEST_LEN + 8:
            raise ReportFormatError(f"report is {len(raw)} bytes: too short for SPDM 1.1")
        request, response = raw[:REQUEST_LEN], raw[REQUEST_LEN:]
        if request[:4] != bytes([SPDM_VERSION_1_1, GET_MEASUREMENTS, 0x01, 0xFF]):
            raise ReportFormatError(
                f"request header {request[:4].hex()} is not SPDM 1.1 GET_MEASUREMENTS of all "
                "blocks with a signature (11e001ff)"
            )
        nonce, slot_id = request[4:36], request[36]
        if slot_id > 7:
            raise ReportFormatError(f"request slot id {slot_id} is out of range 0..7")
        reader = _Reader(response)
        if reader.take(2) != bytes([SPDM_VERSION_1_1, MEASUREMENTS]):
            raise ReportFormatError("response is not an SPDM 1.1 MEASUREMENTS message (1160)")
        reader.take(1)  # param1: reserved when param2 of the request is 0xFF
        response_slot = reader.u8() & 0x0F
        if response_slot != slot_id:
            raise ReportFormatError(f"response slot {response_slot} differs from request {slot_id}")
        num_blocks = reader.u8()
        record = reader.take(int.from_bytes(reader.take(3), "little"))
        measurements = _parse_record(record, num_blocks)
        responder_nonce = reader.take(NONCE_LEN)
        opaque_len = reader.u16()
        if opaque_len > MAX_OPAQUE_LEN:
            raise ReportFormatError(f"opaque length {opaque_len} exceeds SPDM's {MAX_OPAQUE_LEN}")
        opaque = _parse_opaque(reader.take(opaque_len))
        signature = reader.take(SIGNATURE_LEN)
        if reader.remaining:
            raise ReportFormatError(f"{reader.remaining} bytes trail the signature")
        report = cls(
            request=request,
            response=response,
            nonce=nonce,
            slot_id=slot_id,
            measurements=MappingProxyType(measurements),
            responder_nonce=responder_nonce,
            opaque=MappingProxyType(opaque),
            signature=signature,
        )
        # Decode now the opaque fields read later, so that a malformed one fails here.
        _ = (report.driver_version, report.vbios_version, report.board)
        return report

    @property
    def driver_version(self) -> str | None:
        """The driver version string (opaque type 3, NUL-terminated ASCII), e.g. "550.90.07"."""
        value = self.opaque.get(OPAQUE_DRIVER_VERSION)
        return None if value is None else _ascii(value, "driver version")

    @property
    def vbios_version(self) -> str | None:
        """The VBIOS version as NVIDIA prints it (opaque type 6, 8 bytes), e.g. "96.00.9F.00.01":
        bytes 3, 2, 1, 0 then 4, as nvtrust formats it."""
        value = self.opaque.get(OPAQUE_VBIOS_VERSION)
        if value is None:
            return None
        if len(value) != 8:
            raise ReportFormatError(f"VBIOS version field is {len(value)} bytes, not 8")
        return ".".join(f"{value[i]:02X}" for i in (3, 2, 1, 0, 4))

    @property
    def fwid(self) -> bytes | None:
        """The FWID (opaque type 20), present from driver 550 on."""
        return self.opaque.get(OPAQUE_FWID)

    @property
    def board(self) -> tuple[str, str, str] | None:
        """(project, project SKU, chip SKU), e.g. ("1010", "0200", "882"): the board the VBIOS
        RIM names in its identifier. None if any of the three is absent."""
        fields = [self.opaque.get(t) for t in (OPAQUE_PROJECT, OPAQUE_PROJECT_SKU, OPAQUE_CHIP_SKU)]
        if any(value is None for value in fields):
            return None
        project, project_sku, chip_sku = (_ascii(v, "board field") for v in fields)  # type: ignore[arg-type]
        return project, project_sku, chip_sku


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data, self._offset = data, 0

    @property
    def remaining(self) -> int:
        return len(self._data) - self._offset

    def take(self, n: int) -> bytes:
        if n > self.remaining:
            raise ReportFormatError(
                f"response truncated: needs {n} bytes at offset {self._offset}, "
                f"{self.remaining} left"
            )
        chunk = self._data[self._offset : self._offset + n]
        self._offset += n
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "little")


def _parse_record(record: bytes, num_blocks: int) -> dict[int, bytes]:
    """The measurement record: exactly `num_blocks` DMTF blocks of one SHA-384 digest each, with
    strictly increasing indices, and no byte left over."""
    reader = _Reader(record)
    blocks: dict[int, bytes] = {}
    last_index = 0
    for _ in range(num_blocks):
        index, spec, size = reader.u8(), reader.u8(), reader.u16()
        if spec != 0x01:
            raise ReportFormatError(
                f"measurement block {index} is not in DMTF format (spec {spec})"
            )
        if index <= last_index:
            raise ReportFormatError(f"measurement block index {index} follows {last_index}")
        body = _Reader(reader.take(size))
        value_type, value_size = body.u8(), body.u16()
        if value_type & 0x80:
            raise ReportFormatError(f"measurement block {index} is a raw bit stream, not a digest")
        if value_size != DIGEST_LEN or body.remaining != DIGEST_LEN:
            raise ReportFormatError(
                f"measurement block {index} holds {body.remaining} bytes (says {value_size}), "
                f"not a {DIGEST_LEN}-byte SHA-384 digest"
            )
        blocks[index] = body.take(DIGEST_LEN)
        last_index = index
    if reader.remaining:
        raise ReportFormatError(f"{reader.remaining} bytes trail {num_blocks} measurement blocks")
    return blocks


def _parse_opaque(data: bytes) -> dict[int, bytes]:
    reader = _Reader(data)
    fields: dict[int, bytes] = {}
    while reader.remaining:
        field_type, length = reader.u16(), reader.u16()
        if field_type in fields:
            raise ReportFormatError(f"opaque field type {field_type} appears twice")
        fields[field_type] = reader.take(length)
    return fields


def _ascii(value: bytes, what: str) -> str:
    text = value.split(b"\0", 1)[0]
    try:
        decoded = text.decode("ascii")
    except UnicodeDecodeError:
        raise ReportFormatError(f"{what} is not ASCII") from None
    if not decoded.isprintable():
        raise ReportFormatError(f"{what} holds unprintable characters")
    return decoded
