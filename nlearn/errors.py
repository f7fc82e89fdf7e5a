"""User-facing errors: entry points print these as one line and exit non-zero, without a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, files, checkpoints) that they can fix."""
