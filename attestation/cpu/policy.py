"""The CPU attestation policy: the `[snp]` and `[tdx]` tables of the policy file, parsed into
frozen objects, and the policy checks they make on evidence whose signatures already verified.

Fail closed, explained where chosen:
- a policy with neither table is a PolicyError; so is evidence of a kind whose table is absent;
- an allow-list (measurements, MRTDs, TCB statuses) must be present and non-empty: an empty
  list would accept nothing useful and most likely means a mistake, so it is refused outright;
- unknown keys are refused, so that a misspelt key cannot silently weaken the policy;
- a debug guest is never acceptable and no key can allow it: a debug SNP guest's memory can be
  read and written by the host through the DBG_DECRYPT/DBG_ENCRYPT commands, a debug TD's by
  the VMM, so nothing it attests to protects a model key.

`[snp]` keys:
  measurements = ["<96 hex>", ...]          launch digests allowed (required)
  min_tcb = {bootloader=, tee=, snp=, microcode=, fmc=}   minimum REPORTED_TCB (required;
                                             fmc only on Turin)
  allowed_vmpls = [0]                       VMPLs a report may come from (default [0])
  min_guest_svn = 0
  allow_migrate_ma = false                  a migration agent could export the guest
  min_tcb_current_and_committed = false     also hold CURRENT_TCB and COMMITTED_TCB to min_tcb
  allow_smt = true                          when false, refuse a guest policy allowing SMT and
                                             a platform with SMT enabled (PLATFORM_INFO SMT_EN)
  require_tsme = false                      require PLATFORM_INFO TSME_EN
  require_ciphertext_hiding = false         require PLATFORM_INFO CIPHERTEXT_HIDING_EN (report
                                             version 3 on; older reports are refused)
  products = ["Milan", "Genoa", "Turin"]    processor lines accepted (default: all pinned)
  host_data = ["<64 hex>", ...]             optional allow-list of HOST_DATA
  id_key_digests = ["<96 hex>", ...]        optional allow-list of ID_KEY_DIGEST
  revocation_accept = ["good"]              states of `attestation.cpu.revocation` accepted:
                                             a subset of good, stale, unchecked; never revoked
  revocation_max_age_s = 604800             a CRL issued longer ago than this is stale
`[tdx]` keys:
  mrtd = ["<96 hex>", ...]                  TD build measurements allowed (required)
  rtmr0 .. rtmr3 = ["<96 hex>", ...]        optional allow-lists of runtime measurements
  mrseam, mrconfigid, mrowner, mrownerconfig = ["<96 hex>", ...]   optional allow-lists of
                                             MRSEAM (the TDX module), MRCONFIGID, MROWNER,
                                             MROWNERCONFIG
  min_tee_tcb_svn = "<32 hex>"              optional minimum TEE_TCB_SVN, byte by byte (as
                                             Intel's TCB info compares its 16 components)
  tcb_statuses = ["UpToDate"]               acceptable TCB statuses (required; never Revoked)
  rejected_advisories = ["INTEL-SA-...", ...]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attestation.cpu.revocation import REVOCATION_STATES, RevocationStatus
from attestation.cpu.snp import PRODUCTS, Product, SnpReport, TcbVersion
from attestation.cpu.tdx import TdxClaims
from attestation.errors import PolicyError
from attestation.verdict import Check

TDX_TCB_STATUSES = (
    "UpToDate",
    "SWHardeningNeeded",
    "ConfigurationNeeded",
    "ConfigurationAndSWHardeningNeeded",
    "OutOfDate",
    "OutOfDateConfigurationNeeded",
)
TD_ATTRIBUTES_DEBUG = 1 << 0
TEE_TCB_SVN_SIZE = 16
# The optional TD allow-lists: policy key (also its check's name) -> (label, TdxClaims field).
TDX_ALLOW_LISTS = {
    "mrseam": ("MRSEAM", "mr_seam"),
    "mrconfigid": ("MRCONFIGID", "mr_config_id"),
    "mrowner": ("MROWNER", "mr_owner"),
    "mrownerconfig": ("MROWNERCONFIG", "mr_owner_config"),
}


def _hex_list(table: Mapping[str, Any], key: str, size: int, *, required: bool) -> frozenset[bytes]:
    values = table.get(key)
    if values is None:
        if required:
            raise PolicyError(f"the policy lacks the required `{key}` list")
        return frozenset()
    if not isinstance(values, list) or not values:
        raise PolicyError(f"policy `{key}` must be a non-empty list of hex strings")
    parsed = set()
    for value in values:
        try:
            raw = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != size:
            raise PolicyError(f"policy `{key}` entry {value!r} is not {size} bytes of hex")
        parsed.add(raw)
    return frozenset(parsed)


def _refuse_unknown(table: Mapping[str, Any], name: str, known: set[str]) -> None:
    if "allow_debug" in table:
        raise PolicyError(
            f"policy [{name}] `allow_debug` is not a setting: a debug guest is never trusted"
        )
    unknown = set(table) - known
    if unknown:
        raise PolicyError(f"policy [{name}] has unknown keys: {sorted(unknown)}")


def _bool(table: Mapping[str, Any], key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise PolicyError(f"policy `{key}` must be true or false")
    return value


def _int(value: Any, key: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PolicyError(f"policy `{key}` must be an integer in {low}..{high}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SnpPolicy:
    """What a verified SEV-SNP report must show (see the module docstring for the keys)."""

    measurements: frozenset[bytes]
    min_tcb: TcbVersion
    allowed_vmpls: frozenset[int] = frozenset({0})
    min_guest_svn: int = 0
    allow_migrate_ma: bool = False
    min_tcb_current_and_committed: bool = False
    allow_smt: bool = True
    require_tsme: bool = False
    require_ciphertext_hiding: bool = False
    products: frozenset[Product] = frozenset(PRODUCTS)
    host_data: frozenset[bytes] = frozenset()
    id_key_digests: frozenset[bytes] = frozenset()
    revocation_accept: frozenset[str] = frozenset({"good"})
    revocation_max_age_s: int = 7 * 24 * 3600

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> SnpPolicy:
        """Parse the `[snp]` table. Raises PolicyError on a missing, empty or malformed value."""
        known = {
            "measurements", "min_tcb", "allowed_vmpls", "min_guest_svn", "allow_migrate_ma",
            "allow_smt", "products", "host_data", "id_key_digests", "revocation_accept",
            "revocation_max_age_s", "min_tcb_current_and_committed", "require_tsme",
            "require_ciphertext_hiding",
        }  # fmt: skip
        _refuse_unknown(table, "snp", known)
        min_tcb = table.get("min_tcb")
        if not isinstance(min_tcb, Mapping) or not min_tcb:
            raise PolicyError("policy [snp] lacks the required `min_tcb` table")
        tcb_keys = {"bootloader", "tee", "snp", "microcode"}
        if not tcb_keys <= set(min_tcb) or set(min_tcb) - tcb_keys - {"fmc"}:
            raise PolicyError(
                "policy [snp] `min_tcb` needs exactly bootloader, tee, snp, microcode (and "
                "optionally fmc)"
            )
        vmpls = table.get("allowed_vmpls", [0])
        if not isinstance(vmpls, list) or not vmpls:
            raise PolicyError("policy [snp] `allowed_vmpls` must be a non-empty list")
        products = table.get("products", list(PRODUCTS))
        if not isinstance(products, list) or not products or set(products) - set(PRODUCTS):
            raise PolicyError(f"policy [snp] `products` must be a non-empty subset of {PRODUCTS}")
        revocation = table.get("revocation_accept", ["good"])
        if not isinstance(revocation, list) or not revocation:
            raise PolicyError("policy [snp] `revocation_accept` must be a non-empty list")
        if "revoked" in revocation:
            raise PolicyError("policy [snp] `revocation_accept` may never accept revoked")
        if set(revocation) - set(REVOCATION_STATES):
            raise PolicyError(f"policy [snp] `revocation_accept` must be among {REVOCATION_STATES}")
        max_age = _int(table.get("revocation_max_age_s", 7 * 24 * 3600),
                       "revocation_max_age_s", 1, 10 * 365 * 24 * 3600)  # fmt: skip
        return cls(
            measurements=_hex_list(table, "measurements", 48, required=True),
            min_tcb=TcbVersion(
                **{key: _int(value, f"min_tcb.{key}", 0, 255) for key, value in min_tcb.items()}
            ),
            allowed_vmpls=frozenset(_int(v, "allowed_vmpls", 0, 3) for v in vmpls),
            min_guest_svn=_int(table.get("min_guest_svn", 0), "min_guest_svn", 0, 2**32 - 1),
            allow_migrate_ma=_bool(table, "allow_migrate_ma", False),
            min_tcb_current_and_committed=_bool(table, "min_tcb_current_and_committed", False),
            allow_smt=_bool(table, "allow_smt", True),
            require_tsme=_bool(table, "require_tsme", False),
            require_ciphertext_hiding=_bool(table, "require_ciphertext_hiding", False),
            products=frozenset(products),
            host_data=_hex_list(table, "host_data", 32, required=False),
            id_key_digests=_hex_list(table, "id_key_digests", 48, required=False),
            revocation_accept=frozenset(revocation),
            revocation_max_age_s=max_age,
        )

    def evaluate(
        self, report: SnpReport, product: Product, revocation: RevocationStatus
    ) -> list[Check]:
        """The policy checks of a report whose signatures verified (`snp.policy.*`), with the
        revocation state of its chain."""
        tcb = TcbVersion.from_bytes(report.reported_tcb, product)
        checks = [
            _check("snp.policy.debug", not report.debug_allowed, "debug must be off: the guest "
                   "policy allows debugging, so the host can read and write guest memory"),
            _check("snp.policy.measurement", report.measurement in self.measurements,
                   f"measurement {report.measurement.hex()} is not an allowed measurement"),
            _check("snp.policy.min_tcb", tcb.at_least(self.min_tcb),
                   f"reported TCB {tcb.to_json()} is below the minimum {self.min_tcb.to_json()}"),
            _check("snp.policy.vmpl", report.vmpl in self.allowed_vmpls,
                   f"the report comes from VMPL {report.vmpl}, allowed: "
                   f"{sorted(self.allowed_vmpls)}"),
            _check("snp.policy.guest_svn", report.guest_svn >= self.min_guest_svn,
                   f"guest SVN {report.guest_svn} is below {self.min_guest_svn}"),
            _check("snp.policy.migrate_ma", self.allow_migrate_ma or not report.migrate_ma_allowed,
                   "the guest policy allows a migration agent, which the policy refuses"),
            _check("snp.policy.smt", self.allow_smt or not report.smt_allowed,
                   "the guest policy allows SMT, which the policy refuses"),
            _check("snp.policy.product", product in self.products,
                   f"processor line {product} is not allowed"),
            _check("snp.policy.revocation", revocation.state in self.revocation_accept,
                   f"revocation state {revocation.state} is not accepted "
                   f"({sorted(self.revocation_accept)}): {revocation.detail}"),
        ]  # fmt: skip
        checks.extend(self._platform_checks(report, product))
        if self.host_data:
            checks.append(_check("snp.policy.host_data", report.host_data in self.host_data,
                                 "HOST_DATA is not an allowed value"))  # fmt: skip
        if self.id_key_digests:
            checks.append(_check("snp.policy.id_key", report.id_key_digest in self.id_key_digests,
                                 "ID_KEY_DIGEST is not an allowed ID key"))  # fmt: skip
        return checks

    def _platform_checks(self, report: SnpReport, product: Product) -> list[Check]:
        """The checks of the optional settings on the platform's TCB and PLATFORM_INFO."""
        checks = []
        if self.min_tcb_current_and_committed:
            # REPORTED_TCB is what the VCEK certifies, but CURRENT_TCB is the firmware running
            # now and COMMITTED_TCB the level it cannot be rolled back below.
            for label, raw in ("current", report.current_tcb), ("committed", report.committed_tcb):
                tcb = TcbVersion.from_bytes(raw, product)
                checks.append(_check(f"snp.policy.min_{label}_tcb", tcb.at_least(self.min_tcb),
                                     f"{label} TCB {tcb.to_json()} is below the minimum "
                                     f"{self.min_tcb.to_json()}"))  # fmt: skip
        if not self.allow_smt:
            checks.append(_check("snp.policy.platform_smt", not report.platform_smt_enabled,
                                 "the platform runs with SMT enabled (PLATFORM_INFO SMT_EN), "
                                 "which the policy refuses"))  # fmt: skip
        if self.require_tsme:
            checks.append(_check("snp.policy.tsme", report.tsme_enabled,
                                 "the platform does not run with TSME enabled "
                                 "(PLATFORM_INFO TSME_EN), which the policy requires"))  # fmt: skip
        if self.require_ciphertext_hiding:
            checks.append(_check("snp.policy.ciphertext_hiding", report.ciphertext_hiding_enabled,
                                 "the platform does not run with ciphertext hiding enabled "
                                 "(PLATFORM_INFO CIPHERTEXT_HIDING_EN, report version 3 on), "
                                 "which the policy requires"))  # fmt: skip
        return checks


