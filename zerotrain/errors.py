"""The one exception type that reaches the user as a single line (no traceback unless --debug)."""


class ZerotrainError(Exception):
    """Bad input or an impossible request: the message says what, where, and what to do."""


def one_line(err: BaseException, limit: int | None = None) -> str:
    """An error's message for a one-line report: its whitespace runs made single spaces, at most `limit`
    characters, and its type's name when it has no message."""
    return (" ".join(str(err).split()) or type(err).__name__)[:limit]
