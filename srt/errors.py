"""The error a request that cannot be served raises, wherever it is found to be bad."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that cannot be served as asked. The HTTP API answers it with 400 and the
    OpenAI error body; `param` names the offending field in the caller's own terms."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code
