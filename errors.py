"""The one error type fp8kv raises for anything a user can fix, and the exit codes of every command."""

from enum import IntEnum


class Fp8kvError(Exception):
    """A problem with the user's input or environment, described in one line.

    The message names the file, tensor or layer and, where possible, the fix.
    The CLI prints it without a traceback and exits with `ExitCode.ERROR`.
    """


class UsageError(Fp8kvError):
    """A command line that cannot work as given, found once the model is known (a missing --dataset):
    the CLI exits with `ExitCode.USAGE`."""


class ExitCode(IntEnum):
    """What a script can read from `$?`. USAGE is typer's own code for a malformed command line."""

    PASS = 0  # success; for verify: the scales passed every check
    WARN = 1  # verify: usable, with warnings (see the report)
    USAGE = 2  # unknown option, bad choice or number, missing argument
    FAIL = 3  # verify: the scales must not be used
    ERROR = 4  # a bad input or environment, described in one `fp8kv: error:` line
    CRASH = 5  # a bug in fp8kv: an unexpected exception (FP8KV_DEBUG=1 shows the traceback)


EXIT_CODE_TABLE = "Exit codes: " + ", ".join(f"{code.value} {code.name}" for code in ExitCode) + "."
