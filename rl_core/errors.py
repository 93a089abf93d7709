"""Exceptions that end a job with one line (rl_core.cli.run_main prints them without a traceback)."""


class JobError(RuntimeError):
    """A failure the user can fix; its message names the key, file or process and the fix."""


class PeerFailed(RuntimeError):
    """This rank stops because another rank failed; that rank reports the cause."""


class PreferenceDataError(ValueError):
    """A preference file that cannot be used as it is; the message names the rows and the fix."""
