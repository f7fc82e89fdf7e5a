"""Shared entry-point plumbing: one clear line and a non-zero exit for every user mistake."""

from __future__ import annotations

import os
import sys
import warnings

from absl import app, flags, logging

from nlearn.errors import UserError

EXIT_USER_ERROR = 2


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def parse_flags(argv):
    """absl flag parsing whose errors (unknown override keys, missing config files) are one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except (UserError, OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        fail(f"{type(e).__name__}: {e}")


def quiet_libraries() -> None:
    """Keep the console to our own progress lines."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.set_verbosity(logging.WARNING)
    import absl.logging as absl_logging

    absl_logging.use_absl_handler()


def run(main) -> None:
    """`app.run(main)` with one-line failures for UserError and flag errors."""

    def guarded(argv):
        quiet_libraries()
        if len(argv) > 1:
            fail(f"unexpected positional arguments: {' '.join(argv[1:])}")
        try:
            main(argv)
        except UserError as e:
            fail(str(e))

    app.run(guarded, flags_parser=parse_flags)
