"""One way to turn a config group into an object, for every family the testbed builds.

Each family has one `Registry`: ``cache`` (testbed/cache), ``eviction`` (testbed/cache/eviction.py),
``scheduler`` (queue policies, testbed/scheduler/policy.py), ``router`` (testbed/router),
``cost_model`` (testbed/sim/cost_model.py), ``workload`` (testbed/workloads) and ``backend`` (the
executors, testbed/serving/executor.py). A registry holds the family's built-in entries by name (a class,
or a factory function where building takes more than a constructor call), the methods every entry
must have, and the group keys that belong to the run rather than to the entry. `Registry.resolve`
reads one config group and `Resolved.build` makes the object:

- the entry is the group's ``target`` when it sets one (an import path ``module.Name``: the group
  option ``custom``, a class of your own on ``PYTHONPATH``), else the built-in called ``name``;
- a class without one of the family's methods is refused in one line naming the method (a factory
  function's product is checked instead);
- every other key of the group is a keyword argument of the entry, and a key it does not take is
  refused in one line listing the keys it does, and a value of the wrong type for a parameter
  annotated ``int``, ``float`` or ``bool`` in one line naming the key
  (`testbed.config.group_values.check_setting`);
- the entry's parameters that the run offers (``context``: the seed, the workload, the model shape,
  the cache, ...) and the group leaves unset (absent or null) are filled from it.

Why an import path and not Hydra's ``_target_``: a run keeps ``name`` (summaries and reports group
by it), the entries see plain values rather than Hydra's instantiation machinery, parameters the
run supplies are injected by name the same way for built-ins and user classes, and every mistake
stays a one-line error naming the config key (``hydra.utils.instantiate`` wraps errors in
multi-line ``InstantiationException`` traces).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from testbed.errors import BadInput, check_choice, did_you_mean
from testbed.config.group_values import check_setting

CUSTOM = "custom"  # the group option that takes ``target``


def group_label(group: Mapping[str, Any] | str | None) -> str | None:
    """What a run's summary calls its choice of a family: the import path of a user class, else
    the built-in's name."""
    if group is None or isinstance(group, str):
        return group
    return group.get("target") or group.get("name")


