"""Ingestion's own errors: a document (or job) id that does not exist, and the registry's
server being unreachable (a StoreError: the server's fault, not the input's). Bad input is
`ragkv.errors.InputError`, shared by every layer."""

from ragkv.store.errors import StoreError


class NotFoundError(KeyError):
    """A document (or job) id that does not exist for this tenant."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class RegistryUnavailableError(StoreError):
    """The registry's server (Redis) did not answer or refused the call."""
