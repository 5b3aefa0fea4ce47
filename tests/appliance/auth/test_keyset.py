"""JWK Sets and identity-provider documents read from outside (a pinned file, an IdP's answer,
the cache on disk) within a size and a nesting limit (issue 13, defect 2): 100,000 nested
brackets are a format error, never a RecursionError."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from appliance.auth.errors import AuthConfigError
from appliance.auth.idp_http import MAX_DOCUMENT_BYTES, IdpHttp, IdpUnreachableError
from appliance.auth.key_cache import CachePolicy, FetchedKeys, PinnedKeys
from appliance.auth.keyset import MAX_JWKS_BYTES, JwksFormatError, KeySet
from appliance.json_limits import MAX_NESTING_DEPTH

DEEP = 100_000
DEEP_JWKS = '{"keys": ' + "[" * DEEP + "]" * DEEP + "}"


def test_a_jwk_set_100000_levels_deep_is_a_format_error() -> None:
    with pytest.raises(JwksFormatError, match=f"deeper than {MAX_NESTING_DEPTH} levels"):
        KeySet.parse(DEEP_JWKS)


def test_a_jwk_set_over_its_size_limit_is_a_format_error() -> None:
    padded = json.dumps({"keys": [], "padding": "x" * MAX_JWKS_BYTES})
    with pytest.raises(JwksFormatError, match=f"over the limit of {MAX_JWKS_BYTES} bytes"):
        KeySet.parse(padded.encode())


def test_a_pinned_jwk_set_file_100000_levels_deep_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "jwks.json"
    path.write_text(DEEP_JWKS)
    with pytest.raises(AuthConfigError, match="unusable: the JWK Set nests"):
        PinnedKeys.load(path)


def _get_json(body: bytes) -> object:
    async def fetch() -> object:
        http = IdpHttp(httpx.create_ssl_context(), 2.0)
        http._client = httpx.AsyncClient(
            transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        )
        try:
            return await http.get_json("https://idp.example/.well-known/openid-configuration")
        finally:
            await http.aclose()

    return asyncio.run(fetch())


def test_an_idp_document_100000_levels_deep_is_an_unreachable_idp() -> None:
    with pytest.raises(IdpUnreachableError, match="openid-configuration nests JSON arrays"):
        _get_json(DEEP_JWKS.encode())


def test_an_idp_document_over_its_size_limit_is_an_unreachable_idp() -> None:
    with pytest.raises(IdpUnreachableError, match="over 1 MiB"):
        _get_json(b" " * (MAX_DOCUMENT_BYTES + 1))


def test_an_idp_document_that_is_not_json_is_an_unreachable_idp() -> None:
    with pytest.raises(IdpUnreachableError, match="is not JSON"):
        _get_json(b"<html>")


@pytest.mark.parametrize(
    "content", [DEEP_JWKS, '{"issuer": "x", "jwks": ' + "[" * DEEP + "]" * DEEP + "}", "[1]"]
)
def test_a_cached_jwk_set_file_that_is_deep_or_malformed_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    cache_file = tmp_path / "jwks.json"
    cache_file.write_text(content)
    keys = FetchedKeys(
        "x", "https://idp.example/", IdpHttp(httpx.create_ssl_context(), 2.0), cache_file,
        CachePolicy(300.0, 10.0, 3600.0), lambda: 0.0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        keys.load_cached()
    assert "ignoring the cached keys" in caplog.text
