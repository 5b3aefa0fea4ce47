"""The appliance's settings: one TOML file plus `INFERNO_<SECTION>_<NAME>` environment overrides.

`load_settings` reads them once at start, validates everything before anything starts, and
returns a frozen `Settings`; each component receives the section it needs. Errors name the
setting (`server.port`) and where its value came from. Every setting is documented in
docs/CONFIG.md (a test checks that the two agree).

Relative paths in the file are relative to the file's directory; in an environment override,
to the current directory.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from appliance.api.chat_conventions import reasoning_parser_names, tool_parser_names
from appliance.auth.roles import Role
from appliance.auth.settings import AuthSettings
from appliance.engine.engine_settings import EngineSettings
from appliance.errors import ConfigError
from appliance.logs import LogFormat
from attestation.input_limits import parse_toml, read_file
from audit.cosignature import CosignerKey
from audit.errors import AuditError
from audit.witness_client import WitnessEndpoint

MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few KiB
ENV_PREFIX = "INFERNO_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Section):
    dir: Path = Field(description="model directory: config.json, safetensors, tokenizer")
    name: str | None = Field(
        default=None,
        min_length=1,
        description="the model id clients name in requests; default: the directory's name",
    )
    tool_parser: str = Field(
        default="auto",
        description="the format of the model's tool calls: auto (from its chat template and "
        "architecture), none, or a format",
    )
    reasoning_parser: str = Field(
        default="auto",
        description="the format of the model's reasoning: auto (from its chat template), none, "
        "or a format",
    )

    @field_validator("tool_parser")
    @classmethod
    def _check_tool_parser(cls, value: str) -> str:
        return _one_of(value, tool_parser_names())

    @field_validator("reasoning_parser")
    @classmethod
    def _check_reasoning_parser(cls, value: str) -> str:
        return _one_of(value, reasoning_parser_names())

    @field_validator("dir")
    @classmethod
    def _check_dir(cls, value: Path) -> Path:
        if not (value / "config.json").is_file():
            raise ValueError(
                f"{value} is not a model directory (no config.json); convert a GGUF with "
                "`inferno model import-gguf` or point it at a converted model"
            )
        return value


def _one_of(value: str, names: tuple[str, ...]) -> str:
    if value not in names:
        raise ValueError(f"must be one of {', '.join(names)}")
    return value


class ServerSettings(_Section):
    host: str = Field(default="127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(default=8443, ge=0, le=65535, description="TCP port; 0 picks a free one")
    insecure_http: bool = Field(
        default=False, description="serve plain HTTP without TLS (development only)"
    )
    max_request_body_bytes: int = Field(
        default=4 << 20, ge=1024, description="larger request bodies get 413"
    )
    max_concurrent_requests: int = Field(
        default=256,
        ge=1,
        description="sequences admitted at once (a request with n choices counts n); more: 429",
    )
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After of a 429 response")
    drain_timeout_s: float = Field(
        default=30.0, ge=0.0, description="on SIGTERM, how long in-flight requests may finish"
    )


PerRole = dict[Role, Annotated[int, Field(ge=1)]]


class LimitsSettings(_Section):
    """Per-caller limits (appliance.api.limits); unset is no limit. They apply beside
    `server.max_concurrent_requests`, which bounds all callers together."""

    subject_max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="inference requests in flight per subject"
    )
    subject_requests_per_minute: int | None = Field(
        default=None, ge=1, description="inference requests per subject in any 60 s"
    )
    subject_tokens_per_minute: int | None = Field(
        default=None, ge=1, description="prompt plus completion tokens per subject in any 60 s"
    )
    role_max_concurrent_requests: PerRole = Field(
        default_factory=dict, description="inference requests in flight of all callers of a role"
    )
    role_requests_per_minute: PerRole = Field(
        default_factory=dict, description="inference requests of all callers of a role in any 60 s"
    )
    role_tokens_per_minute: PerRole = Field(
        default_factory=dict, description="tokens of all callers of a role in any 60 s"
    )
    attestation_requests_per_minute: int | None = Field(
        default=60, ge=1, description="/v1/attestation requests per source address in any 60 s"
    )


class TlsSettings(_Section):
    cert_file: Path | None = Field(default=None, description="PEM certificate chain")
    key_file: Path | None = Field(default=None, description="PEM private key")
    self_signed: bool = Field(
        default=False,
        description="make a self-signed certificate at cert_file/key_file if they do not exist",
    )


class WitnessSettings(_Section):
    """One witness that cosigns the log's checkpoints (one `[[audit.witnesses]]` table)."""

    url: str = Field(description="the witness's submission prefix: http(s)://HOST:PORT[/PATH]")
    vkey: str = Field(description="the witness's verifier key (type 0x04), pinned out of band")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL naming a host")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError("must hold no user, password, query or fragment")
        return value

    @field_validator("vkey")
    @classmethod
    def _check_vkey(cls, value: str) -> str:
        try:
            CosignerKey.parse(value)
        except AuditError as exc:
            raise ValueError(f"is not a witness vkey: {exc}") from None
        return value

    @property
    def endpoint(self) -> WitnessEndpoint:
        return WitnessEndpoint(self.url, CosignerKey.parse(self.vkey))


