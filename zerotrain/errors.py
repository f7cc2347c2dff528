"""The one exception type that reaches the user as a single line (no traceback unless --debug)."""


class ZerotrainError(Exception):
    """Bad input or an impossible request: the message says what, where, and what to do."""
