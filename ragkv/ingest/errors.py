"""Errors that mean the caller's input is unusable (the API maps them to 4xx), and the
registry's server being unreachable (a StoreError: the server's fault, not the input's)."""

from ragkv.store.errors import StoreError


class InputError(ValueError):
    """Input rejected before anything was written. `reason` is a short machine-readable code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class NotFoundError(KeyError):
    """A document (or job) id that does not exist for this tenant."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class RegistryUnavailableError(StoreError):
    """The registry's server (Redis) did not answer or refused the call."""