class AuditSettings(_Section):
    """The audit log (docs/AUDIT.md): where it lives, when it signs checkpoints, who cosigns."""

    origin: str = Field(
        description="the log's name in every checkpoint and in its vkey; unique per appliance"
    )
    data_dir: Path = Field(description="the SQLite database (audit.db) and, by default, the keys")
    database_url: str | None = Field(
        default=None,
        description="sqlite:////ABSOLUTE/PATH or postgresql+psycopg://...; default: "
        "SQLite at data_dir/audit.db",
    )
    key_dir: Path | None = Field(
        default=None, description="signing key, signer state, commitment key; default data_dir/keys"
    )
    commitment_key_file: Path | None = Field(
        default=None,
        description="an existing HMAC key for prompt and response commitments, shared by the "
        "appliances of one deployment; default: key_dir/commitment.key, made at first start",
    )
    checkpoint_every_entries: int = Field(
        default=1000, ge=1, description="sign a checkpoint once this many entries wait for one"
    )
    checkpoint_every_s: float = Field(
        default=10.0, gt=0.0, description="sign a checkpoint once an entry has waited this long"
    )
    heartbeat_s: float = Field(
        default=3600.0, gt=0.0, description="an idle log appends and signs a heartbeat this often"
    )
    witnesses: tuple[WitnessSettings, ...] = Field(
        default=(), description="witnesses each checkpoint is sent to ([[audit.witnesses]])"
    )
    witness_timeout_s: float = Field(
        default=5.0, gt=0.0, le=60.0, description="how long one witness may take to answer"
    )

    @field_validator("witnesses")
    @classmethod
    def _check_witnesses(cls, value: tuple[WitnessSettings, ...]) -> tuple[WitnessSettings, ...]:
        if len({w.endpoint.vkey for w in value}) != len(value):
            raise ValueError("a witness key is listed twice")
        return value

    @field_validator("origin")
    @classmethod
    def _check_origin(cls, value: str) -> str:
        if not value or "+" in value or any(c.isspace() for c in value):
            raise ValueError(
                "must be a name without spaces or '+', unique to this appliance, such as "
                "inferno.example.com/audit (c2sp.org/tlog-checkpoint origin)"
            )
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            url = make_url(value)
        except ArgumentError:
            raise ValueError("is not a database URL") from None
        if url.get_backend_name() == "postgresql":
            try:
                url.get_dialect().import_dbapi()
            except ImportError:
                raise ValueError(
                    f"the {url.get_driver_name()} driver for PostgreSQL is not installed: use "
                    "postgresql+psycopg:// with `pip install inferno[postgresql]`"
                ) from None
            return value
        if url.get_backend_name() != "sqlite":
            raise ValueError("must be a sqlite:/// or postgresql:// URL")
        if not url.database or url.database == ":memory:" or url.database.startswith("file:"):
            raise ValueError("an in-memory SQLite database would lose the log; give a file path")
        if not Path(url.database).is_absolute():
            raise ValueError(
                "a SQLite path must be absolute (sqlite:////var/lib/inferno/audit.db), or leave "
                "the setting out for data_dir/audit.db"
            )
        return value

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'audit.db'}"

    @property
    def effective_key_dir(self) -> Path:
        return self.key_dir or self.data_dir / "keys"

    @property
    def redacted_database_url(self) -> str:
        """The effective URL with its password hidden, for messages and the config digest."""
        return make_url(self.effective_database_url).render_as_string(hide_password=True)


Profile = Literal["production", "development"]
TeeMode = Literal["required", "insecure-dev"]


class ApplianceSettings(_Section):
    profile: Profile = Field(
        default="production",
        description="production refuses every insecure setting; development (the demo, tests) "
        "allows them, visibly",
    )


# What a trust bundle carries, so what tee.trust_dir replaces.
TRUST_BUNDLE_PARTS = ("gpu_rims_dir", "gpu_revocation_dir", "cpu_trust_dir")


