"""Exceptions. `UsageError` is bad input from the user: the CLI prints its message on one
line and exits with status 2, without a traceback."""


class SpeclmError(Exception):
    """Something speclm could not do; the message says what and why."""


class UsageError(SpeclmError):
    """Bad input: an unknown model, an invalid option, a prompt that does not fit."""


class PullError(SpeclmError):
    """A model could not be downloaded, assembled, verified or converted."""
