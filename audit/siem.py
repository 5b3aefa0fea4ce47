"""SIEM copies of audit entries: OCSF 1.8 JSON events and RFC 5424 syslog lines.

Each copy carries the entry's log origin, index and leaf hash (and the entry's exact bytes), so
an event in the SIEM ties back to a position in the verifiable log: recompute
SHA-256(0x00 || raw_data) and compare it with the leaf hash, then ask the appliance for the
entry's inclusion proof. Pure functions of an entry's stored bytes; standard library only.

OCSF classes: Authentication (3002) for `auth.authenticate`; API Activity (6003) for everything
else, with the `ai_operation` profile (model and token counts) on inference events.
"""

from __future__ import annotations

from datetime import UTC, datetime

from audit.bundle_json import parse_entry
from audit.encoding import encode_base64
from audit.merkle import hash_leaf

OCSF_VERSION = "1.8.0"
PRODUCT = {"name": "Inferno", "vendor_name": "Inferno", "feature": {"name": "audit log"}}
# RFC 5424 facility 13 is "log audit"; the structured-data ID uses the documentation enterprise
# number of RFC 5612 until one is registered for the product.
SYSLOG_FACILITY = 13
SD_ID = "inferno-audit@32473"
_SEVERITY = {  # outcome -> (OCSF severity_id, syslog severity)
    "success": (1, 6),
    "accepted": (1, 6),
    "aborted": (2, 5),
    "failure": (3, 4),
    "denied": (3, 4),
}
_API_ACTIVITY = {"inference": (1, "Create"), "audit": (2, "Read"), "admin": (3, "Update")}


def _epoch_ms(time: str) -> int:
    return int(datetime.fromisoformat(time).astimezone(UTC).timestamp() * 1000)


def to_ocsf(data: bytes, origin: str) -> dict[str, object]:
    """The OCSF 1.8 event for the entry whose stored bytes are `data`."""
    entry = parse_entry(data, what="the entry")
    actor, details = entry["actor"], entry["details"]
    outcome = entry["outcome"]
    success = outcome in ("success", "accepted")
    severity_id = _SEVERITY[outcome][0]
    user = {"uid": actor["subject"], "name": actor["subject"]} if actor["subject"] else {}
    if actor["roles"]:
        user["groups"] = [{"name": role, "type": "role"} for role in actor["roles"]]
    address = entry["source"]["address"]
    metadata: dict[str, object] = {
        "version": OCSF_VERSION,
        "product": PRODUCT,
        "log_name": origin,
        "sequence": entry["index"],
        "uid": encode_base64(hash_leaf(data)),
        "correlation_uid": entry["request_id"],
        "original_time": entry["time"],
        "profiles": [],
    }
    event: dict[str, object] = {
        "time": _epoch_ms(entry["time"]),
        "severity_id": severity_id,
        "status_id": 1 if success else 2,
        "status": "Success" if success else "Failure",
        "status_detail": outcome,
        "message": entry["action"],
        "src_endpoint": {"ip": address} if address else {"name": origin},
        "raw_data": data.decode(),
        "metadata": metadata,
    }
    if entry["action"] == "auth.authenticate":
        event.update(
            category_uid=3, class_uid=3002, activity_id=1, activity_name="Logon", type_uid=300201,
            user=user or {"name": "unknown"}, auth_protocol_id=6, auth_protocol="OAUTH 2.0",
            service={"name": "inferno"},
        )  # fmt: skip
        return event
    activity_id, activity_name = _API_ACTIVITY.get(entry["action"].split(".")[0], (99, "Other"))
    event.update(
        category_uid=6,
        class_uid=6003,
        activity_id=activity_id,
        activity_name=activity_name,
        type_uid=600300 + activity_id,
        actor={
            "user": user,
            "idp": {"name": actor["issuer"]} if actor["issuer"] else {},
            "app_name": actor["client"],
        },
        api={
            "operation": entry["action"],
            "request": {"uid": entry["request_id"] or f"{origin}/{entry['index']}"},
        },
    )
    if entry["action"].startswith("inference."):
        metadata["profiles"] = ["ai_operation"]
        event["ai_model"] = {
            "name": details["model"],
            "model_name": details["model"],
            "uid": details["weights_digest"],
            "ai_provider": "Inferno",
        }
        if "prompt_tokens" in details:
            event["message_context"] = {
                "uid": entry["request_id"],
                "prompt_tokens": details["prompt_tokens"],
                "completion_tokens": details["completion_tokens"],
                "total_tokens": details["prompt_tokens"] + details["completion_tokens"],
            }
    return event


def _sd_escape(value: str) -> str:
    # RFC 5424, section 6.3.3: '"', '\' and ']' are escaped inside PARAM-VALUE.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")


def to_syslog(data: bytes, origin: str, hostname: str = "-") -> str:
    """The RFC 5424 line for the entry whose stored bytes are `data` (no trailing newline).

    MSG is a UTF-8 BOM and the entry's exact bytes, so the leaf hash can be recomputed from it.
    """
    entry = parse_entry(data, what="the entry")
    priority = SYSLOG_FACILITY * 8 + _SEVERITY[entry["outcome"]][1]
    params = {
        "origin": origin,
        "index": str(entry["index"]),
        "leaf": encode_base64(hash_leaf(data)),
        "outcome": entry["outcome"],
    }
    structured = "[" + SD_ID + "".join(f' {k}="{_sd_escape(v)}"' for k, v in params.items()) + "]"
    msgid = entry["action"][:32]
    return f"<{priority}>1 {entry['time']} {hostname} inferno - {msgid} {structured} \ufeff" + (
        data.decode()
    )
