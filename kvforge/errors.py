"""One exception type for every error a user can cause; the CLI prints it as one line."""


class KvforgeError(Exception):
    """A user-facing failure: bad input, a failed apply, a missing base.

    `exit_code` lets callers tell kinds apart: 2 bad input/usage, 3 a patch that does not apply,
    4 a test/verify failure, 5 an environment problem, 6 network/download.
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


EXIT_USAGE = 2
EXIT_APPLY = 3
EXIT_TESTS = 4
EXIT_ENV = 5
EXIT_NETWORK = 6
