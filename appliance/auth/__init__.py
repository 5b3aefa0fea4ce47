"""Access control: the OIDC resource server that checks bearer access tokens, the mapping of
identity-provider claims to Inferno's roles, console login sessions, and the local demo issuer.

No user database: identities come from the customer's OIDC providers. Every decision fails
closed; tokens are never logged. `appliance.api.access` applies it to the routes.
"""
