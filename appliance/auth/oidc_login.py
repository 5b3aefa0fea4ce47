"""Console login: the OpenID Connect authorization code flow with PKCE (RFC 7636, S256) through
authlib, against the issuer whose `console_client_id` is set, and RP-initiated logout (OpenID
Connect RP-Initiated Logout 1.0).

A login in progress is held on the server, named by a random id in a short-lived cookie
(`__Host-inferno_login`), so the callback is accepted only in the browser that started it.

authlib, and httpx with it, are imported by the first login, not with the server (as in
appliance.auth.idp_http): a login is rare, and a start does not wait for them (W5 in
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

import jwt

from appliance.auth.authenticator import Authenticator
from appliance.auth.discovery import DiscoveryError, ProviderMetadata
from appliance.auth.errors import AuthConfigError, AuthenticationError, AuthError, LoginError
from appliance.auth.idp_http import IdpHttp, IdpUnreachableError
from appliance.auth.key_cache import Clock, KeySource
from appliance.auth.principal import Principal
from appliance.auth.settings import AuthSettings, IssuerSettings

if TYPE_CHECKING:
    from authlib.integrations.httpx_client import AsyncOAuth2Client

LOGIN_COOKIE = "__Host-inferno_login"
PENDING_TTL_S = 600
MAX_PENDING = 10_000
_ERROR_CODE = re.compile(r"[a-z_]{1,64}")


@dataclass(frozen=True, slots=True)
class PendingLogin:
    state: str
    nonce: str
    code_verifier: str
    created_at: float


@dataclass(frozen=True, slots=True)
class CompletedLogin:
    principal: Principal
    id_token: str


class ConsoleLogin:
    def __init__(
        self,
        issuer: IssuerSettings,
        client_secret: str,
        http: IdpHttp,
        authenticator: Authenticator,
        leeway_s: int,
        clock: Clock,
    ) -> None:
        assert issuer.console_client_id is not None and issuer.console_redirect_uri is not None
        self.issuer = issuer
        self.client_id = issuer.console_client_id
        self.redirect_uri = issuer.console_redirect_uri
        self._client_secret = client_secret
        self._http = http
        self._authenticator = authenticator
        self._keys: KeySource = authenticator.verifiers[issuer.issuer].keys
        self._leeway_s = leeway_s
        self._clock = clock
        self._pending: OrderedDict[str, PendingLogin] = OrderedDict()
        self._metadata: ProviderMetadata | None = None

    @classmethod
    def from_settings(
        cls, settings: AuthSettings, http: IdpHttp, authenticator: Authenticator, clock: Clock
    ) -> ConsoleLogin | None:
        """The console login of the issuer configured for it, or None if none is. Reads the
        client secret file (raises `AuthConfigError`)."""
        issuer = next((i for i in settings.issuers if i.console_client_id is not None), None)
        if issuer is None:
            return None
        secret = _read_secret(issuer.console_client_secret_file)
        return cls(issuer, secret, http, authenticator, settings.leeway_s, clock)

    async def begin(self) -> tuple[str, str]:
        """Start a login: (the IdP authorization URL to redirect to, the pending login's id
        for the login cookie)."""
        metadata = await self._provider()
        if metadata.authorization_endpoint is None:
            raise LoginError("the identity provider publishes no authorization_endpoint")
        pending = PendingLogin(
            state=secrets.token_urlsafe(32),
            nonce=secrets.token_urlsafe(32),
            code_verifier=secrets.token_urlsafe(64),
            created_at=self._clock(),
        )
        async with self._oauth_client() as client:
            url, _ = client.create_authorization_url(
                metadata.authorization_endpoint,
                state=pending.state,
                code_verifier=pending.code_verifier,
                nonce=pending.nonce,
            )
        pending_id = secrets.token_urlsafe(32)
        self._pending[pending_id] = pending
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        return url, pending_id

    async def complete(self, pending_id: str | None, params: Mapping[str, str]) -> CompletedLogin:
        """Finish the login the IdP redirected back with `params`. Raises `LoginError`.

        1. The pending login of this browser exists, is recent, and its state is the callback's.
        2. The callback's `iss` (RFC 9207), when given, is this issuer's (mix-up defence).
        3. The code is exchanged, with the PKCE code_verifier.
        4. The ID token verifies: this issuer's keys, `iss`, `aud` = our client, the nonce.
        5. The access token is authenticated as any API token is: the session gets its roles.
        """
        # Step 1.
        pending = self._pending.pop(pending_id, None) if pending_id else None
        if pending is None or self._clock() - pending.created_at > PENDING_TTL_S:
            raise LoginError("no login in progress in this browser (or it took too long)")
        if not hmac.compare_digest(params.get("state", ""), pending.state):
            raise LoginError("the callback's state is not this login's")
        if "error" in params:
            code = params["error"] if _ERROR_CODE.fullmatch(params["error"]) else "unknown"
            raise LoginError(f"the identity provider refused the login ({code})")
        metadata = await self._provider()
        # Step 2.
        if "iss" in params and params["iss"] != metadata.issuer:
            raise LoginError("the callback names another issuer")
        # Step 3.
        if metadata.token_endpoint is None or "code" not in params:
            raise LoginError("the callback has no code, or the IdP no token_endpoint")
        token = await self._exchange_code(
            metadata.token_endpoint, params["code"], pending.code_verifier
        )
        id_token, access_token = token.get("id_token"), token.get("access_token")
        if not isinstance(id_token, str) or not isinstance(access_token, str):
            raise LoginError("the identity provider returned no ID token or access token")
        # Step 4.
        subject = await self._verify_id_token(id_token, metadata, pending.nonce)
        # Step 5.
        try:
            principal = await self._authenticator.authenticate([f"Bearer {access_token}"])
        except AuthError as exc:
            raise LoginError(f"the access token from the login is refused: {exc}") from None
        if principal.subject != subject:
            raise LoginError("the ID token and the access token name different subjects")
        return CompletedLogin(principal, id_token)

    @property
    def issuer_origin(self) -> str:
        """The identity provider's origin (`https://idp.example.com`), where logout goes on."""
        parts = urlsplit(self.issuer.issuer)
        return f"{parts.scheme}://{parts.netloc}"

    async def logout_url(self, id_token: str) -> str | None:
        """Where to send the browser to end its session at the IdP, or None when the IdP
        publishes no end_session_endpoint."""
        metadata = await self._provider()
        if metadata.end_session_endpoint is None:
            return None
        query = {"id_token_hint": id_token, "client_id": self.client_id}
        if self.issuer.console_post_logout_redirect_uri is not None:
            query["post_logout_redirect_uri"] = self.issuer.console_post_logout_redirect_uri
        return f"{metadata.end_session_endpoint}?{urlencode(query)}"

    async def _verify_id_token(self, id_token: str, metadata: ProviderMetadata, nonce: str) -> str:
        """The ID token's subject (OpenID Connect Core 1.0, section 3.1.3.7)."""
        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError:
            raise LoginError("the ID token is malformed") from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in self.issuer.algorithms or not isinstance(kid, str):
            raise LoginError("the ID token's algorithm is not allowed, or it names no key")
        try:
            key = await self._keys.key_for(kid, alg)
            claims = jwt.decode(
                id_token,
                key,
                algorithms=[alg],
                audience=self.client_id,
                issuer=metadata.issuer,
                leeway=self._leeway_s,
                options={"require": ["exp", "iat", "iss", "aud", "sub", "nonce"]},
            )
        except AuthenticationError as exc:
            raise LoginError(f"the ID token is refused: {exc.reason}") from None
        except jwt.PyJWTError as exc:
            raise LoginError(f"the ID token is refused ({type(exc).__name__})") from None
        if not hmac.compare_digest(str(claims["nonce"]), nonce):
            raise LoginError("the ID token's nonce is not this login's")
        return str(claims["sub"])

    async def _provider(self) -> ProviderMetadata:
        if self._metadata is None:
            try:
                document = await self._http.get_json(self.issuer.discovery_document_url)
                self._metadata = ProviderMetadata.parse(document, self.issuer.issuer)
            except (IdpUnreachableError, DiscoveryError) as exc:
                raise LoginError(f"the identity provider cannot be reached: {exc}") from None
        return self._metadata

    async def _exchange_code(
        self, token_endpoint: str, code: str, code_verifier: str
    ) -> dict[str, Any]:
        """The IdP's token response to the authorization code (RFC 6749 section 4.1.3, with
        RFC 7636's code_verifier). Raises `LoginError`."""
        from authlib.common.errors import AuthlibBaseError
        from httpx import HTTPError

        try:
            async with self._oauth_client() as client:
                token: dict[str, Any] = await client.fetch_token(
                    token_endpoint, code=code, code_verifier=code_verifier
                )
        except (AuthlibBaseError, HTTPError) as exc:
            raise LoginError(f"the code exchange failed ({type(exc).__name__})") from None
        return token

    def _oauth_client(self) -> AsyncOAuth2Client:
        from authlib.integrations.httpx_client import AsyncOAuth2Client

        return AsyncOAuth2Client(
            client_id=self.client_id,
            client_secret=self._client_secret,
            scope="openid",
            redirect_uri=self.redirect_uri,
            code_challenge_method="S256",
            # authlib's client_secret_basic does not form-encode ids (RFC 6749 section 2.3.1),
            # which breaks client ids holding ":" (URN audiences); every IdP takes _post.
            token_endpoint_auth_method="client_secret_post",
            verify=self._http.tls,
            timeout=self._http.timeout_s,
        )


def _read_secret(path: Path | None) -> str:
    if path is None:
        raise AuthConfigError("console login needs console_client_secret_file")
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AuthConfigError(f"cannot read the console client secret {path}: {exc}") from exc
    if not secret:
        raise AuthConfigError(f"the console client secret file {path} is empty")
    return secret