@dataclass(frozen=True, slots=True)
class TdxPolicy:
    """What a verified TDX quote must show (see the module docstring for the keys)."""

    mrtd: frozenset[bytes]
    tcb_statuses: frozenset[str]
    rtmrs: tuple[frozenset[bytes], frozenset[bytes], frozenset[bytes], frozenset[bytes]] = (
        frozenset(), frozenset(), frozenset(), frozenset(),
    )  # fmt: skip
    rejected_advisories: frozenset[str] = frozenset()
    td_allow_lists: tuple[tuple[str, frozenset[bytes]], ...] = ()
    min_tee_tcb_svn: bytes | None = None

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> TdxPolicy:
        """Parse the `[tdx]` table. Raises PolicyError on a missing, empty or malformed value."""
        known = {"mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3", "tcb_statuses", "rejected_advisories",
                 "min_tee_tcb_svn", *TDX_ALLOW_LISTS}  # fmt: skip
        _refuse_unknown(table, "tdx", known)
        statuses = table.get("tcb_statuses")
        if not isinstance(statuses, list) or not statuses:
            raise PolicyError("policy [tdx] lacks a non-empty `tcb_statuses` list")
        if "Revoked" in statuses:
            raise PolicyError("policy [tdx] `tcb_statuses` may never accept Revoked")
        if set(statuses) - set(TDX_TCB_STATUSES):
            raise PolicyError(f"policy [tdx] `tcb_statuses` must be among {TDX_TCB_STATUSES}")
        advisories = table.get("rejected_advisories", [])
        if not isinstance(advisories, list) or not all(isinstance(a, str) for a in advisories):
            raise PolicyError("policy [tdx] `rejected_advisories` must be a list of strings")
        rtmrs = tuple(_hex_list(table, f"rtmr{i}", 48, required=False) for i in range(4))
        allow_lists = {key: _hex_list(table, key, 48, required=False) for key in TDX_ALLOW_LISTS}
        return cls(
            mrtd=_hex_list(table, "mrtd", 48, required=True),
            tcb_statuses=frozenset(statuses),
            rtmrs=rtmrs,  # type: ignore[arg-type]
            rejected_advisories=frozenset(advisories),
            td_allow_lists=tuple((key, values) for key, values in allow_lists.items() if values),
            min_tee_tcb_svn=_tee_tcb_svn(table.get("min_tee_tcb_svn")),
        )

    def evaluate(self, claims: TdxClaims) -> list[Check]:
        """The policy checks of a quote that dcap-qvl verified (`tdx.policy.*`)."""
        attributes = int.from_bytes(claims.td_attributes, "little")
        mr_td, tcb_status, rtmrs = claims.mr_td, claims.tcb_status, claims.rtmrs
        rejected = sorted(set(claims.advisory_ids) & self.rejected_advisories)
        checks = [
            _check("tdx.policy.debug", not attributes & TD_ATTRIBUTES_DEBUG,
                   "debug must be off: TD attribute DEBUG is set, so the VMM can read and "
                   "write TD memory"),
            _check("tdx.policy.mrtd", mr_td in self.mrtd,
                   f"MRTD {mr_td.hex()} is not an allowed TD measurement"),
            _check("tdx.policy.tcb_status", tcb_status in self.tcb_statuses,
                   f"TCB status {tcb_status} is not among {sorted(self.tcb_statuses)}"),
            _check("tdx.policy.advisories", not rejected,
                   f"the platform is affected by rejected advisories {rejected}"),
        ]  # fmt: skip
        for index, allowed in enumerate(self.rtmrs):
            if allowed:
                detail = f"RTMR{index} {rtmrs[index].hex()} is not allowed"
                checks.append(_check(f"tdx.policy.rtmr{index}", rtmrs[index] in allowed, detail))
        for key, allowed in self.td_allow_lists:
            label, attribute = TDX_ALLOW_LISTS[key]
            value: bytes = getattr(claims, attribute)
            checks.append(_check(f"tdx.policy.{key}", value in allowed,
                                 f"{label} {value.hex()} is not an allowed value"))  # fmt: skip
        if self.min_tee_tcb_svn is not None:
            svn, minimum = claims.tee_tcb_svn, self.min_tee_tcb_svn
            checks.append(_check("tdx.policy.min_tee_tcb_svn",
                                 len(svn) == len(minimum)
                                 and all(a >= b for a, b in zip(svn, minimum, strict=True)),
                                 f"TEE_TCB_SVN {svn.hex()} is below the minimum {minimum.hex()} "
                                 "in at least one component"))  # fmt: skip
        return checks


