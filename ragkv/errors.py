"""The one error every layer raises for unusable input: ingestion (a bad document or
filter), the application (a prompt past the context, an unknown option), the API's
conversion and the CLI. It lives here, below all of them, so none imports another layer
for it; the API maps it to a 4xx, the CLI prints its message."""


class InputError(ValueError):
    """Input rejected before anything was written. `reason` is a short machine-readable code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
