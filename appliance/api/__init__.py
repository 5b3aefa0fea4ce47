"""The OpenAI-compatible HTTP API: routes, request and response schemas, streaming, error
mapping, admission control, readiness, metrics and middleware. `appliance.app.build` wires it."""
