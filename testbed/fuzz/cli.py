"""``python -m testbed.fuzz --runs N --seed S``: random configs run in-process, each checked.

Every run composes its overrides as ``python -m testbed.run`` does (`compose_config`: an override
Hydra cannot apply is refused in one line), with ``debug.check_invariants=true`` (the cache
checked after every step, no lease or lock left at the end) and ``save_token_ids=true``, and goes
through the same `testbed.execute.execute`. A run passes when it finishes with consistent files
(`testbed.fuzz.checks`) or is refused with a one-line `BadInput`, before the workload is
generated (the assembly step, or a generator's check of its own values) unless the refusal is of
the workload's requests (`WorkloadRefused`) or the live server's of its calls
(``backend=server``); a malformed trace must be refused, naming its file once the config passed
assembly; a share of the runs (``--repeat``) runs twice and must give the same summary. Every
other outcome is a failure (a config still running after ``--timeout`` seconds too: a hang),
printed with the command line that reproduces it (for ``backend=server``, after the
``testbed.serve`` line that starts the fuzzer's server, and for a config sent through the live
router, the second server's and ``testbed.route``'s lines).

The files the configs read (`testbed.fuzz.fixtures`) are written into the run's temporary folder
first; the server is started in the background then, waited for by the first ``backend=server``
config; the router and its second server start with the first config sent to the router
(`testbed.fuzz.server`); all stop at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from testbed.config.assembly import assemble
from testbed.errors import BadInput, WorkloadRefused
from testbed.fuzz.bad_traces import malformed_kind
from testbed.fuzz.checks import check_run, comparable
from testbed.fuzz.fixtures import Fixtures
from testbed.fuzz.server import ROUTER_URL, URL, FuzzRouter, FuzzServer, router_config, \
    server_config
from testbed.fuzz.space import after_requests, draw
from testbed.execute import execute
from testbed.config.overrides import compose_config

ALWAYS = ["debug.check_invariants=true", "save_token_ids=true"]
# a config's limit: the slowest of seed 6006's 9,063 finished configs ran 195 s, on the 2-core
# machine with other jobs beside it
TIMEOUT_S = 600.0


@dataclass
class Outcome:
    overrides: list[str]
    status: str  # ok | refused | failed
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    refusal: str | None = None  # the one line a refused config got
    server: str | None = None  # backend=server: the command that starts the fuzzer's server

    @property
    def command(self) -> str:
        run = " ".join(["python -m testbed.run", *self.overrides, *ALWAYS])
        return f"{self.server} & {run}" if self.server else run


def run_one(overrides: list[str], cfg: DictConfig | None, run_dir: Path,
            repeat: bool) -> Outcome:
    """Run and check one config (twice with ``repeat``); ``cfg`` is its composed config (None:
    composing it failed, and composing again reports why)."""
    started = time.perf_counter()
    outcome = Outcome(overrides, "ok")
    assembled = False  # the config checked: what is refused now is the workload
    generated = False  # assembled and generated: only the workload's requests may be refused
    try:
        summaries = []
        for attempt in range(2 if repeat else 1):
            if cfg is None:
                cfg = compose_config([*overrides, *ALWAYS])
            run = assemble(cfg)  # refusals of config values end here (cfg is only read)
            assembled = True
            run.requests()
            generated = True
            target = run_dir / str(attempt)
            execute(cfg, target, notes=[])
            summaries.append(json.loads((target / "summary.json").read_text()))
            outcome.problems += check_run(target, summaries[-1])
        if repeat and comparable(summaries[0]) != comparable(summaries[1]):
            first, second = comparable(summaries[0]), comparable(summaries[1])
            diff = sorted(k for k in first if first.get(k) != second.get(k))
            outcome.problems.append(f"the same seed gave another summary: {diff[:6]}")
    except BadInput as e:
        outcome.status = "refused"
        outcome.refusal = str(e)
        if "\n" in str(e) or not str(e):
            outcome.problems.append(f"a refusal not in one line: {str(e)!r}")
        if generated and not isinstance(e, WorkloadRefused) and not served(overrides):
            outcome.problems.append(f"a config refused after the workload was generated (its "
                                    f"check belongs in testbed.config.assembly): {e}")
    except Exception as e:  # noqa: BLE001 - any other exception is a defect to report
        tb = traceback.format_exc(limit=-4)
        outcome.problems.append(f"internal error: {type(e).__name__}: {e}\n{tb}")
    outcome.problems += malformed_trace_problems(overrides, outcome, assembled)
    if outcome.problems:
        outcome.status = "failed"
    outcome.seconds = time.perf_counter() - started
    return outcome


def served(overrides: list[str]) -> bool:
    """A ``backend=server`` config: the server's refusal of its calls (a sampling setting it does
    not serve) is known only once they are sent, after the workload was generated."""
    return "backend=server" in overrides


def malformed_trace_problems(overrides: list[str], outcome: Outcome, assembled: bool
                             ) -> list[str]:
    """A malformed trace (`testbed.fuzz.bad_traces`) must not run, and once the config passed
    assembly its refusal must name the file: one line starting with ``PATH:``."""
    kind = malformed_kind(overrides)
    if kind is None or outcome.problems:
        return []
    if outcome.status == "ok":
        return [f"a malformed trace ({kind}) ran"]
    path = next(o.partition("=")[2] for o in overrides if o.startswith("workload.path="))
    if assembled and not outcome.refusal.startswith(f"{path}:"):
        return [f"a malformed trace ({kind}) refused without naming its file: {outcome.refusal}"]
    return []


@dataclass
class Session:
    """What every config of one fuzz run shares: its work folder, the files its configs read,
    whether Vidur's profile is here, its server and its router (each started on first use)."""
    workdir: Path
    fixtures: Fixtures
    server: FuzzServer
    router: FuzzRouter
    vidur: bool = False

    @classmethod
    def start(cls, workdir: Path, seed: int) -> Session:
        from testbed.data import is_here, lookup

        fixtures = Fixtures(workdir / "fixtures")
        fixtures.write()
        server = FuzzServer(server_config(seed, fixtures.checkpoint))
        return cls(workdir, fixtures, server, FuzzRouter(router_config(seed), server),
                   is_here(lookup("vidur_a100_codellama34b_tp2")))

    def live(self, overrides: list[str]) -> list[str]:
        """``overrides`` with the live server's (or router's) URL for the placeholder a draw
        writes."""
        live = {f"server.url={URL}": self.server, f"server.url={ROUTER_URL}": self.router}
        return [f"server.url={live[o].url}" if o in live else o for o in overrides]

    def command(self, overrides: list[str]) -> str | None:
        """What starts the live server (and router) a ``backend=server`` config was sent to."""
        if self.router.handle is not None and f"server.url={self.router.url}" in overrides:
            return f"{self.server.command()} & {self.router.command()}"
        return self.server.command() if "backend=server" in overrides else None

    def stop(self) -> None:
        self.router.stop()
        self.server.stop()