class TeeSettings(_Section):
    """The TEE gate (docs/ATTESTATION.md): what must be proven, against which policy and pinned
    roots, before a key is released or a weight loaded."""

    mode: TeeMode = Field(
        default="required",
        description="required: no key, no weights, no inference without a passing verdict; "
        "insecure-dev: attestation skipped, every response says UNVERIFIED",
    )
    policy_file: Path | None = Field(
        default=None, description="the attestation policy (TOML: [gpu], [snp], [tdx])"
    )
    gpu_rims_dir: Path | None = Field(
        default=None, description="NVIDIA reference manifests (RIMs) for the driver and VBIOS"
    )
    gpu_roots_dir: Path | None = Field(
        default=None, description="pinned GPU roots; default: the NVIDIA roots shipped inside"
    )
    gpu_revocation_dir: Path | None = Field(
        default=None, description="OCSP responses / CRLs for the GPU certificates"
    )
    cpu_trust_dir: Path | None = Field(
        default=None,
        description="CPU roots pinned beside AMD's and Intel's, and offline collateral: "
        "snp/ark-*.pem, snp/certificates/, tdx/root_ca.pem, tdx/collateral/*.json",
    )
    trust_dir: Path | None = Field(
        default=None,
        description="the trust store `inferno trust update` fills: the RIMs, revocation data "
        "and CPU collateral are taken from its current signed trust bundle",
    )
    trust_release_key: Path | None = Field(
        default=None,
        description="the release public key (release-key.pub) trust bundles must verify under",
    )
    tsm_report_dir: Path = Field(
        default=Path("/sys/kernel/config/tsm/report"),
        description="configfs-tsm report directory of the confidential VM",
    )
    reattest_interval_s: float = Field(
        default=3600.0, gt=0.0, description="re-attest this often; a failure stops inference"
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.trust_dir is not None:
            both = [f"tee.{name}" for name in TRUST_BUNDLE_PARTS if getattr(self, name) is not None]
            if both:
                raise ValueError(
                    f"tee.trust_dir and {', '.join(both)} are both set: with a trust store the "
                    "RIMs, revocation data and CPU collateral come from its trust bundle; "
                    "remove one of the two"
                )
            if self.trust_release_key is None:
                raise ValueError(
                    "tee.trust_dir needs tee.trust_release_key, the release public key its "
                    "bundles are verified under"
                )
        if self.mode != "required":
            return self
        missing = [] if self.policy_file is not None else ["policy_file"]
        if self.gpu_rims_dir is None and self.trust_dir is None:
            missing.append("gpu_rims_dir")
        if missing:
            raise ValueError(
                f'mode "required" needs {", ".join(missing)}: without the policy and the GPU '
                "reference manifests (tee.gpu_rims_dir, or a trust bundle in tee.trust_dir) "
                'nothing can pass (mode = "insecure-dev" is for development)'
            )
        return self


class SealedSettings(_Section):
    """A sealed model (docs/ATTESTATION.md): `model.dir` holds a signed manifest and encrypted
    weights, whose data key the key provider releases only to a passing verdict."""

    manifest_public_key_file: Path | None = Field(
        default=None,
        description="Ed25519 key (PEM) the model's manifest must verify under; set: model.dir "
        "is a sealed model",
    )
    key_provider: Literal["file", "pkcs11"] | None = Field(
        default=None, description="who releases the data key: file (development) or pkcs11"
    )
    file_key_dir: Path | None = Field(
        default=None, description="file provider: directory of <key_id>.kek files"
    )
    hsm_module: Path | None = Field(
        default=None, description="pkcs11 provider: the HSM vendor's PKCS#11 module (.so)"
    )
    hsm_token_label: str | None = Field(
        default=None, min_length=1, description="pkcs11 provider: the token's label"
    )
    hsm_pin_file: Path | None = Field(
        default=None, description="pkcs11 provider: file holding the user PIN (mode 0600)"
    )
    decrypt_workers: int | None = Field(
        default=None, ge=1, le=256, description="decryption threads; default one per CPU, ≤ 16"
    )

    @property
    def enabled(self) -> bool:
        return self.manifest_public_key_file is not None

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.enabled:
            return self
        needed = {
            None: ("key_provider",),
            "file": ("file_key_dir",),
            "pkcs11": ("hsm_module", "hsm_token_label", "hsm_pin_file"),
        }[self.key_provider]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a sealed model needs {', '.join(missing)}")
        return self


class LogSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="WARNING", description="log level; prompts and completions are never logged"
    )
    format: LogFormat = Field(
        default="text", description="text for people, json for log shippers (one object a line)"
    )
    access: bool = Field(
        default=True, description="log one line per request: method, route, status, latency, who"
    )


