"""Reading a form the console's pages post: only a urlencoded form is taken (a JSON body, which
no page sends, is refused rather than read as an empty form that would ask for defaults), each
field's last value. Its size and field count are bounded before the route runs
(appliance.api.access.MAX_FORM_BYTES)."""

from __future__ import annotations

from urllib.parse import parse_qs

from fastapi import Request

from appliance.console.errors import ConsoleError

FORM_TYPE = "application/x-www-form-urlencoded"


async def read_form(request: Request) -> dict[str, str]:
    """The posted form's fields. Raises ConsoleError (400) for any other kind of body."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != FORM_TYPE:
        raise ConsoleError(400, "this takes the page's form; send it from the console's page")
    fields = parse_qs((await request.body()).decode("utf-8", "replace"))
    return {name: values[-1] for name, values in fields.items()}
