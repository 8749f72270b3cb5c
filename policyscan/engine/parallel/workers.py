"""Worker processes: one per device of this host, each loading its own Engine once and scoring the units
(engine/inputs/units.py) the parent hands it. Workers never write a file: they send what the single-process pipeline
would write, and the parent writes it in input order (engine/parallel/workers_run.py).

Triton's compile cache is on disk (~/.triton/cache, or $TRITON_CACHE_DIR) and filled by atomic renames, so the
workers share it with no help: a kernel compiled once is loaded from disk by every later process (workers
starting at the same moment may each compile one kernel, writing the same file)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from policyscan.engine.errors import PolicyError, PolicyscanError
from policyscan.engine.inputs.units import Unit
from policyscan.engine.parallel.worker_start import context
from policyscan.engine.parallel.workers_proc import worker_main
from policyscan.engine.policy.bundle import Policy, fingerprint
from policyscan.engine.settings import EngineSettings

DEPTH = 2     # units a worker holds: the one it scores and the next, which its reader thread reads meanwhile
RESTARTS = 2  # times a device's worker is started again after it died (an OOM is often a one-off)
STOP_SECONDS = 10.0  # a clean stop waits this long for a worker to exit before it is killed


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker loads, and the devices: one worker each ("cpu", or a CUDA device's index). `policies`:
    bundles or folders of them, as load_policies takes them; each worker reads them itself (a run's adapters
    can be hundreds of MB in fp32, too much to pickle through a pipe to every worker: docs/performance.md), and
    WorkerPool.expect checks that it read what the parent did."""

    model_dir: Path
    policies: tuple[str | Path, ...]
    settings: EngineSettings
    devices: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.devices:
            raise PolicyscanError("no devices to run workers on")
        if any(not (d == "cpu" or d.isdigit()) for d in self.devices) or len({d == "cpu" for d in self.devices}) > 1:
            raise PolicyscanError(f"worker devices {', '.join(self.devices)}: all 'cpu', or all CUDA device indices")
        allowed = ("auto", "cpu") if self.devices[0] == "cpu" else ("auto", "cuda")
        if self.settings.device not in allowed:
            raise PolicyscanError(f"--device {self.settings.device} names one device; with several workers choose "
                                  "GPUs with --devices, or use --device cpu with --workers")

    def label(self, slot: int) -> str:
        d = self.devices[slot]
        return d if d == "cpu" else f"cuda:{d}"


@dataclass(frozen=True)
class Event:
    """What the parent's scheduler hears: a unit's part or its end, or a worker's death with the units it held."""

    kind: str  # "part", "done", "died"
    unit: int | None = None
    payload: object = None  # part: the part; died: why
    units: tuple[int, ...] = ()  # died: the units it held

    def __post_init__(self) -> None:
        if self.kind not in ("part", "done", "died"):
            raise ValueError(f"unknown event {self.kind!r}")


@dataclass
class Worker:
    slot: int
    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    described: bool = False
    units: list[int] = field(default_factory=list)  # sent and not done, in the order sent
    reason: str | None = None  # what the worker said before it died
    read: list[str] | None = None  # the fingerprints of the policies it loaded (once ready)