def _tee_tcb_svn(value: Any) -> bytes | None:
    if value is None:
        return None
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != TEE_TCB_SVN_SIZE:
        raise PolicyError(
            f"policy [tdx] `min_tee_tcb_svn` must be {TEE_TCB_SVN_SIZE} bytes of hex, got {value!r}"
        )
    return raw


@dataclass(frozen=True, slots=True)
class CpuPolicy:
    """The `[snp]` and/or `[tdx]` policy. Evidence of a kind whose table is absent is refused."""

    snp: SnpPolicy | None = None
    tdx: TdxPolicy | None = None

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any]) -> CpuPolicy:
        """Parse `[snp]` and `[tdx]` from the tables of `attestation.policy.read_policy_file`.
        Raises PolicyError if neither is present, or either is malformed."""
        snp = tables.get("snp")
        tdx = tables.get("tdx")
        if snp is None and tdx is None:
            raise PolicyError(
                "the policy has neither an [snp] nor a [tdx] table: CPU evidence is never "
                "accepted without one"
            )
        for name, table in (("snp", snp), ("tdx", tdx)):
            if table is not None and (not isinstance(table, Mapping) or not table):
                raise PolicyError(f"policy [{name}] must be a non-empty table")
        return cls(
            snp=None if snp is None else SnpPolicy.from_table(snp),
            tdx=None if tdx is None else TdxPolicy.from_table(tdx),
        )


def _check(name: str, passed: bool, failure_detail: str) -> Check:
    return Check(name=name, passed=passed, detail="" if passed else failure_detail)
