"""A fuzzer over the whole config space: ``python -m testbed.fuzz --runs N --seed S``.

`space` draws configs, `checks` checks a finished run's files, `cli` runs and reports them.
"""