class WorkerPool:
    """Starts the workers, hands them units, restarts one that dies, stops them all (also on Ctrl-C)."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.policies: list[Policy] | None = None  # the parent's, once expect() has them
        self._ctx = context()  # a fork server's or spawn: a plain fork would copy a parent's CUDA state and threads
        self._restarts = [RESTARTS] * len(config.devices)
        self._loaded = [False] * len(config.devices)  # a slot whose worker loaded once: a later failure is a death
        self._described: tuple[dict, dict] | None = None
        self.deaths: list[str] = []  # why each worker died, for the run's summary
        self.workers: list[Worker | None] = []
        try:
            self.workers = [self._start(slot) for slot in range(len(config.devices))]
        except BaseException:
            self.close(clean=False)
            raise

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(clean=exc_type is None)

    @property
    def devices(self) -> list[str]:
        return [self.config.label(s) for s in range(len(self.config.devices))]

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w is not None]

    def _start(self, slot: int) -> Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main, args=(child, self.config, slot,
                                                           dict(os.environ)), daemon=True,
                                 name=f"policyscan-worker-{self.config.label(slot)}")
        proc.start()
        child.close()
        return Worker(slot, proc, parent)

    def expect(self, policies: list[Policy]) -> None:
        """The policies the parent read from config.policies: every worker must have read the same (checked now
        for those that said so, else when they do); the outputs' metadata is written from these."""
        self.policies = list(policies)
        for w in self.workers:
            if w is not None and w.read is not None and (changed := self._changed(w)):
                raise PolicyError(f"the policies changed while the run started ({changed}: the worker on "
                                  f"{self.config.label(w.slot)} read other weights, scales or settings than this "
                                  "process); run again")

    def _changed(self, w: Worker) -> str:
        """The paths of the policies `w` read otherwise than the parent, or "" (also before expect())."""
        if self.policies is None or w.read is None:
            return ""
        mine = [fingerprint(p) for p in self.policies]
        if w.read == mine:
            return ""
        return ", ".join(str(p.path) for p, a, b in zip(self.policies, mine, w.read) if a != b) or \
            ", ".join(str(p.path) for p in self.policies)

    def ready_workers(self) -> list[Worker]:
        return [w for w in self.workers if w is not None and w.ready]

    def send(self, worker: Worker, unit: Unit, attempt: int, spec, strict: bool) -> None:
        worker.units.append(unit.index)
        worker.conn.send((unit, attempt, spec, strict))

    def events(self, timeout: float | None = None) -> list[Event]:
        """Wait for messages or deaths; handles readiness, metadata and restarts itself."""
        live = [w for w in self.workers if w is not None]
        if not live:
            raise PolicyscanError("every worker process died; no output was written")
        fired = set(wait([w.conn for w in live] + [w.process.sentinel for w in live], timeout))
        out: list[Event] = []
        for w in live:
            ended = w.process.sentinel in fired
            if w.conn in fired:
                ended |= self._receive(w, out)
            if ended:
                out.append(self._died(w))
        return out

    def _receive(self, w: Worker, out: list[Event]) -> bool:
        """Every whole message waiting from `w`; True when its end is closed (it exited, or is exiting)."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), out)
        except (EOFError, OSError):  # a message cut short by the worker's death is no message
            return True
        return False

    def _handle(self, w: Worker, msg: tuple, out: list[Event]) -> None:
        kind = msg[0]
        if kind == "ready":
            w.read, restarted = msg[2], self._loaded[w.slot]
            if (changed := self._changed(w)) and restarted:  # the run goes on without this slot, as on "fatal"
                w.reason, self._restarts[w.slot] = f"read other policies than the run's when it started again " \
                                                   f"({changed}): given up", 0
                w.process.terminate()
                return
            if changed:
                self.expect(self.policies)  # raises, saying which
            w.ready = self._loaded[w.slot] = True
        elif kind == "describe":
            self._check_same(w, msg[1], msg[2])
            w.described = True
        elif kind == "fatal" and not self._loaded[w.slot]:
            raise PolicyscanError(f"the worker on {self.config.label(w.slot)} could not start: {msg[1]}")
        elif kind == "fatal":  # it loaded before (an OOM may leave too little memory to load again): given up
            w.reason, self._restarts[w.slot] = f"could not start again: {msg[1]}", 0
        elif kind == "crash":
            w.reason = msg[1]
        elif kind == "part":
            out.append(Event("part", msg[1], msg[2]))
        elif kind == "done":
            w.units.remove(msg[1])
            out.append(Event("done", msg[1]))
        else:
            raise RuntimeError(f"unknown message {kind!r} from a worker")

    def _check_same(self, w: Worker, described: dict, file_hashes: dict) -> None:
        """Every worker must compute the same bits: same GPU model, precision, tokenizer, model files."""
        if self._described is None:
            self._described = described, file_hashes
            return
        first = self._described[0]
        differ = sorted(k for k in first.keys() | described.keys() if first.get(k) != described.get(k))
        if differ:
            raise PolicyscanError(f"the worker on {self.config.label(w.slot)} differs from the first one in "
                                  f"{', '.join(differ)} ({', '.join(f'{k}: {described.get(k)}' for k in differ)}); "
                                  "their scores would not be bitwise the same: use devices of one kind")

    def _died(self, w: Worker) -> Event:
        w.process.join(STOP_SECONDS)
        if w.process.exitcode is None:  # closed its end yet still running: it is of no use
            w.process.kill()
            w.process.join()
        w.conn.close()
        why = w.reason or _exit_reason(w.process.exitcode)
        event = Event("died", payload=f"the worker on {self.config.label(w.slot)} {why}", units=tuple(w.units))
        self.deaths.append(event.payload)
        self.workers[w.slot] = None
        if self._restarts[w.slot] > 0:
            self._restarts[w.slot] -= 1
            self.workers[w.slot] = self._start(w.slot)
        return event

    def describe(self) -> dict:
        """Engine.describe(), once every loaded worker sent its own and all agree (run_key takes a pool too)."""
        return self._agreed()[0]

    def file_hashes(self) -> dict:
        """The model's file hashes (Checkpoint.file_hashes), as the workers took them."""
        return self._agreed()[1]

    def _agreed(self) -> tuple[dict, dict]:
        while self._described is None or not all(w.described for w in self.ready_workers()):
            if any(w is not None and w.units for w in self.workers):
                raise RuntimeError("describe() waits only between runs, with no unit in flight")
            self.events(1.0)
        return self._described

    def close(self, clean: bool = True) -> None:
        """Stop every worker: asked to finish (clean), else terminated at once; killed if they linger."""
        live = [w for w in self.workers if w is not None]
        self.workers = [None] * len(self.workers)
        for w in live:  # one still loading has nothing to finish
            try:
                w.conn.send(None) if clean and w.ready else w.process.terminate()
            except (OSError, ValueError):
                w.process.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for w in live:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join()
            w.conn.close()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        oom = " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with status {code}"


def parse_devices(text: str, gpus: int) -> tuple[str, ...]:
    """--devices: all, a count N (the first N GPUs), or a list of indices such as 0,2 (as CUDA numbers them)."""
    if gpus < 1:
        raise PolicyscanError("--devices: no CUDA GPU is visible; use --device cpu (with --workers N)")
    text = text.strip()
    if text == "all":
        return tuple(str(i) for i in range(gpus))
    if text.isdigit() and "," not in text:
        n = int(text)
        if not 1 <= n <= gpus:
            raise PolicyscanError(f"--devices {text}: give 1 to {gpus} (this host has {gpus} GPUs), or a list")
        return tuple(str(i) for i in range(n))
    picked = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in picked if not p.isdigit() or int(p) >= gpus]
    if not picked or bad or len(set(picked)) != len(picked):
        raise PolicyscanError(f"--devices {text}: expected all, a count, or distinct GPU indices below {gpus} "
                              "separated by commas, such as 0,2")
    return tuple(str(int(p)) for p in picked)
