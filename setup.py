"""The one compiled part: the replay's hot loops in C (testbed/cache/native.py). Everything else
is in pyproject.toml. ``optional``: where no C compiler is found the install goes on without it,
and the same loops run in Python (slower, with the same results)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("testbed.cache._radix_core", ["testbed/cache/_radix_core.c"],
                             optional=True)])
