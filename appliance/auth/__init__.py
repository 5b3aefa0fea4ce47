"""OIDC resource server, roles and console sessions (issue #6)."""
