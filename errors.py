"""The one error type fp8kv raises for anything a user can fix."""


class Fp8kvError(Exception):
    """A problem with the user's input or environment, described in one line.

    The message names the file, tensor or layer and, where possible, the fix.
    The CLI prints it without a traceback and exits non-zero.
    """
