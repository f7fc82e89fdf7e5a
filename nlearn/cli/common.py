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


def _check_config_files(argv) -> None:
    """Refuse a missing `--config=FILE[:preset]` before ml_collections logs a traceback for it."""
    for arg in argv[1:]:
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1].split(":", 1)[0]
            if not os.path.isfile(path):
                fail(f"config file not found: {path}")


# Config keys that share a name with a ConfigDict method (`model.cms.update`): ml_collections' flag parser
# resolves `--config.a.update=x` to the bound method and refuses it, so these overrides are applied here.
_METHOD_KEYS = ("update",)


def _split_method_key_overrides(argv):
    """`(argv without them, [(dotted path, raw value)])` for overrides whose last key is a ConfigDict method."""
    kept, held = [], []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if arg.startswith("--config.") and eq and name.rsplit(".", 1)[-1] in _METHOD_KEYS:
            held.append((name[len("--config."):], value))
        else:
            kept.append(arg)
    return kept, held


def _apply_method_key_overrides(config, held) -> None:
    """Set each held override by item access (`node["update"] = value`), parsed as the value it replaces."""
    import ast

    for path, raw in held:
        *parents, key = path.split(".")
        node = config
        for part in parents:
            node = node[part]
        if key not in node:
            raise KeyError(path)
        old = node[key]
        if isinstance(old, str):
            node[key] = raw
        else:
            try:
                node[key] = type(old)(ast.literal_eval(raw))
            except (ValueError, SyntaxError, TypeError) as e:
                raise UserError(f"--config.{path}={raw}: not a {type(old).__name__} ({e})") from None


def parse_flags(argv):
    """absl flag parsing whose errors (unknown override keys, missing config files) are one line."""
    _check_config_files(argv)
    argv, held = _split_method_key_overrides(argv)
    # The config flag reads its overrides from sys.argv itself, so they leave sys.argv too.
    sys.argv[:] = _split_method_key_overrides(sys.argv)[0]
    try:
        parsed = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS["config"].present:
            _apply_method_key_overrides(flags.FLAGS.config, held)  # also loads the file now: its errors
            # surface here, not mid-run
        elif held:
            fail(f"--config.{held[0][0]} needs --config")
        return parsed
    except flags.Error as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except UserError as e:
        fail(str(e))
    except (KeyError, AttributeError) as e:  # an override naming a key the config lacks
        name = str(e).strip("\"'")
        culprits = [a.split("=", 1)[0] for a in argv[1:]
                    if a.startswith("--config.") and f".{name}" in a.split("=", 1)[0]]
        fail(f"unknown config key {culprits[0] if culprits else name!r}: not in the config "
             "(see the config file for valid keys)")
    except (OSError, ValueError, TypeError, SyntaxError) as e:
        fail(f"{type(e).__name__}: {str(e).splitlines()[0]}")


def configure_process() -> None:
    """What a console script sets for its whole process, before any jax work; a user's own settings win.

    LAPACK custom calls (triangular_solve in the DGD memory) run on scipy's OpenBLAS, whose default
    thread pool competes with XLA's own threads: a [8, 16, 16] solve took 136 ms instead of 0.2 ms on
    2 cores. OpenBLAS reads its thread count when it loads, at the first LAPACK call.
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "JAX_PLATFORMS" not in os.environ and tpu_runtime_without_a_tpu():
        os.environ["JAX_PLATFORMS"] = "cpu"


def tpu_runtime_without_a_tpu() -> bool:
    """libtpu is installed (`nlearn[tpu]`, for nlearn-compile) but no TPU chip is attached and no GPU plugin
    is installed: jax would start the TPU runtime anyway, which prints errors about TPU hosts it cannot find.
    (nlearn-compile still reaches libtpu: a topology's devices do not need the TPU backend.)"""
    import glob
    import importlib.util

    if importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jax_plugins") is not None:
        return False
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with open(path) as f:
            if f.read().strip() == "0x1ae0":  # Google's PCI vendor id: a TPU may be attached
                return False
    return True


def quiet_libraries() -> None:
    """Keep the console to our own progress lines (absl logging; orbax's read-only notices)."""
    logging.set_verbosity(logging.WARNING)
    import absl.logging as absl_logging

    absl_logging.use_absl_handler()
    absl_logging.get_absl_logger().addFilter(_drop_orbax_read_only)


def _drop_orbax_read_only(record) -> bool:
    """Orbax warns three times that a read-only checkpoint manager is read-only (eval, generate)."""
    message = record.getMessage().lower().replace("_", " ")
    return not ("orbax" in (record.pathname or "") and "read only" in message)


def run(main) -> None:
    """`app.run(main)` for a console script: one-line failures for UserError and flag errors, library
    deprecation notices hidden while `main` runs."""
    configure_process()

    def guarded(argv):
        quiet_libraries()
        if len(argv) > 1:
            fail(f"unexpected positional arguments: {' '.join(argv[1:])}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", FutureWarning)
                main(argv)
        except UserError as e:
            fail(str(e))

    app.run(guarded, flags_parser=parse_flags)
