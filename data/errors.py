"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """A problem with the user's data or settings that the user can fix.

    The message names the offending path or value and says what to do; ``normlab prepare`` prints it
    without a traceback and exits non-zero.
    """
