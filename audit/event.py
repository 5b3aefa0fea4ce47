"""Audit events: what an entry records, and builders for each kind of event the appliance logs.

An entry is one canonical JSON object (RFC 8785) with these members, all always present:

    v           schema version, 1
    index       the entry's position in the log (assigned by the store, under its lock)
    time        RFC 3339 UTC with microseconds, e.g. "2025-01-31T12:00:00.000000Z"
    action      dotted lowercase name: "inference.request", "auth.authenticate", "admin.<op>" ...
    outcome     success | failure | denied | accepted | aborted
    actor       {"issuer", "subject", "client", "roles"}: who, as the identity provider said
    source      {"address"}: the client's IP address, or null for the appliance's own events
    request_id  the request this belongs to, or null
    details     action-specific members; never prompt or response content, only commitments
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from audit.canonical import JsonValue, canonicalize, parse_canonical

SCHEMA_VERSION = 1
_ACTION = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")


class Outcome(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"
    DENIED = "denied"
    ACCEPTED = "accepted"  # a request admitted, before its result
    ABORTED = "aborted"  # a request the client or a shutdown cut short


class Action(StrEnum):
    BOOT_START = "boot.start"
    BOOT_PHASE = "boot.phase"
    BOOT_READY = "boot.ready"
    ENGINE_STOPPED = "engine.stopped"
    ATTESTATION_VERDICT = "attestation.verdict"
    INFERENCE_REQUEST = "inference.request"
    INFERENCE_COMPLETE = "inference.complete"
    API_REQUEST = "api.request"
    API_LIMITED = "api.limited"
    AUTHENTICATE = "auth.authenticate"
    AUTHORIZE = "auth.authorize"
    AUDIT_HEARTBEAT = "audit.heartbeat"
    AUDIT_EXPORT = "audit.export"
    AUDIT_VERIFY = "audit.verify"


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with microseconds and a `Z`; refuses naive datetimes."""
    if moment.tzinfo is None:
        raise ValueError("audit times must be timezone-aware")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Actor:
    """Who acted: the token's issuer and subject, the OAuth client, and the roles granted."""

    issuer: str | None = None
    subject: str | None = None
    client: str | None = None
    roles: Sequence[str] = ()

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "issuer": self.issuer,
            "subject": self.subject,
            "client": self.client,
            "roles": sorted(self.roles),
        }


# The appliance itself, for boot, attestation and log maintenance events.
SYSTEM = Actor(subject="system")


@dataclass(frozen=True)
class AuditEvent:
    """One event to append. `details` is copied and checked to be canonical JSON at creation."""

    action: str
    outcome: Outcome
    time: datetime
    actor: Actor = SYSTEM
    source_address: str | None = None
    request_id: str | None = None
    details: Mapping[str, JsonValue] = field(default_factory=dict)

    # The canonical bytes of `details`, made once at creation for `to_leaf`.
    _canonical_details: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _ACTION.fullmatch(self.action):
            raise ValueError(f"action {self.action!r} is not a dotted lowercase name")
        format_time(self.time)
        if self.source_address is not None:
            object.__setattr__(self, "source_address", _normalize_address(self.source_address))
        # A private, validated copy: later changes to the caller's dict cannot reach the log.
        canonical_details = canonicalize(self.details)
        object.__setattr__(self, "details", parse_canonical(canonical_details))
        object.__setattr__(self, "_canonical_details", canonical_details)

    def to_entry(self, index: int) -> dict[str, JsonValue]:
        """The entry object for log position `index` (canonicalize it to get the leaf bytes)."""
        return {
            "v": SCHEMA_VERSION,
            "index": index,
            "time": format_time(self.time),
            "action": str(self.action),
            "outcome": str(self.outcome),
            "actor": self.actor.to_json(),
            "source": {"address": self.source_address},
            "request_id": self.request_id,
            "details": dict(self.details),
        }

    def to_leaf(self, index: int) -> bytes:
        """The leaf bytes of entry `index`: exactly `canonicalize(self.to_entry(index))`, put
        together from the details canonicalized at creation and the other members (whose names
        are ASCII, so RFC 8785's UTF-16 member order is their plain order), to spare the log's
        writer a second walk of the details."""
        parts = (
            b'{"action":' + canonicalize(str(self.action)),
            b',"actor":' + canonicalize(self.actor.to_json()),
            b',"details":' + self._canonical_details,
            b',"index":' + canonicalize(index),
            b',"outcome":' + canonicalize(str(self.outcome)),
            b',"request_id":' + canonicalize(self.request_id),
            b',"source":{"address":' + canonicalize(self.source_address) + b"}",
            b',"time":' + canonicalize(format_time(self.time)),
            b',"v":' + canonicalize(SCHEMA_VERSION) + b"}",
        )
        return b"".join(parts)


