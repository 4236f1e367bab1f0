"""The benchmarks: how fast the project's code runs.

- `cache`: replay speed of the prefix caches against plain Python trees and SGLang's RadixCache
  (``make bench``).
- `engine`: the real engine on the CPU, what prefix sharing buys and costs.
- `traces`: traces of any length for `cache`'s scaling table, made one request at a time.
- `trees`: the plain Python radix trees (and SGLang's) that `cache` races the caches against.
"""
