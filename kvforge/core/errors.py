"""One exception type for every error a user can cause; the CLI prints it as one line.

Exit codes (the README's table is generated from EXIT_CODES and must agree with it):
"""

EXIT_OK = 0
EXIT_LINT = 1
EXIT_USAGE = 2
EXIT_APPLY = 3
EXIT_TESTS = 4
EXIT_ENV = 5
EXIT_NETWORK = 6
EXIT_NOT_RUN = 7
EXIT_INTERNAL = 70

EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_LINT: "lint problems in a series",
    EXIT_USAGE: "bad input: an option, a target file, a series, a tree or a refusal to touch a user's work",
    EXIT_APPLY: "a patch does not apply",
    EXIT_TESTS: "tests or verify failed (or no test ran)",
    EXIT_ENV: "environment problem (test venv, interpreter, git, disk, permissions)",
    EXIT_NETWORK: "network or download problem",
    EXIT_NOT_RUN: "not run: the platform (cuda, npu) is not available on this machine",
    EXIT_INTERNAL: "internal error in kvforge (a bug): the traceback is saved and its path printed",
}


class KvforgeError(Exception):
    """A user-facing failure. `exit_code` is one of EXIT_CODES; the message is one line.

    `data`: extra keys of the JSON error object ({"error", "exit", **data}); `text`: a human report
    printed on stdout before the error line (e.g. the per-patch table of a failed apply); `notes`:
    warnings printed before it. cli.finish renders all of them.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, exit_code: int | None = None, data: dict | None = None, text: str = "",
                 notes: list[str] | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.data = data or {}
        self.text = text
        self.notes = notes or []
