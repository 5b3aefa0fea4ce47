"""Rendering the console's pages: jinja2 templates from this package, autoescaped, answered
with the headers every console page carries.

The Content-Security-Policy allows nothing but this origin's own files: no inline script or
style (the templates hold neither), no framing (`frame-ancestors 'none'`, against
clickjacking), forms posting only here and to the identity provider (logout ends there). Pages
are not cached: they show sessions, settings and audit entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

STATIC_FILES = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "overview.js": "text/javascript; charset=utf-8",
}

SIGNED_OUT: Mapping[str, Any] = {
    "viewer": None, "csrf_token": None, "nav": (), "page": None, "tee_state": None,
}  # fmt: skip
"""The context of a page shown without a session: no menu, no one named."""


@dataclass(frozen=True, slots=True)
class SignIn:
    """How people sign in here, as the sign-in page tells them: with the identity provider
    (`idp`), with a one-time link of the local issuer (`local`, `inferno console-link`)."""

    idp: bool = True
    local: bool = False


def content_security_policy(form_targets: tuple[str, ...]) -> str:
    """The console's CSP; `form_targets` are the origins outside this one a form may lead to
    (the identity provider, where logout continues)."""
    return "; ".join(
        (
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            "img-src 'self'",
            "connect-src 'self'",
            "font-src 'none'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action " + " ".join(("'self'", *form_targets)),
            "frame-ancestors 'none'",
        )
    )


class ConsolePages:
    """The console's templates and headers."""

    def __init__(self, form_targets: tuple[str, ...] = (), sign_in: SignIn = SignIn()) -> None:
        self.sign_in = sign_in
        self._env = Environment(
            loader=PackageLoader("appliance.console", "templates"),
            autoescape=select_autoescape(default=True),
            undefined=StrictUndefined,
        )
        self._env.filters["time"] = time_element
        self._env.filters["utc"] = format_utc
        self._env.filters["duration"] = format_duration
        self.headers = {
            "Content-Security-Policy": content_security_policy(form_targets),
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        }

    def render(self, template: str, context: Mapping[str, Any], status: int = 200) -> HTMLResponse:
        html = self._env.get_template(template).render(context)
        return HTMLResponse(html, status_code=status, headers=self.headers)

    def error(self, status: int, message: str) -> HTMLResponse:
        """The page of a refusal or failure: what happened, and what to do."""
        context = {**SIGNED_OUT, "status": status, "message": message, "sign_in": self.sign_in}
        return self.render("error.html", context, status)

    def static(self, name: str) -> tuple[bytes, str] | None:
        """A static file's bytes and media type, or None if the console has no such file."""
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            return None
        static = resources.files("appliance.console").joinpath("static")
        return static.joinpath(name).read_bytes(), media_type


def time_element(moment: datetime | float | None) -> Markup:
    """A time as the console shows it: a `<time>` element reading `2026-11-25 19:12:03 UTC`,
    which the console's script shows in the viewer's time zone."""
    if moment is None:
        return Markup("—")
    return Markup('<time datetime="{}">{}</time>').format(
        _utc(moment).isoformat(), format_utc(moment)
    )


def format_utc(moment: datetime | float) -> str:
    """A time as plain text, `2026-11-25 19:12:03 UTC`, for where no element may go (an
    attribute)."""
    return _utc(moment).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_duration(seconds: float) -> str:
    """A span as people say it: `1 h`, `1 h 30 min`, `15 min`, `45 s`, `0.5 s`."""
    if seconds < 10 and seconds != round(seconds):
        return f"{seconds:.2g} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours} h" if hours else "", f"{minutes} min" if minutes else ""]
    if not hours and (secs or not minutes):
        parts.append(f"{secs} s")
    return " ".join(part for part in parts if part)


def _utc(moment: datetime | float) -> datetime:
    if not isinstance(moment, datetime):
        return datetime.fromtimestamp(moment, UTC)
    return moment.astimezone(UTC)