class Settings(_Section):
    model: ModelSettings
    engine: EngineSettings = EngineSettings()
    server: ServerSettings = ServerSettings()
    limits: LimitsSettings = LimitsSettings()
    tls: TlsSettings = TlsSettings()
    audit: AuditSettings
    auth: AuthSettings
    log: LogSettings = LogSettings()
    appliance: ApplianceSettings = ApplianceSettings()
    # Validated when absent too: the default mode is "required", which needs a policy file, so
    # a config that says nothing about the TEE is refused rather than run unattested.
    tee: TeeSettings = Field(default={}, validate_default=True)  # type: ignore[assignment]
    sealed: SealedSettings = SealedSettings()

    @property
    def served_model_name(self) -> str:
        return self.model.name or self.model.dir.name

    @model_validator(mode="after")
    def _check_sealed(self) -> Self:
        if self.sealed.enabled and self.tee.mode != "required":
            raise ValueError(
                'a sealed model needs tee.mode = "required": its key is released only to a '
                "passing attestation verdict, which insecure-dev never has"
            )
        return self

    @model_validator(mode="after")
    def _check_production(self) -> Self:
        """ARCHITECTURE.md start-up step 1: a production profile refuses every setting that
        weakens the appliance. Each is named, with the way out, in one message."""
        if self.appliance.profile != "production":
            return self
        refused = []
        if self.tee.mode != "required":
            refused.append(f'tee.mode = "{self.tee.mode}" (production needs "required")')
        if self.server.insecure_http:
            refused.append("server.insecure_http = true (production serves TLS only)")
        if self.sealed.enabled and self.sealed.key_provider == "file":
            refused.append(
                'sealed.key_provider = "file" (whoever reads its key file unseals the model; '
                'use "pkcs11")'
            )
        if self.auth.local_issuer == "demo":
            refused.append(
                'auth.local_issuer = "demo" (configure [[auth.issuers]]; "break-glass" '
                "is the explicit emergency exception)"
            )
        if refused:
            raise ValueError(
                'appliance.profile = "production" refuses '
                + "; ".join(refused)
                + '. For a demo or development set appliance.profile = "development"'
            )
        return self

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        tls, files = self.tls, (self.tls.cert_file, self.tls.key_file)
        if self.server.insecure_http:
            if any(files) or tls.self_signed:
                raise ValueError(
                    "server.insecure_http = true serves plain HTTP, yet a tls setting is given; "
                    "remove one of the two"
                )
            return self
        if not all(files):
            raise ValueError(
                "TLS is always on: set tls.cert_file and tls.key_file (tls.self_signed = true "
                "makes them), or set server.insecure_http = true for plain HTTP in development"
            )
        if not tls.self_signed:
            for name, path in (("tls.cert_file", tls.cert_file), ("tls.key_file", tls.key_file)):
                if not path.is_file():  # type: ignore[union-attr]
                    raise ValueError(f"{name} = {path} does not exist")
        return self


SECTIONS: dict[str, type[BaseModel]] = {
    name: typing.cast(type[BaseModel], field.annotation)
    for name, field in Settings.model_fields.items()
}


def setting_names() -> list[str]:
    """Every setting as `section.name`, in declaration order."""
    return [
        f"{section}.{name}" for section, model in SECTIONS.items() for name in model.model_fields
    ]


SectionT = typing.TypeVar("SectionT", bound=BaseModel)


