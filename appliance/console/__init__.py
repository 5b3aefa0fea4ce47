"""The admin web console at /console: server-rendered pages for admins and auditors, every
asset served from this package (no CDN, no web font, no external request).

pages.py renders the templates with the console's security headers (a strict CSP); routes.py
holds the pages and the admin actions, each audited before it takes effect; tokens.py the
Access page's local-issuer tokens (minting, the list); ticket_sign_in.py the one-time sign-in
link of `inferno console-link`; attestation_records.py (evidence download, verdict history),
audit_export.py (bundle export, SIEM status) and usage_page.py (with usage.py, the tally and its
CSV) add their own routers, which appliance.app installs beside it; audit_search.py searches
the audit log; table.py sorts and pages the tables; forms.py reads posted forms; errors.py is
what the error page answers. The Overview's live view: series.py samples the metrics into the
last hour's time series, gpus.py reads the GPUs through NVML off the event loop, charts.py
gives the charts their texts and JSON. Who may open which page is
`appliance.api.access.ROUTE_ACCESS`, like every other route.
"""
