"""The installer's error types: callers catch `InstallerError`.

Every message says what to do next.
"""


class InstallerError(Exception):
    """Root of every error the installer raises on purpose."""


class EmbeddedModelNotFoundError(InstallerError):
    """The embedded default model's package, or the GGUF file inside it, cannot be found."""


class SealingError(InstallerError):
    """A model directory cannot be sealed, or sealing keys cannot be made."""


class BundleError(InstallerError):
    """An offline bundle or a release key cannot be made."""
