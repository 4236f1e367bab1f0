"""The one exception type for bad input, kept apart from defects.

``BadInput`` is raised by validation code when a config value, a trace or a request cannot be run
as given: the entry points print its message on one ``error:`` line and exit 2, and a sweep records
it as ``"kind": "bad_input"``. Every other exception is a defect of the testbed (``"kind":
"internal"``, exit 1, traceback in failed.json). It subclasses ``ValueError`` so that callers that
caught bad values as ``ValueError`` keep working.

``WorkloadRefused`` is the kind of bad input that only the workload's requests can show (an empty
prompt, a token id outside the model's vocabulary, a prompt longer than its context, calls that
wait across programs, a trace file's content): every other refusal comes from config values and
is raised by `testbed.config.assembly.assemble`, before anything is generated (the fuzzer checks
it).

A message that refuses a name says what is allowed and, with `did_you_mean`, the closest one:
first the name a word usually means (`INTENTS`: ``size`` is a cache's ``capacity_tokens``, not the
``page_size`` it is spelled nearest to), else the nearest spelling; `check_choice` is that check
for every option that takes one of a few names.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable


class BadInput(ValueError):
    """A config value, trace or request the testbed refuses; the message names what and why."""


class WorkloadRefused(BadInput):
    """A request of the workload (generated or read) that the chosen backend cannot serve."""


def failure_kind(error: BaseException) -> str:
    """``"bad_input"`` for a refused input, ``"internal"`` for anything else (a defect)."""
    return "bad_input" if isinstance(error, BadInput) else "internal"


# words users type for a name spelled far from them (or nearer another name), checked before
# spelling: the first of a word's names that is allowed where it was typed
INTENTS: dict[str, tuple[str, ...]] = {
    word: ("capacity_tokens",)
    for word in ("size", "cache_size", "pool_size", "kv_size", "tokens", "kv_tokens",
                 "memory")}


def did_you_mean(word: str, allowed: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the allowed name ``word`` most likely means (`INTENTS`, else
    the closest spelling), or "" for none close."""
    allowed = list(allowed)
    meant = [name for name in INTENTS.get(word.lower().replace("-", "_"), ())
             if name in allowed]
    close = meant or difflib.get_close_matches(word, allowed, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def check_choice(key: str, value: Any, allowed: Iterable[Any], *, null: bool = False,
                 error: type[ValueError] = BadInput) -> None:
    """Refuse ``value`` for the option ``key`` unless it is one of ``allowed`` (or None, where
    ``null``), in one message for every option: ``cache.reuse must be one of prefix, blend; got
    'blnd'; did you mean blend?`` (``... or null; got ...`` where null is allowed too). ``error``:
    the exception raised (a `BadInput` subclass, or ``ValueError`` for a caller's defect)."""
    allowed = tuple(allowed)
    if value in allowed or (null and value is None):
        return
    names = [str(a) for a in allowed]
    hint = did_you_mean(value, names) if isinstance(value, str) else ""
    raise error(f"{key} must be one of {', '.join(names)}{' or null' if null else ''}; "
                f"got {value!r}{hint}")
