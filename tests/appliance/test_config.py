"""Settings: one TOML file plus INFERNO_ environment overrides, validated with errors that name
the setting; every setting documented in docs/CONFIG.md."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from appliance.auth.settings import IssuerSettings, RoleValues
from appliance.boot.audit_log import audit_log_settings
from appliance.boot.startup import engine_config
from appliance.config import (
    MAX_CONFIG_BYTES,
    Settings,
    TeeSettings,
    WitnessSettings,
    load_section,
    load_settings,
    setting_names,
)
from appliance.engine.engine_config import EngineConfig
from appliance.errors import ConfigError
from audit.cosignature import Cosigner
from audit.note import NoteSigner
from installer.demo import stage_demo_config

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "models" / "tiny"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    return directory


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inferno.toml"
    path.write_text(text)
    return path


AUDIT = '[audit]\norigin = "inferno.test/config"\ndata_dir = "audit"\n'
AUTH = '[auth]\nlocal_issuer = "demo"\nlocal_issuer_key_file = "auth/issuer.pem"\n'
DEVELOPMENT = '[appliance]\nprofile = "development"\n[tee]\nmode = "insecure-dev"\n'
REQUIRED = AUDIT + AUTH + DEVELOPMENT


def _insecure(model_dir: Path, extra: str = "") -> str:
    return f'{REQUIRED}[model]\ndir = "{model_dir}"\n[server]\ninsecure_http = true\n{extra}'


def test_file_values_are_read_and_the_rest_defaulted(tmp_path: Path, model_dir: Path) -> None:
    path = _write(tmp_path, _insecure(model_dir, "port = 9000\n[engine]\nmax_num_seqs = 8\n"))
    settings = load_settings(path, environ={})
    assert settings.server.port == 9000
    assert settings.engine.max_num_seqs == 8
    assert settings.engine.block_size == 16
    assert settings.served_model_name == "tiny"


def test_environment_overrides_the_file_with_typed_values(tmp_path: Path, model_dir: Path) -> None:
    path = _write(tmp_path, _insecure(model_dir, "port = 9000\n"))
    environ = {
        "INFERNO_SERVER_PORT": "9100",
        "INFERNO_ENGINE_ENABLE_PREFIX_CACHING": "false",
        "INFERNO_MODEL_NAME": "served-name",
        "INFERNO_COMMIT": "abc123",  # another tool's variable: left alone
    }
    settings = load_settings(path, environ=environ)
    assert settings.server.port == 9100
    assert settings.engine.enable_prefix_caching is False
    assert settings.served_model_name == "served-name"


def test_relative_paths_are_relative_to_the_file_or_to_the_current_directory(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(
        tmp_path,
        REQUIRED + '[model]\ndir = "models/tiny"\n[tls]\ncert_file = "tls/c.pem"\n'
        'key_file = "k.pem"\nself_signed = true\n',
    )
    monkeypatch.chdir(model_dir)
    settings = load_settings(path, environ={"INFERNO_TLS_KEY_FILE": "from-env.pem"})
    assert settings.model.dir == model_dir
    assert settings.tls.cert_file == tmp_path / "tls" / "c.pem"
    assert settings.tls.key_file == model_dir / "from-env.pem"
    assert settings.audit.data_dir == tmp_path / "audit"


def test_bad_value_names_the_setting_and_its_source_but_not_the_value(
    tmp_path: Path, model_dir: Path
) -> None:
    path = _write(tmp_path, _insecure(model_dir, "port = 70000\n"))
    with pytest.raises(ConfigError) as error:
        load_settings(path, environ={"INFERNO_ENGINE_MAX_NUM_SEQS": "many"})
    message = str(error.value)
    assert f"server.port: Input should be less than or equal to 65535 (in {path})" in message
    assert "engine.max_num_seqs: " in message
    assert "(from INFERNO_ENGINE_MAX_NUM_SEQS)" in message
    assert "many" not in message and "70000" not in message


def test_the_models_parsers_are_auto_by_default_and_an_unknown_one_is_named(
    tmp_path: Path, model_dir: Path
) -> None:
    path = _write(tmp_path, _insecure(model_dir))
    model = load_settings(path, environ={}).model
    assert (model.tool_parser, model.reasoning_parser) == ("auto", "auto")
    environ = {"INFERNO_MODEL_TOOL_PARSER": "granite", "INFERNO_MODEL_REASONING_PARSER": "qwen3"}
    model = load_settings(path, environ=environ).model
    assert (model.tool_parser, model.reasoning_parser) == ("granite", "qwen3")
    with pytest.raises(ConfigError) as error:
        load_settings(path, environ={"INFERNO_MODEL_TOOL_PARSER": "mistral"})
    assert "model.tool_parser: must be one of auto, none, hermes, llama3_json, granite, " in str(
        error.value
    )
    assert "(from INFERNO_MODEL_TOOL_PARSER)" in str(error.value)
    with pytest.raises(
        ConfigError, match=r"model\.reasoning_parser: must be one of auto, none, qwen3"
    ):
        load_settings(_write(tmp_path, _insecure(model_dir).replace(
            f'dir = "{model_dir}"\n', f'dir = "{model_dir}"\nreasoning_parser = "r1"\n'
        )), environ={})  # fmt: skip


def test_misspelt_setting_in_the_file_is_an_error(tmp_path: Path, model_dir: Path) -> None:
    path = _write(tmp_path, _insecure(model_dir, "prot = 9000\n"))
    with pytest.raises(ConfigError, match=r"server\.prot: not a setting"):
        load_settings(path, environ={})


def test_misspelt_setting_in_the_environment_is_an_error(tmp_path: Path, model_dir: Path) -> None:
    path = _write(tmp_path, _insecure(model_dir))
    with pytest.raises(ConfigError, match=r"INFERNO_SERVER_PROT: there is no setting server\.prot"):
        load_settings(path, environ={"INFERNO_SERVER_PROT": "1"})


def test_missing_model_directory_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, '[model]\ndir = "nowhere"\n[server]\ninsecure_http = true\n')
    with pytest.raises(ConfigError, match=r"model\.dir: .*nowhere is not a model directory"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match=r"model: required"):
        load_settings(_write(tmp_path, "[server]\ninsecure_http = true\n"), environ={})


def test_tls_is_required_unless_plain_http_is_asked_for(tmp_path: Path, model_dir: Path) -> None:
    path = _write(tmp_path, f'{REQUIRED}[model]\ndir = "{model_dir}"\n')
    with pytest.raises(ConfigError, match=r"TLS is always on: set tls\.cert_file"):
        load_settings(path, environ={})
    both = _write(tmp_path, _insecure(model_dir, '[tls]\ncert_file = "c.pem"\nkey_file = "k.pem"'))
    with pytest.raises(ConfigError, match=r"insecure_http = true .* remove one"):
        load_settings(both, environ={})


def test_operator_certificate_files_must_exist(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "c.pem").write_text("")
    path = _write(
        tmp_path,
        f'{REQUIRED}[model]\ndir = "{model_dir}"\n[tls]\ncert_file = "c.pem"\nkey_file = "k.pem"\n',
    )
    with pytest.raises(ConfigError, match=r"tls\.key_file = .*k\.pem does not exist"):
        load_settings(path, environ={})


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.toml", environ={})
    with pytest.raises(ConfigError, match=r"not valid TOML: .*line 1"):
        load_settings(_write(tmp_path, "[model\n"), environ={})


def test_audit_log_defaults_live_under_its_data_dir(tmp_path: Path, model_dir: Path) -> None:
    audit = load_settings(_write(tmp_path, _insecure(model_dir)), environ={}).audit
    assert audit.effective_database_url == f"sqlite:///{tmp_path / 'audit' / 'audit.db'}"
    assert audit.effective_key_dir == tmp_path / "audit" / "keys"
    assert (audit.checkpoint_every_entries, audit.checkpoint_every_s) == (1000, 10.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('origin = "my log"', r"audit\.origin: must be a name without spaces or '\+'"),
        ('database_url = "sqlite:///audit.db"', r"audit\.database_url: a SQLite path must be abs"),
        ('database_url = "sqlite://"', r"audit\.database_url: an in-memory SQLite database"),
        ('database_url = "mysql://u:hunter2@db/audit"', r"must be a sqlite:/// or postgresql://"),
        ("checkpoint_every_entries = 0", r"audit\.checkpoint_every_entries: "),
        ("checkpoint_every_s = 0", r"audit\.checkpoint_every_s: "),
    ],
)
def test_unusable_audit_settings_are_named(
    tmp_path: Path, model_dir: Path, line: str, message: str
) -> None:
    name = line.split(" = ")[0]
    kept = [kept for kept in _insecure(model_dir).splitlines() if not kept.startswith(name)]
    text = "\n".join(kept).replace("[audit]", f"[audit]\n{line}")
    with pytest.raises(ConfigError, match=message) as error:
        load_settings(_write(tmp_path, text), environ={})
    assert "hunter2" not in str(error.value)


def test_the_audit_log_must_be_configured(tmp_path: Path, model_dir: Path) -> None:
    text = f'[model]\ndir = "{model_dir}"\n[server]\ninsecure_http = true\n'
    with pytest.raises(ConfigError, match=r"audit: required"):
        load_settings(_write(tmp_path, text), environ={})


def test_every_setting_is_documented_and_every_documented_setting_exists() -> None:
    text = (REPO_ROOT / "docs" / "CONFIG.md").read_text()
    documented = re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", text, flags=re.MULTILINE)
    assert sorted(documented) == sorted(setting_names())


def test_every_issuer_setting_is_documented_and_every_documented_one_exists() -> None:
    text = (REPO_ROOT / "docs" / "CONFIG.md").read_text()
    documented = re.findall(r"^\| `auth\.issuers\[\]\.([a-z_.]+)` \|", text, flags=re.MULTILINE)
    expected = [
        f"roles.{role}" if name == "roles" else name
        for name in IssuerSettings.model_fields
        for role in (RoleValues.model_fields if name == "roles" else [None])
    ]
    assert sorted(documented) == sorted(expected)


def test_paths_inside_issuer_tables_are_relative_to_the_file(
    tmp_path: Path, model_dir: Path
) -> None:
    issuer = (
        '[[auth.issuers]]\nissuer = "https://idp.example.com"\naudience = "inferno"\n'
        'jwks_file = "keys/idp.json"\nrole_claims = ["roles"]\nroles = { user = ["u"] }\n'
    )
    text = AUDIT + DEVELOPMENT + _insecure(model_dir).removeprefix(REQUIRED) + issuer
    path = _write(tmp_path, text)
    [loaded] = load_settings(path, environ={}).auth.issuers
    assert loaded.jwks_file == tmp_path / "keys" / "idp.json"


def test_auth_is_required_and_its_errors_name_the_setting(tmp_path: Path, model_dir: Path) -> None:
    without_auth = AUDIT + _insecure(model_dir).removeprefix(REQUIRED)
    with pytest.raises(ConfigError, match=r"auth: required"):
        load_settings(_write(tmp_path, without_auth), environ={})
    issuer = (
        '[[auth.issuers]]\nissuer = "https://idp.example.com"\naudience = "inferno"\n'
        'algorithms = ["HS256"]\nrole_claims = ["roles"]\nroles = { user = ["u"] }\n'
    )
    with pytest.raises(ConfigError, match=r"auth\.issuers\.0\.algorithms: 'HS256' is not allowed"):
        load_settings(_write(tmp_path, without_auth + issuer), environ={})
    with pytest.raises(ConfigError, match=r"auth: .*refused where identity providers are"):
        load_settings(
            _write(tmp_path, _insecure(model_dir) + issuer.replace("HS256", "RS256")),
            environ={"INFERNO_AUTH_JWKS_CACHE_DIR": "jwks"},
        )


def test_default_engine_settings_are_the_engines_own_defaults(model_dir: Path) -> None:
    settings = Settings.model_validate(
        {
            "model": {"dir": str(model_dir)},
            "server": {"insecure_http": True},
            "audit": {"origin": "inferno.test/config", "data_dir": "audit"},
            "auth": {"local_issuer": "demo", "local_issuer_key_file": "k.pem"},
            "appliance": {"profile": "development"},
            "tee": {"mode": "insecure-dev"},
        }
    )
    engine = settings.engine.model_dump()
    config = EngineConfig(model_dir=model_dir, **engine)
    assert config == EngineConfig(model_dir=model_dir)


def test_demo_config_serves_tls_with_a_self_signed_pair_on_8443(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    path = stage_demo_config(tmp_path / "demo", smollm2_dir, device="cpu", port=8443)
    settings = load_settings(path, environ={})
    assert settings.model.dir == smollm2_dir.resolve()
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8443)
    assert settings.tls.self_signed
    assert settings.tls.cert_file == tmp_path / "demo" / "tls" / "cert.pem"
    assert engine_config(settings).device == "cpu"
    assert os.path.isabs(settings.tls.key_file)
    # No identity provider: the demo's own issuer, its key kept beside the settings.
    assert (settings.auth.issuers, settings.auth.local_issuer) == ((), "demo")
    assert settings.auth.local_issuer_key_file == tmp_path / "demo" / "auth" / "local-issuer.pem"


def test_a_config_file_100000_levels_deep_or_over_its_size_limit_is_a_config_error(
    tmp_path: Path,
) -> None:
    """Issue 13, defect 2: tomllib recurses; the file is checked before it parses."""
    path = _write(tmp_path, REQUIRED + "[server]\nx = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=f"config file {path} nests .* deeper than 64 levels"):
        load_settings(path, environ={})
    path = _write(tmp_path, REQUIRED + "#\n" * (MAX_CONFIG_BYTES // 2))
    with pytest.raises(ConfigError, match="over the limit of 1048576 bytes"):
        load_settings(path, environ={})


def test_load_section_validates_one_section_alone_with_its_overrides(tmp_path: Path) -> None:
    """`inferno trust update` reads [tee] before the model directory and TLS files exist."""
    tee_table = '[tee]\npolicy_file = "p.toml"\ntrust_dir = "trust"\n'
    path = _write(tmp_path, f'[model]\ndir = "absent"\n{tee_table}trust_release_key = "k.pub"\n')
    tee = load_section(path, TeeSettings, {"INFERNO_TEE_REATTEST_INTERVAL_S": "60"})
    assert (tee.trust_dir, tee.reattest_interval_s) == (tmp_path / "trust", 60.0)
    with pytest.raises(ConfigError, match=r"model.dir: .*absent is not a model directory"):
        load_settings(path)
    bad = _write(tmp_path, tee_table)
    refused = r"^invalid settings: tee: tee.trust_dir needs tee.trust_release_key.* \(in .*\)$"
    with pytest.raises(ConfigError, match=refused):
        load_section(bad, TeeSettings, {})


def test_every_witness_setting_is_documented_and_every_documented_one_exists() -> None:
    text = (REPO_ROOT / "docs" / "CONFIG.md").read_text()
    documented = re.findall(r"^\| `audit\.witnesses\[\]\.([a-z_]+)` \|", text, flags=re.MULTILINE)
    assert sorted(documented) == sorted(WitnessSettings.model_fields)


def test_witnesses_are_read_into_the_audit_logs_endpoints_and_bad_ones_refused(
    tmp_path: Path, model_dir: Path
) -> None:
    vkey = str(Cosigner.generate("witness.example/w1").verifier)
    witness = f'[[audit.witnesses]]\nurl = "http://10.0.0.7:8123"\nvkey = "{vkey}"\n'
    audit = load_settings(_write(tmp_path, _insecure(model_dir) + witness), environ={}).audit
    [endpoint] = audit_log_settings(audit).witnesses
    assert (endpoint.url, str(endpoint.vkey)) == ("http://10.0.0.7:8123", vkey)
    log_vkey = str(NoteSigner.generate("witness.example/w1").verifier)
    for bad, message in [
        (witness.replace(vkey, log_vkey), r"audit\.witnesses\.0\.vkey: is not a witness vkey"),
        (witness.replace("http://", "http://user:pw@"), r"audit\.witnesses\.0\.url: must hold no"),
        (witness.replace("http://", "ftp://"), r"audit\.witnesses\.0\.url: must be an http"),
        (witness + witness, r"audit\.witnesses: a witness key is listed twice"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(_write(tmp_path, _insecure(model_dir) + bad), environ={})
