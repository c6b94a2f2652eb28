"""The one exception type for errors a user can cause.

The CLI prints these as a single line on stderr (no traceback) and exits non-zero; the server maps
them to 4xx responses. Anything else escaping is a bug.
"""


class SpecdraftError(Exception):
    """A user-facing error: bad input, unknown model, impossible parameter, incompatible pair."""