def import_target(path: str, key: str) -> Any:
    """The object at ``module.Name`` (or ``module:Name``); one-line errors name ``key``."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name or not attr:
        raise BadInput(f"{key}={path!r} must be an import path module.Name")
    if os.getcwd() not in sys.path and "" not in sys.path:  # python -m puts it there; scripts don't
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BadInput(f"{key}={path}: cannot import {module_name} ({e}); is its folder on "
                       "PYTHONPATH or the working directory?") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BadInput(f"{key}={path}: module {module_name} has no {attr}") from None


def _parameters(entry: Callable) -> tuple[dict[str, Any], bool]:
    """The keyword parameters ``entry`` takes, each with its annotation (a string under ``from
    __future__ import annotations``), and whether it takes any (``**kwargs``)."""
    target = entry.__init__ if inspect.isclass(entry) else entry
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust the call
        return {}, True
    if inspect.isclass(entry):
        params = params[1:]  # self
    names = {p.name: p.annotation for p in params
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


class Lazy:
    """A context value made only if the entry being built asks for it (the cost model, which
    the engine's executor does not take)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


@dataclass(frozen=True)
class Resolved:
    """One config group checked against its entry, ready to build."""

    registry: Registry
    label: str  # the built-in's name or the target's import path
    entry: Callable
    params: dict[str, Any]  # the group's settings for the entry

    @property
    def key(self) -> str:
        return self.registry.family

    def takes(self, name: str) -> bool:
        """Whether the entry has a parameter ``name``: one `build` fills from its context when
        the group leaves it unset (a ``**kwargs`` gets nothing from the context)."""
        return name in _parameters(self.entry)[0]

    def build(self, **context: Any) -> Any:
        """Call the entry with the group's settings, filling the parameters it names from
        ``context`` where the group leaves them unset."""
        kwargs = dict(self.params)
        names, _ = _parameters(self.entry)
        for name in names:
            if kwargs.get(name) is None and name in context:
                value = context[name]
                kwargs[name] = value.make() if isinstance(value, Lazy) else value
        try:
            inspect.signature(self.entry).bind(**kwargs)
        except TypeError as e:  # a required setting missing
            raise BadInput(f"{self.key}={self.label}: {e}") from None
        except ValueError:  # no signature to check against
            pass
        built = self.entry(**kwargs)
        self.registry.check_methods(built, self.label)
        return built


class Registry:
    """The built-in entries of one family and the interface they share (module docstring)."""

    def __init__(self, family: str, methods: tuple[str, ...] = (),
                 run_keys: tuple[str, ...] = (), context_keys: tuple[str, ...] = (),
                 what: str = "") -> None:
        self.family = family  # the config group, e.g. "eviction"
        self.methods = methods  # what every entry's objects must have
        self.run_keys = run_keys  # group keys read by the run, not passed to the entry
        self.context_keys = context_keys  # what the run offers entries: not config settings
        self.what = what or family  # e.g. "an eviction policy", for messages
        self._entries: dict[str, Callable] = {}

    def register(self, name: str, entry: Callable | str | None = None) -> Callable:
        """Add a built-in; used as ``@REGISTRY.register("name")`` or called with the entry, or
        with the import path ``module:Name`` of one whose module is slow to import (it is
        imported when a run chooses it)."""
        if name == CUSTOM or name in self._entries:
            raise ValueError(f"{self.family}: {name!r} is reserved or registered already")

        def add(e: Callable) -> Callable:
            self._entries[name] = e
            return e

        return add(entry) if entry is not None else add

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Callable:
        return self.resolve(name).entry

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def check_methods(self, obj: Any, label: str) -> None:
        """Refuse, in one line, a class or object without one of the family's methods."""
        for method in self.methods:
            if not callable(getattr(obj, method, None)):
                kind = "class" if inspect.isclass(obj) else type(obj).__name__
                raise BadInput(f"{self.family}={label}: {kind} does not implement {method}(), "
                               f"which {self.what} must have ({', '.join(self.methods)})")

    def resolve(self, group: Mapping[str, Any] | str, run_keys: tuple[str, ...] = ()
                ) -> Resolved:
        """The entry a config group names and its settings, checked (module docstring).
        ``run_keys``: more keys of the group that the caller reads itself."""
        params = {"name": group} if isinstance(group, str) else dict(group)
        name, target = params.pop("name", None), params.pop("target", None)
        for key in (*self.run_keys, *run_keys):
            params.pop(key, None)
        if target:
            entry = import_target(str(target), f"{self.family}.target")
            label = str(target)
            if not callable(entry):
                raise BadInput(f"{self.family}.target={target} is not a class or function")
            if inspect.isclass(entry):
                self.check_methods(entry, label)
        elif name == CUSTOM:
            raise BadInput(f"{self.family}={CUSTOM} needs {self.family}.target=module.Name, "
                           f"a class on PYTHONPATH implementing {self.what} (docs/extending.md)")
        else:
            check_choice(self.family, name, [*self._entries, CUSTOM])
            entry, label = self._entries[name], name
            if isinstance(entry, str):
                entry = self._entries[name] = import_target(entry, self.family)
        names, takes_any = _parameters(entry)
        settings = [n for n in names if n not in self.context_keys]
        unknown = [k for k in params
                   if k in self.context_keys or (k not in names and not takes_any)]
        if unknown:
            allowed = ["name", *(["target"] if target else []), *settings,
                       *self.run_keys, *run_keys]
            raise BadInput(f"{self.family}.{unknown[0]} is not a setting of "
                           f"{self.family}={label}; allowed: {', '.join(dict.fromkeys(allowed))}"
                           + did_you_mean(unknown[0], allowed))
        params = {k: check_setting(f"{self.family}.{k}", names.get(k), v)
                  for k, v in params.items()}
        return Resolved(self, label, entry, params)

    def build(self, group: Mapping[str, Any] | str, **context: Any) -> Any:
        """`resolve` the group and build its object with ``context``."""
        return self.resolve(group).build(**context)