def draw_config(rng: np.random.Generator, session: Session,
                index: int) -> tuple[list[str], DictConfig | None]:
    """A config with what depends on the workload's requests drawn against them (the capacity;
    `testbed.fuzz.space.after_requests`): its overrides and its composed config (None where
    composing or generating failed: `run_one` reports why). A ``backend=server`` config gets the
    live server's URL (the server starts here on first use)."""
    overrides = session.live(draw(rng, session.workdir, index, session.fixtures, session.vidur))
    # The file of accepted drafts a recorded config names is written from the requests, which
    # are generated first; assembly reads it, so a stand-in of one record is there meanwhile
    # (and stays where the config is refused: the refusal is then the config's own).
    path = next((o.partition("=")[2] for o in overrides
                 if o.startswith("speculative.acceptance_path=")), None)
    if path is not None:
        Path(path).write_text(json.dumps({"id": "none", "spec_accepted": [0]}) + "\n")
    try:
        cfg = compose_config([*overrides, *ALWAYS])
        requests = assemble(cfg).requests()
    except Exception:  # refused or broken: let run_one find and report it
        return overrides, None
    backend = overrides[0].partition("=")[2]
    more = after_requests(rng, overrides, requests, backend)
    for item in more:
        key, _, value = item.partition("=")
        OmegaConf.update(cfg, key, None if value == "null" else int(value), merge=False)
    return overrides + more, cfg


