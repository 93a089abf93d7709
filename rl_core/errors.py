"""Exceptions that end a job with one line (rl_core.cli.run_main prints them without a traceback).

`UserError` is the base of every failure the user can fix from its message alone, in rl_core/, workers/ and envs/
alike: this module imports nothing, so workers/ and envs/ take the base from here without the rest of rl_core.
"""


class UserError(Exception):
    """A failure whose message is the whole story (the key, file or process, and the fix): a traceback would only
    bury it. Derived from alongside the builtin exception each class is (`ValueError`, `RuntimeError`)."""


class JobError(UserError, RuntimeError):
    """A failure the user can fix; its message names the key, file or process and the fix."""


class PeerFailed(RuntimeError):
    """This rank stops because another rank failed; that rank reports the cause."""


class PreferenceDataError(UserError, ValueError):
    """A preference file that cannot be used as it is; the message names the rows and the fix."""
