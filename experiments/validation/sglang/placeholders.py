"""An import hook that serves a wheel's ``sglang`` modules: the real ones from the unzipped
wheel, every other one as a placeholder (`wheel.load_hooked`, for 0.5.23).

A placeholder module is empty, and each name imported from it is a placeholder class:
constructible with anything, every attribute of it another placeholder, every attribute of its
instances a no-op. Third-party packages the real modules import at the top but our path never
uses (`THIRD_PARTY`) are placeholders too where they are not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

# unified_tree_core encodes KV events with msgspec
THIRD_PARTY = {"msgspec"}


def _noop(*args, **kwargs) -> None:
    return None


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(name)


def placeholder(name: str) -> type:
    """A class standing for an imported name: constructible with anything, every attribute of it
    another placeholder, every attribute of its instances a no-op."""
    return _PlaceholderMeta(name, (), {"__init__": _noop, "__getattr__": lambda self, a: _noop})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(name)
        setattr(self, name, value)
        return value


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sglang.*``: the ``real`` modules from the unzipped wheel at ``root``,
    placeholders otherwise."""

    def __init__(self, root: Path, real: set[str]) -> None:
        self.root, self.real = root, real

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in THIRD_PARTY:
            others = [f for f in sys.meta_path if f is not self]
            if any(f.find_spec(fullname, path, target) for f in others
                   if hasattr(f, "find_spec")):
                return None  # installed: the real one
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in self.real:
            folder = self.root / "/".join(fullname.split(".")[:-1])
            return importlib.machinery.PathFinder.find_spec(fullname, [str(folder)])
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass
