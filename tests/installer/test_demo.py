"""The demo's files and banner: the settings file goes into place only when committed, the
tokens file is owner-only and loads into a shell, and the banner's commands are one shell line
each, whatever the paths hold."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from installer.demo import (
    CONFIG_NAME,
    DemoBanner,
    commit_demo_config,
    stage_demo_config,
    write_tokens_file,
)


def test_a_staged_settings_file_leaves_the_current_one_until_committed(tmp_path: Path) -> None:
    (tmp_path / CONFIG_NAME).write_text("the running demo's settings\n")
    staged = stage_demo_config(tmp_path, tmp_path / "model", device="cpu", port=9443)
    assert (tmp_path / CONFIG_NAME).read_text() == "the running demo's settings\n"
    assert staged.parent == tmp_path and "port = 9443" in staged.read_text()
    committed = commit_demo_config(staged)
    assert committed == tmp_path / CONFIG_NAME
    assert "port = 9443" in committed.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME]


def test_tokens_file_is_owner_only_replaced_whole_and_loads_into_a_shell(tmp_path: Path) -> None:
    write_tokens_file(tmp_path, {"user": "old.user", "admin": "old.admin"}, expires="then")
    path = write_tokens_file(tmp_path, {"user": "u.t.1", "admin": "a.t.2"}, expires="soon")
    assert path == tmp_path / "tokens.env"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.env"]
    script = f'. {shlex.quote(str(path))}; echo "$INFERNO_USER_TOKEN $INFERNO_ADMIN_TOKEN"'
    loaded = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    assert loaded.stdout == "u.t.1 a.t.2\n"


def _banner(tmp_path: Path) -> DemoBanner:
    odd = tmp_path / "it's a dir" / "with $HOME"
    return DemoBanner(
        model="SmolLM2-135M-Instruct",
        url="https://127.0.0.1:8443",
        cert_file=odd / "cert.pem",
        fingerprint="AB:CD",
        tokens_file=odd / "tokens.env",
        token_ttl_s=3600,
        python=str(odd / "python"),
    )


def test_banner_commands_stay_one_shell_line_with_odd_paths(tmp_path: Path) -> None:
    banner = _banner(tmp_path)
    curl = shlex.split(banner.curl_command())
    assert curl[:3] == ["curl", "--cacert", str(banner.cert_file)]
    assert curl[3] == "https://127.0.0.1:8443/v1/chat/completions"
    assert "Authorization: Bearer $INFERNO_USER_TOKEN" in curl  # expanded by the shell
    client = shlex.split(banner.openai_command())
    assert client[:3] == [f"SSL_CERT_FILE={banner.cert_file}", banner.python, "-c"]
    compile(client[3], "<banner>", "exec")
    assert 'os.environ["INFERNO_USER_TOKEN"]' in client[3]


def test_banner_is_short_and_names_the_tokens_file_not_tokens(tmp_path: Path) -> None:
    banner = _banner(tmp_path)
    lines = banner.text().splitlines()
    assert len(lines) <= 10
    assert any(str(banner.tokens_file) in line and "owner-only" in line for line in lines)
    assert lines[-2:] == [f"  {banner.curl_command()}", f"  {banner.openai_command()}"]
    assert "UNVERIFIED" in banner.text()
    assert any("/console/" in line and "inferno console-link" in line for line in lines)
