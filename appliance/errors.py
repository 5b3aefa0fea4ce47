"""Errors of the appliance's own start-up: settings and TLS material. Callers catch
`ApplianceError`; the engine has its own root (`appliance.engine.errors.EngineError`).

Every message names the setting or file to fix and never carries a secret.
"""


class ApplianceError(Exception):
    """Root of every error the appliance's start-up raises on purpose."""


class ConfigError(ApplianceError):
    """The settings file or an `INFERNO_...` environment override is unusable."""


class TlsError(ApplianceError):
    """The TLS certificate or key cannot be used or made."""


class ModelFilesError(ApplianceError):
    """The model directory's weight files cannot be read for their digest."""


class BootError(ApplianceError):
    """A start-up step failed (the audit log cannot be opened ...): the appliance does not
    serve."""
