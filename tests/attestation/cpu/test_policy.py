"""The [snp]/[tdx] policy fails closed: no table, an empty or malformed allow-list, an unknown
key, a request to allow debug or accept a Revoked TCB are all PolicyErrors, never a pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation.cpu import CpuPolicy
from attestation.cpu.policy import SnpPolicy, TdxPolicy
from attestation.cpu.snp import TcbVersion
from attestation.errors import PolicyError
from attestation.policy import read_policy_file

MEASUREMENT = "ab" * 48
MIN_TCB = {"bootloader": 3, "tee": 0, "snp": 20, "microcode": 200}
SNP = {"measurements": [MEASUREMENT], "min_tcb": MIN_TCB}
TDX = {"mrtd": ["cd" * 48], "tcb_statuses": ["UpToDate", "SWHardeningNeeded"]}


def test_policy_file_with_both_tables_parses(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        f"""
[snp]
measurements = ["{MEASUREMENT}"]
min_tcb = {{ bootloader = 3, tee = 0, snp = 20, microcode = 200 }}
allowed_vmpls = [0, 1]

[tdx]
mrtd = ["{"cd" * 48}"]
rtmr1 = ["{"ef" * 48}"]
tcb_statuses = ["UpToDate"]
"""
    )
    policy = CpuPolicy.from_tables(read_policy_file(path))
    assert policy.snp is not None and policy.tdx is not None
    assert policy.snp.min_tcb == TcbVersion(3, 0, 20, 200)
    assert policy.snp.allowed_vmpls == {0, 1}
    assert policy.tdx.rtmrs[1] == {bytes.fromhex("ef" * 48)}


def test_policy_without_snp_or_tdx_table_is_refused() -> None:
    with pytest.raises(PolicyError, match=r"neither an \[snp\] nor a \[tdx\]"):
        CpuPolicy.from_tables({"gpu": {"x": 1}})


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "non-empty table"),
        ({"min_tcb": MIN_TCB}, "required `measurements`"),
        ({"measurements": [], "min_tcb": MIN_TCB}, "non-empty list"),
        ({"measurements": ["abcd"], "min_tcb": MIN_TCB}, "not 48 bytes"),
        ({"measurements": ["zz" * 48], "min_tcb": MIN_TCB}, "not 48 bytes"),
        ({"measurements": [MEASUREMENT]}, "min_tcb"),
        ({**SNP, "min_tcb": {"bootloader": 1}}, "min_tcb"),
        ({**SNP, "min_tcb": {**MIN_TCB, "snp": 256}}, "0..255"),
        ({**SNP, "allow_debug": True}, "debug guest is never trusted"),
        ({**SNP, "measurment": [MEASUREMENT]}, "unknown keys"),
        ({**SNP, "allowed_vmpls": []}, "allowed_vmpls"),
        ({**SNP, "allowed_vmpls": [4]}, "0..3"),
        ({**SNP, "products": ["Naples"]}, "products"),
        ({**SNP, "allow_migrate_ma": "no"}, "true or false"),
        ({**SNP, "revocation_accept": ["good", "revoked"]}, "never accept revoked"),
        ({**SNP, "revocation_accept": ["fine"]}, "must be among"),
        ({**SNP, "revocation_accept": []}, "non-empty list"),
        ({**SNP, "revocation_max_age_s": 0}, "revocation_max_age_s"),
    ],
)
def test_malformed_snp_table_is_refused(table: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        CpuPolicy.from_tables({"snp": table})


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"tcb_statuses": ["UpToDate"]}, "required `mrtd`"),
        ({"mrtd": ["cd" * 48]}, "tcb_statuses"),
        ({**TDX, "tcb_statuses": []}, "tcb_statuses"),
        ({**TDX, "tcb_statuses": ["UpToDate", "Revoked"]}, "never accept Revoked"),
        ({**TDX, "tcb_statuses": ["Fine"]}, "must be among"),
        ({**TDX, "rtmr2": []}, "non-empty list"),
        ({**TDX, "allow_debug": True}, "debug guest is never trusted"),
        ({**TDX, "mrtds": ["cd" * 48]}, "unknown keys"),
    ],
)
def test_malformed_tdx_table_is_refused(table: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        TdxPolicy.from_table(table)


def test_min_tcb_compares_every_component() -> None:
    policy = SnpPolicy.from_table(SNP)
    assert TcbVersion(3, 0, 20, 200).at_least(policy.min_tcb)
    assert TcbVersion(9, 9, 99, 255).at_least(policy.min_tcb)
    for lower in (TcbVersion(2, 0, 20, 200), TcbVersion(3, 0, 19, 200), TcbVersion(3, 0, 20, 199)):
        assert not lower.at_least(policy.min_tcb)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({**SNP, "min_tcb_current_and_committed": 1}, "true or false"),
        ({**SNP, "require_tsme": "yes"}, "true or false"),
        ({**SNP, "require_ciphertext_hiding": None}, "true or false"),
        ({**SNP, "require_tmse": True}, "unknown keys"),
    ],
)
def test_malformed_snp_platform_setting_is_refused(table: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        CpuPolicy.from_tables({"snp": table})


@pytest.mark.parametrize("key", ["mrseam", "mrconfigid", "mrowner", "mrownerconfig"])
def test_empty_or_malformed_td_allow_list_is_refused(key: str) -> None:
    with pytest.raises(PolicyError, match=f"`{key}` must be a non-empty list"):
        TdxPolicy.from_table({**TDX, key: []})
    with pytest.raises(PolicyError, match=f"`{key}` entry 'abcd' is not 48 bytes"):
        TdxPolicy.from_table({**TDX, key: ["abcd"]})


@pytest.mark.parametrize("value", ["06010300", "zz" * 16, 6, ["06"] * 16])
def test_malformed_min_tee_tcb_svn_is_refused(value: object) -> None:
    with pytest.raises(PolicyError, match="`min_tee_tcb_svn` must be 16 bytes of hex"):
        TdxPolicy.from_table({**TDX, "min_tee_tcb_svn": value})


def test_absent_optional_tdx_settings_judge_nothing() -> None:
    policy = TdxPolicy.from_table(TDX)
    assert policy.td_allow_lists == ()
    assert policy.min_tee_tcb_svn is None