def load_settings(path: Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read `path` (TOML, within MAX_CONFIG_BYTES and attestation.input_limits'
    MAX_NESTING_DEPTH), apply `INFERNO_<SECTION>_<NAME>` overrides from `environ` (default: the
    process environment) and validate. Raises `ConfigError` naming the setting at fault."""
    path = Path(path)
    return settings_from_mapping(
        _read_config(path),
        base_dir=path.parent,
        source=str(path),
        environ=os.environ if environ is None else environ,
    )


def load_section(
    path: Path, section: type[SectionT], environ: Mapping[str, str] | None = None
) -> SectionT:
    """One section of the settings file at `path`, read and overridden as `load_settings` does,
    validated alone: for commands that need only it (`inferno trust update` runs before the
    model, TLS and identity provider the whole file names exist). Raises `ConfigError`."""
    path = Path(path)
    [name] = [name for name, model in SECTIONS.items() if model is section]
    merged, from_env = _merged(
        _read_config(path), path.parent, os.environ if environ is None else environ
    )
    try:
        return section.model_validate(merged.get(name, {}))
    except ValidationError as exc:
        env_names = {key: env_name for key, (env_name, _) in from_env.items()}
        raise ConfigError(_describe(exc, str(path), env_names, prefix=(name,))) from None


def _read_config(path: Path) -> Any:
    data = read_file(path, what="config file", error=ConfigError, max_bytes=MAX_CONFIG_BYTES)
    return parse_toml(
        data, what=f"config file {path}", error=ConfigError, max_bytes=MAX_CONFIG_BYTES
    )


def settings_from_mapping(
    raw: Mapping[str, Any],
    *,
    base_dir: Path,
    source: str = "the settings",
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Validate settings given as nested mappings (a parsed TOML file), plus `environ` overrides."""
    merged, from_env = _merged(raw, base_dir, environ or {})
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        env_names = {key: env_name for key, (env_name, _) in from_env.items()}
        raise ConfigError(_describe(exc, source, env_names)) from None


def _merged(
    raw: Mapping[str, Any], base_dir: Path, environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[tuple[str, str], tuple[str, str]]]:
    """The sections of `raw` with their paths resolved and `environ`'s overrides applied, and
    those overrides."""
    merged: dict[str, Any] = {}
    for section, values in raw.items():
        if section in SECTIONS and isinstance(values, Mapping):
            merged[section] = _resolve_paths(section, dict(values), base_dir)
        else:
            merged[section] = values
    from_env = _environment_overrides(environ)
    for (section, name), (_, value) in from_env.items():
        target = merged.setdefault(section, {})
        if isinstance(target, dict):  # otherwise the validation reports the malformed section
            target.update(_resolve_paths(section, {name: value}, Path.cwd()))
    return merged, from_env


def _environment_overrides(environ: Mapping[str, str]) -> dict[tuple[str, str], tuple[str, str]]:
    """`INFERNO_SERVER_PORT=9000` → {("server", "port"): ("INFERNO_SERVER_PORT", "9000")}.

    Variables that start with a section's prefix must name a setting (a typo is an error, not
    silently ignored); other `INFERNO_` variables belong to other tools and are left alone.
    """
    overrides = {}
    for env_name, value in environ.items():
        if not env_name.startswith(ENV_PREFIX):
            continue
        rest = env_name[len(ENV_PREFIX) :].lower()
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue
        name = rest[len(section) + 1 :]
        if name not in SECTIONS[section].model_fields:
            known = ", ".join(SECTIONS[section].model_fields)
            raise ConfigError(f"{env_name}: there is no setting {section}.{name} (known: {known})")
        overrides[(section, name)] = (env_name, value)
    return overrides


def _is_path(annotation: object) -> bool:
    if isinstance(annotation, types.UnionType):
        return Path in typing.get_args(annotation)
    return annotation is Path


def _item_model(annotation: object) -> type[BaseModel] | None:
    """The model of a `tuple[Model, ...]` field (a TOML array of tables), else None."""
    if typing.get_origin(annotation) is not tuple:
        return None
    item = typing.get_args(annotation)[0]
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


def _resolve_paths(section: str, values: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    return _resolve_model_paths(SECTIONS[section], values, base_dir)


def _resolve_model_paths(
    model: type[BaseModel], values: dict[str, Any], base_dir: Path
) -> dict[str, Any]:
    """`values` with its path settings made relative to `base_dir`, in nested tables too."""
    resolved = {}
    for name, value in values.items():
        field = model.model_fields.get(name)
        item_model = _item_model(field.annotation) if field is not None else None
        if field is not None and isinstance(value, str) and value and _is_path(field.annotation):
            value = base_dir / Path(value).expanduser()
        elif item_model is not None and isinstance(value, list):
            value = [
                _resolve_model_paths(item_model, dict(item), base_dir)
                if isinstance(item, Mapping)
                else item
                for item in value
            ]
        resolved[name] = value
    return resolved


def _describe(
    exc: ValidationError,
    source: str,
    env_names: dict[tuple[str, str], str],
    prefix: tuple[str, ...] = (),
) -> str:
    """One line per problem, naming the setting (under `prefix`, the section of a section
    validated alone) and where its value came from; never quotes the value itself (a future
    setting may be a secret)."""
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = prefix + tuple(str(part) for part in error["loc"])
        setting = ".".join(loc) or "settings"
        if error["type"] == "extra_forbidden":
            message = "not a setting (check the spelling; docs/CONFIG.md lists them)"
        elif error["type"] == "missing":
            message = "required"
        else:
            message = error["msg"].removeprefix("Value error, ")
        origin = env_names.get(loc[:2]) if len(loc) >= 2 else None
        where = f"from {origin}" if origin else f"in {source}"
        if setting == "settings":
            lines.append(f"{message} ({where})")
        else:
            lines.append(f"{setting}: {message} ({where})")
    return "invalid settings: " + "; ".join(lines)
