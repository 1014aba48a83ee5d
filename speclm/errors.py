"""Exceptions. `UsageError` is bad input from the user: the CLI prints its message on one
line and exits with status 2, without a traceback."""


class SpeclmError(Exception):
    """Something speclm could not do; the message says what and why."""


class UsageError(SpeclmError):
    """Bad input: an unknown model, an invalid option, a prompt that does not fit."""


class PullError(SpeclmError):
    """A model could not be downloaded, assembled, verified or converted."""


class StoreError(UsageError):
    """The model cache cannot be used: its folder cannot be created or written, the disk filled
    up, or a cached model's weights are not the files converted. Exit status 2, like bad input:
    the fix is on the user's side (SPECLM_HOME, free space, `speclm models pull NAME --force`)."""