class Hang(BaseException):
    """A config ran past ``--timeout`` (a BaseException: `run_one` reports every Exception)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `Hang` in the main thread after ``seconds`` of wall time (0: no limit). A
    livelocked loop is Python code, where the signal lands between two bytecodes."""
    if seconds <= 0:
        yield
        return

    def expired(*_: object) -> None:
        raise Hang()

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def run_drawn(rng: np.random.Generator, session: Session, index: int,
              repeat_share: float, timeout_s: float = 0.0) -> Outcome:
    """Draw config ``index`` and run it (`run_one`) in its own folder, removed afterwards; one
    that runs past ``timeout_s`` (0: no limit) is a failure, a hang."""
    try:
        overrides, cfg = draw_config(rng, session, index)
    except Exception as e:  # noqa: BLE001 - the fuzzer's own server did not start: a defect
        return Outcome([], "failed", [f"internal error: the fuzzer's testbed.serve (or its "
                                      f"router) did not start: {type(e).__name__}: {e}"],
                       server=f"{session.server.command()} & {session.router.command()}")
    repeat = rng.random() < repeat_share
    started = time.perf_counter()
    try:
        with time_limit(timeout_s):
            outcome = run_one(overrides, cfg, session.workdir / f"run{index}", repeat=repeat)
    except Hang:
        tb = traceback.format_exc(limit=-4)
        outcome = Outcome(overrides, "failed", [f"no result after {timeout_s:g} s (--timeout): "
                                                f"a hang or a livelock\n{tb}"],
                          seconds=time.perf_counter() - started)
    outcome.server = session.command(overrides)
    shutil.rmtree(session.workdir / f"run{index}", ignore_errors=True)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.fuzz", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="configs to draw and run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--repeat", type=float, default=0.25,
                        help="share of runs run twice to check the same seed's summary")
    parser.add_argument("--out", type=Path, default=None,
                        help="write every outcome here as JSON lines (failures in full)")
    parser.add_argument("--verbose", action="store_true", help="print every config drawn")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help="seconds a config may run before it counts as a hang (0: no limit)")
    args = parser.parse_args(argv)
    if args.runs < 1 or not 0.0 <= args.repeat <= 1.0 or args.timeout < 0:
        print("error: --runs must be >= 1, --repeat in [0, 1] and --timeout >= 0",
              file=sys.stderr)
        return 2
    # stopped by SIGTERM (a timeout, kill PID): exit through the finally below, which stops the
    # fuzzer's server, instead of leaving its process behind
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return fuzz(args)
    finally:
        signal.signal(signal.SIGTERM, before)


def fuzz(args: argparse.Namespace) -> int:
    """Draw, run and report ``args.runs`` configs (`main`'s arguments)."""
    rng = np.random.default_rng(args.seed)
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    log = args.out.open("w") if args.out else None
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        session = Session.start(Path(tmp), args.seed)
        try:
            session.server.start()  # in the background: it loads while the first configs run
            bar = tqdm(range(args.runs), desc="fuzz", unit="run", disable=None)
            for i in bar:
                outcome = run_drawn(rng, session, i, repeat_share=args.repeat,
                                    timeout_s=args.timeout)
                outcomes.append(outcome)
                if args.verbose:
                    tqdm.write(f"{outcome.status}: {' '.join(outcome.overrides)}")
                if outcome.status == "failed":
                    tqdm.write(f"FAILED #{i}: {outcome.problems[0].splitlines()[0]}\n"
                               f"  {outcome.command}")
                if log is not None:
                    log.write(json.dumps({"index": i, "status": outcome.status,
                                          "seconds": round(outcome.seconds, 4),
                                          "overrides": outcome.overrides,
                                          "problems": outcome.problems,
                                          "refusal": outcome.refusal}) + "\n")
                    log.flush()
                bar.set_postfix(Counter(o.status for o in outcomes))
        finally:
            session.stop()
    if log is not None:
        log.close()
    return report(outcomes, time.perf_counter() - started)


def report(outcomes: list[Outcome], seconds: float) -> int:
    """Print what was drawn and what failed; exit status 1 if anything failed."""
    counts = Counter(o.status for o in outcomes)
    drawn = Counter(part for o in outcomes for part in o.overrides if part.split("=")[0] in (
        "backend", "workload", "cache", "eviction", "scheduler", "router"))
    print(f"{len(outcomes)} configs in {seconds:.0f} s: {counts['ok']} ran, "
          f"{counts['refused']} refused in one line, {counts['failed']} failed")
    print("drawn: " + ", ".join(f"{k} {v}" for k, v in sorted(drawn.items())))
    bad = Counter(k for o in outcomes if (k := malformed_kind(o.overrides)) is not None)
    if bad:
        print(f"malformed traces: {sum(bad.values())} (" +
              ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) + ")")
    reasons = Counter(re.sub(r"\d+", "N", o.refusal) for o in outcomes if o.refusal)
    if reasons:
        print("refused, most common first:")
        for reason, n in reasons.most_common(8):
            print(f"  {n:5d}  {reason[:150]}")
    failures = [o for o in outcomes if o.status == "failed"]
    distinct: dict[str, Outcome] = {}
    for o in failures:
        distinct.setdefault(o.problems[0].splitlines()[0][:120], o)
    for first, o in distinct.items():
        print(f"\nFAILED: {first}\n  {o.command}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
