"""The engine as a server: an OpenAI-compatible HTTP API (`python -m testbed.serve`) over the shared
scheduler and cache, stepped on wall-clock time in one background loop."""
