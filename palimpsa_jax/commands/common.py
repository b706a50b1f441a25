"""Pieces shared by the command lines: flag parsing, logging, and errors reported in one line."""
from __future__ import annotations

import re
import sys
from collections.abc import Callable

from absl import app, flags, logging

from palimpsa_jax.training import preemption
from palimpsa_jax.training.checkpoint import CheckpointError
from palimpsa_jax.training.config import ConfigError

# Errors of the user's making: reported as one line naming the key or file, without a traceback.
USER_ERRORS = (ConfigError, CheckpointError, FileNotFoundError)


def _unknown_key(e: Exception, argv: list[str]):
    """Exits with status 1 and one line naming the `--config.<key>` that ml_collections did not
    know (its KeyError or AttributeError `e`)."""
    while e.args and isinstance(e.args[0], BaseException):
        e = e.args[0]
    detail = str(e.args[0] if e.args else e).replace("\n", "; ")
    unknown = re.match(r"'(\w+)'", detail)
    keys = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
    culprits = [k for k in keys if unknown and unknown[1] in k.split(".")[1:]] or keys
    sys.stderr.write(f"FATAL Flags parsing error: {', '.join(culprits)}: unknown config key "
                     f"({detail})\n")
    sys.exit(1)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with an unknown `--config.<key>` reported like other flag errors."""
    try:
        return app.parse_flags_with_usage(argv)
    except (KeyError, AttributeError) as e:        # ml_collections' unknown key
        _unknown_key(e, argv)


def define_config(define: Callable, name: str, default, help_text: str) -> None:
    """config_flags.DEFINE_config_file or DEFINE_config_dict with a default: ml_collections
    applies the command line's `--config.<key>` overrides to it at once, so an unknown key is
    reported here as `parse_flags` reports it."""
    try:
        define(name, default, help_text)
    except (KeyError, AttributeError) as e:
        _unknown_key(e, sys.argv)


def quiet_logging() -> None:
    """Warnings and errors only (orbax logs every save at INFO), unless --verbosity is given."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def run(main: Callable[[], None]) -> None:
    """app.run(main) with our flag parsing and quiet logging; positional arguments are a usage
    error; a ConfigError, CheckpointError or missing file ends the program with status 2 and one
    line `error: <message>` on stderr; a run stopped by SIGTERM (its checkpoint written) with
    status 143 and one line `stopped: <message>`."""
    def guarded(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        quiet_logging()
        try:
            main()
        except USER_ERRORS as e:
            message = str(e).replace("\n", "; ")
            sys.stderr.write(f"error: {message}\n")
            sys.exit(2)
        except preemption.Preempted as e:
            sys.stderr.write(f"stopped: {e}\n")
            sys.exit(preemption.EXIT_STATUS)

    app.run(guarded, flags_parser=parse_flags)
