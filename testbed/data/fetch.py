"""Fetching registered traces into the data folder, and resolving ``data:NAME`` trace paths.

The data folder is ``$TESTBED_DATA`` when set, else ``radix-testbed/data`` under the user's cache
directory (``$XDG_CACHE_HOME``, default ``~/.cache``). A download goes to a temporary file in that
folder and is renamed to its name only after its SHA-256 matched the registry's, so a file there
under a trace's name is either the pinned file or one a user put there by hand; a file found
there is hashed again on every use (a few milliseconds for these traces) and refused if it is not
the pinned one. ``$TESTBED_DATA_MIRROR`` (a base URL) fetches ``MIRROR/FILENAME`` instead of the
registry's URL, with the same check: for machines behind a proxy, and the tests.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from http.client import HTTPException
from pathlib import Path
from typing import NamedTuple
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from tqdm import tqdm

from testbed.data.registry import TRACES, Trace
from testbed.errors import BadInput

PREFIX = "data:"  # workload.path=data:NAME
CHUNK = 1 << 16
TIMEOUT_S = 60  # per socket operation, not for the whole download


class DataError(BadInput):
    """A trace that cannot be had; the message is one line saying what to do."""


class Fetched(NamedTuple):
    path: Path
    sha256: str
    verified: bool  # the hash matched the registry's (False: the entry is not pinned)
    downloaded: bool  # False: it was already in the data folder


def data_dir() -> Path:
    """Where traces land: ``$TESTBED_DATA``, else ``$XDG_CACHE_HOME/radix-testbed/data``
    (``~/.cache/radix-testbed/data`` when XDG_CACHE_HOME is unset)."""
    if os.environ.get("TESTBED_DATA"):
        return Path(os.environ["TESTBED_DATA"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "radix-testbed" / "data"


def lookup(name: str) -> Trace:
    try:
        return TRACES[name]
    except KeyError:
        raise DataError(f"{PREFIX}{name}: unknown trace; known: {', '.join(TRACES)} "
                        "(python -m testbed.data list)") from None


def local_path(trace: Trace) -> Path:
    return data_dir() / trace.filename


def source_url(trace: Trace) -> str:
    """The registry's URL, or the same file on ``$TESTBED_DATA_MIRROR``."""
    mirror = os.environ.get("TESTBED_DATA_MIRROR")
    return f"{mirror.rstrip('/')}/{trace.filename}" if mirror else trace.url


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def download(url: str, dest: Path, sha256: str | None, size: int | None = None,
             desc: str | None = None) -> str:
    """Download ``url`` to ``dest`` and return its SHA-256. The bytes go to a temporary file
    beside ``dest``, renamed to ``dest`` only when their hash is ``sha256`` (any hash when None);
    on a mismatch or a failure nothing is left behind. ``DataError`` names what went wrong."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data folder {dest.parent} ({_one_line(e)}); "
                        "set TESTBED_DATA to a writable folder") from None
    fd, part = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urlopen(url, timeout=TIMEOUT_S) as response:
                    total = int(response.headers.get("Content-Length") or 0) or size
                    with tqdm(total=total, desc=desc or dest.name, unit="B", unit_scale=True,
                              unit_divisor=1024, disable=None, leave=False) as bar:
                        while chunk := response.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
            except HTTPError as e:
                raise _offline(url, dest, f"HTTP {e.code} {e.reason}", desc) from None
            except URLError as e:
                raise _offline(url, dest, e.reason, desc) from None
            except (OSError, HTTPException) as e:  # timeouts, resets, truncated bodies
                raise _offline(url, dest, e or type(e).__name__, desc) from None
        got = digest.hexdigest()
        if sha256 is not None and got != sha256:
            raise DataError(f"{url}: sha256 mismatch, expected {sha256}, got {got}; "
                            "the download was discarded")
        os.chmod(part, 0o644)  # mkstemp's 0600 would hide a shared data folder's files
        os.replace(part, dest)
        return got
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise


def _offline(url: str, dest: Path, reason: object, name: str | None = None) -> DataError:
    """What to do without the network: fetch the trace ``name`` where its URL is reachable, or
    put its file where the run looks for it."""
    elsewhere = f"run python -m testbed.data fetch {name} where it is reachable, or " \
        if name else ""
    return DataError(f"could not download {url} ({_one_line(reason)}); "
                     f"{elsewhere}put the file there by hand: {dest}")


def fetch(trace: Trace) -> Fetched:
    """The trace's file in the data folder, downloaded if it is not there yet."""
    path = local_path(trace)
    if path.is_file():
        got = sha256_of(path)
        if trace.pinned and got != trace.sha256:
            raise DataError(f"{PREFIX}{trace.name}: {path} has sha256 {got}, expected "
                            f"{trace.sha256}; delete it and fetch it again")
        return Fetched(path, got, trace.pinned, downloaded=False)
    try:
        got = download(source_url(trace), path, trace.sha256, trace.size, desc=trace.name)
    except DataError as e:
        raise DataError(f"{PREFIX}{trace.name}: {e}") from None
    return Fetched(path, got, trace.pinned, downloaded=True)


def describe_fetch(trace: Trace, got: Fetched) -> str:
    """One line for the user: where the file is and whether its hash was checked."""
    verb = "fetched into" if got.downloaded else "already at"
    if got.verified:
        return f"{trace.name}: {verb} {got.path} (sha256 {got.sha256}, verified)"
    return (f"{trace.name}: {verb} {got.path} (sha256 {got.sha256}, UNVERIFIED: the registry "
            "pins no hash for it)")


def resolve_trace(path: str | Path, fmt: str | None = None) -> tuple[Path, str | None]:
    """``workload.path`` and ``workload.format`` as a loader needs them. A plain path is returned
    as it is. ``data:NAME`` becomes NAME's file in the data folder (fetched on first use, with a
    note on stderr) and its registered format; a ``fmt`` given must be that format."""
    text = str(path)
    if not text.startswith(PREFIX):
        return Path(path), fmt
    trace = lookup(text[len(PREFIX):])
    if fmt is not None and fmt != trace.format:
        raise DataError(f"workload.format={fmt} does not fit {text} (format {trace.format}); "
                        f"set workload.format={trace.format} or leave it unset")
    got = fetch(trace)
    if got.downloaded or not got.verified:
        print(f"note: {describe_fetch(trace, got)}", file=sys.stderr)
    return got.path, trace.format
