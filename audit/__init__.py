"""The signed, tamper-evident audit log (docs/AUDIT.md) and its offline verifier
(`python -m audit`)."""
