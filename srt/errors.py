"""The errors of bad input, wherever it is found to be bad: a request that cannot be served, an
option no server can start with."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that cannot be served as asked. The HTTP API answers it with 400 and the
    OpenAI error body; `param` names the offending field in the caller's own terms."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class ServerArgsError(ValueError):
    """An option no server can start with; names its flag, as argparse does."""

    def __init__(self, name: str, message: str) -> None:
        self.flag = "--" + name.replace("_", "-")
        super().__init__(f"argument {self.flag}: {message}")
