"""The engine's error types: callers catch `EngineError`.

Every message says what to fix; none carries prompt text or completions.
"""


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""


class EngineConfigError(EngineError):
    """The engine's own settings are inconsistent (block size, pool size, token budget, ...)."""


class ModelLoadError(EngineError):
    """The model directory, its config or its weights cannot be used."""


class InvalidRequestError(EngineError):
    """A request cannot be served as given (bad sampling parameters, prompt too long, ...).

    Raised when the request is submitted, so the engine and every other request keep going.
    `param` names the request parameter at fault, when one is.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt, or the prompt plus the tokens asked for, does not fit in the context or the
    KV cache."""


class TensorParallelError(EngineError):
    """A tensor-parallel worker could not start, died, or stopped answering: the engine stops
    (it cannot serve with part of the model missing)."""
