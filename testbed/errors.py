"""The one exception type for bad input, kept apart from defects.

``BadInput`` is raised by validation code when a config value, a trace or a request cannot be run
as given: the entry points print its message on one ``error:`` line and exit 2, and a sweep records
it as ``"kind": "bad_input"``. Every other exception is a defect of the testbed (``"kind":
"internal"``, exit 1, traceback in failed.json). It subclasses ``ValueError`` so that callers that
caught bad values as ``ValueError`` keep working.
"""

from __future__ import annotations


class BadInput(ValueError):
    """A config value, trace or request the testbed refuses; the message names what and why."""


def failure_kind(error: BaseException) -> str:
    """``"bad_input"`` for a refused input, ``"internal"`` for anything else (a defect)."""
    return "bad_input" if isinstance(error, BadInput) else "internal"