def _normalize_address(text: str) -> str:
    """One spelling per client: IPv4 clients of a dual-stack socket are logged as IPv4."""
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def inference_request(
    *,
    time: datetime,
    actor: Actor,
    source_address: str | None,
    request_id: str,
    endpoint: str,
    model: str,
    weights_digest: str,
    sampling: Mapping[str, JsonValue],
    prompt_commitment: str,
    verdict_id: str | None = None,
) -> AuditEvent:
    """A request admitted for inference: logged before any generation starts (fail closed).
    `verdict_id` names the attestation verdict in force as it was admitted (the
    `attestation.verdict` entry with that id; None: nothing attested, as in insecure-dev)."""
    return AuditEvent(
        Action.INFERENCE_REQUEST,
        Outcome.ACCEPTED,
        time,
        actor,
        source_address,
        request_id,
        {
            "endpoint": endpoint,
            "model": model,
            "weights_digest": weights_digest,
            "sampling": dict(sampling),
            "prompt_commitment": prompt_commitment,
            "verdict_id": verdict_id,
        },
    )


def inference_complete(
    *,
    time: datetime,
    actor: Actor,
    source_address: str | None,
    request_id: str,
    outcome: Outcome,
    model: str,
    weights_digest: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str | None,
    latency_ms: float,
    prompt_commitment: str,
    response_commitment: str | None,
    error: str | None = None,
    verdict_id: str | None = None,
) -> AuditEvent:
    """The end of a request: success, failure (with the error's class, not its text) or abort,
    and the attestation verdict in force as it ended (`verdict_id`, as for inference_request: a
    re-attestation may have replaced the one it was admitted under)."""
    if outcome not in (Outcome.SUCCESS, Outcome.FAILURE, Outcome.ABORTED):
        raise ValueError(f"an inference completes with success, failure or aborted, not {outcome}")
    return AuditEvent(
        Action.INFERENCE_COMPLETE,
        outcome,
        time,
        actor,
        source_address,
        request_id,
        {
            "model": model,
            "weights_digest": weights_digest,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "finish_reason": finish_reason,
            "latency_ms": round(latency_ms, 3),
            "prompt_commitment": prompt_commitment,
            "response_commitment": response_commitment,
            "error": error,
            "verdict_id": verdict_id,
        },
    )


def api_request(
    *,
    time: datetime,
    actor: Actor,
    source_address: str | None,
    method: str,
    route: str | None,
    status: int,
) -> AuditEvent:
    """An API call that is not an accepted inference (a model listing, a proof, a request refused
    before it was accepted): the route it matched (its template, never the raw path, which the
    client chose) or None, and the HTTP status it was answered with."""
    return AuditEvent(
        Action.API_REQUEST,
        Outcome.SUCCESS if status < 400 else Outcome.FAILURE,
        time,
        actor,
        source_address,
        None,
        {"method": method, "route": route, "status": status},
    )


def request_limited(
    *,
    time: datetime,
    actor: Actor,
    source_address: str | None,
    method: str,
    route: str,
    limit: str,
    value: int,
) -> AuditEvent:
    """A request refused (429) by a per-caller limit: the setting that refused it, as
    `limits.<name>` (with `.<role>` for a role's), and its value."""
    return AuditEvent(
        Action.API_LIMITED,
        Outcome.DENIED,
        time,
        actor,
        source_address,
        None,
        {"method": method, "route": route, "limit": limit, "value": value},
    )


def authentication_failure(
    *,
    time: datetime,
    source_address: str | None,
    request_id: str | None,
    reason: str,
    claimed: Actor = Actor(),
) -> AuditEvent:
    """A bearer token refused. `claimed` holds what the token said, if it could be read at all;
    `reason` is a fixed phrase ("expired", "bad signature" ...), never the token."""
    return AuditEvent(
        Action.AUTHENTICATE,
        Outcome.FAILURE,
        time,
        claimed,
        source_address,
        request_id,
        {"reason": reason},
    )


def authorization_denied(
    *,
    time: datetime,
    actor: Actor,
    source_address: str | None,
    request_id: str | None,
    resource: str,
    required_roles: Sequence[str],
) -> AuditEvent:
    """An authenticated caller lacking the role a route needs."""
    return AuditEvent(
        Action.AUTHORIZE,
        Outcome.DENIED,
        time,
        actor,
        source_address,
        request_id,
        {"resource": resource, "required_roles": sorted(required_roles)},
    )


def admin_action(
    *,
    time: datetime,
    actor: Actor,
    source_address: str | None,
    request_id: str | None,
    operation: str,
    outcome: Outcome,
    target: Mapping[str, JsonValue],
) -> AuditEvent:
    """An administrator's change (`operation` like "model.load" becomes "admin.model.load")."""
    return AuditEvent(
        f"admin.{operation}",
        outcome,
        time,
        actor,
        source_address,
        request_id,
        {"target": dict(target)},
    )


def system_event(
    action: Action, *, time: datetime, outcome: Outcome, details: Mapping[str, JsonValue]
) -> AuditEvent:
    """The appliance's own events: boot phases, attestation verdicts, log heartbeats."""
    return AuditEvent(action, outcome, time, SYSTEM, None, None, details)
