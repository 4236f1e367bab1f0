"""Command-line helpers shared by the entry points: one clear line for a bad override or flag.

Hydra reports an unknown option of a config group (``scheduler=sjf``) or an unknown key
(``cache.capacity=100``) over several lines; users' sweeps and scripts are better served by
``error: scheduler must be one of ...; got 'sjf'`` and exit status 2, before Hydra starts
(`testbed.config.overrides`). A flag Hydra does not take (``--bogus``) gets the same one line,
`one_line_usage` turns argparse's usage-and-error of the entry points that parse flags into it,
and `exit_on_bad_input` is the one place a refusal becomes that line.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from testbed.errors import BadInput
from testbed.config.overrides import CONF_DIR, check_overrides, group_options, search_dirs

__all__ = ["CONF_DIR", "check_group_choices", "exit_on_bad_input", "group_options",
           "one_line_usage", "search_dirs"]

#: the flags Hydra's command line takes (``python -m testbed.run --help`` lists them)
HYDRA_FLAGS = frozenset(("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "--resolve",
                         "-p", "--package", "-r", "--run", "-m", "--multirun", "-sc",
                         "--shell-completion", "-cp", "--config-path", "-cn", "--config-name",
                         "-cd", "--config-dir", "--experimental-rerun", "-i", "--info"))


@contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Refused input raised inside (`BadInput`) prints its one ``error:`` line and exits with
    status 2; anything else is a defect and goes on (its traceback, exit status 1)."""
    try:
        yield
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR, name: str = "config"
                        ) -> None:
    """Exit with one line (status 2) if an override picks an option a config group does not
    have (in ``conf/`` or a folder of ``hydra.searchpath``) or sets a key the config ``NAME``
    (``conf/NAME.yaml``) does not have."""
    with exit_on_bad_input():
        flag = next((a for a in argv if a.startswith("-") and a.split("=")[0] not in HYDRA_FLAGS),
                    None)
        if flag is not None:
            raise BadInput(f"unknown flag {flag}: this command takes KEY=VALUE overrides and "
                           "Hydra's flags (--help lists them)")
        check_overrides(argv, name, conf_dir)


@contextmanager
def one_line_usage() -> Iterator[None]:
    """While it is open, argparse's usage errors (an unknown flag, a missing or malformed
    argument) are one ``error:`` line and exit status 2, as every other bad input, not the
    usage followed by the error."""
    def error(_parser: argparse.ArgumentParser, message: str) -> None:
        print(f"error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved
