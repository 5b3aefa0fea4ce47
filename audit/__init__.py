"""Signed tamper-evident audit log and its offline verifier (issue #5)."""
