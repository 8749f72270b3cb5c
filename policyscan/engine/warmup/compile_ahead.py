"""Compile a run's GPU kernel variants in parallel before its first batch.

Triton compiles a kernel variant the first time a process launches it, one after another inside the first batches: on a
fresh machine that compile took longer than the rest of the run (docs/performance.md), and an 8-row file compiled the
small-batch variants again. Here a dry run of the decoder (the prefixes' prefill, one eager batch per specialization
class, each CUDA-graph bucket) launches nothing: every Triton launch runs as a warm-up, and Triton's jit_cache_hook
records each variant this process has not loaded yet and skips its compile. A run not compiled before starts child
processes first (start_compilers; on a fresh machine the command line started them, engine/warmup/compile_start.py),
dry-runs a decoder of the model's shapes with its weights unread (loader.shaped_decoder: shapes, dtypes and strides
decide the variants, values do not), handing each variant to the children as it meets it, and the children compile them
into Triton's disk cache (engine/warmup/compile_procs.py) during the dry run and while the weights load (CompileJob);
the real batches then load the kernels from disk. Anything failing on the way (no child process, a read-only cache) only
leaves those kernels to compile at launch. The dry run computes nothing that is kept, and a variant it missed compiles
when first launched, as before: what a run computes does not change, only when kernels compile.

A marker per variant beside Triton's cache (policyscan_variants/) says it compiled there, so a warm machine starts no
child process, and a manifest per run configuration lists its variants, so a repeated nightly run skips the dry run too
(docs/performance.md); wiping Triton's cache wipes both with it."""
from __future__ import annotations

import hashlib
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from policyscan.engine.files import in_background
from policyscan.engine.model.model import Decoder
from policyscan.engine.run.graphs import GraphedForward, static_batch
from policyscan.engine.warmup import compile_start
from policyscan.engine.warmup.compile_procs import Compilers

# Mean seconds from a variant's hand-out to its answer, per kernel, measured on a fresh start (docs/performance.md,
# start-up: seconds summed over each kernel's variants): of the variants waiting for a worker, the slowest go first
COMPILE_SECONDS = {"_lora_gemm_ws_kernel": 5.7, "_prologue_kernel": 3.5, "_lora_gemm_tma_kernel": 2.9,
                   "_prologue_ws_kernel": 0.9, "_lora_gemm_kernel": 0.9, "_attn_kernel": 0.85}
_LOCK = threading.Lock()  # one dry run at a time: each patches Triton for the whole process
_LOCAL = threading.local()  # .on: this thread is in a dry run (other threads' launches run as usual)


@dataclass(frozen=True)
class Variant:
    module: str  # the kernel's module and name: what a child process imports
    name: str
    data: str    # Triton's serialized specialization (JITFunction.preload takes it)
    source: str  # the kernel's source hash (JITFunction.cache_key): an edited kernel is a new variant

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.module}.{self.name}\0{self.source}\0{self.data}".encode()).hexdigest()


@dataclass(frozen=True)
class CompileReport:
    variants: int   # variants the dry run met
    compiled: int   # of them compiled ahead in child processes (none on a warm machine)
    failed: int     # that no child compiled: they compile when first launched
    workers: int
    seconds: float

    def describe(self) -> str:
        if not self.compiled and not self.failed:
            return f"{self.variants} kernel variants cached"
        failed = f", {self.failed} left to compile when launched" if self.failed else ""
        return f"{self.compiled} of {self.variants} kernel variants compiled in {self.workers} processes{failed}"


def shape_classes(batch_tokens: int, graphs: bool) -> list[tuple[int, int]]:
    """(tokens, sequences) of the dry run's batches. The kernels leave row and sequence counts unspecialized
    (do_not_specialize), so a variant follows the launch knobs (kernels/tuning.py): the GEMM's kernel and tiles follow
    its rows (<= 256, <= 2048 with tiles that depend on N, the Gluon kernel from 1025; the TMA kernel's NUM_PROGS their
    count's next power of two), so one batch's tokens in each class, and since the last layer runs its sequences' last
    tokens only, its sequences too. The sequence counts cover the batch widths of the workload they were chosen on (W1,
    docs/performance.md); a width whose classes fall between them compiles that variant at its first launch, as without
    compile_ahead. Eager batches are those over the CUDA graphs' range; the graphs' buckets (tokens, and 8 or 16+
    sequence slots) each once."""
    low = GraphedForward.MAX_TOKENS + 16 if graphs else 16
    sizes = sorted({m for m in (64, 512, 1040, 2112, low) if low <= m <= batch_tokens - 1})
    seqs = (64, 320, 512, 704, 1040, 2112)
    eager = [(t, 64) for t in sizes if t >= 64] + ([(sizes[-1], b) for b in seqs if b <= sizes[-1]] if sizes else [])
    eager = list(dict.fromkeys(eager))
    if not graphs:
        return eager
    buckets, t = [], GraphedForward.MIN_TOKENS
    while t <= min(GraphedForward.MAX_TOKENS, batch_tokens):
        buckets += [(t, 8), (t, 16)]
        t *= 2
    return eager + buckets


def start_compilers(run_id: str) -> Compilers | None:
    """Before the model loads: None when the run's variants all compiled before (a warm machine), else the
    compiling workers the command line started (engine/warmup/compile_start.py) or workers started now, so that their
    import of torch, Triton and the kernels runs beside the load."""
    early = compile_start.take()
    if _compiled_before(run_id):
        if early is not None:
            early.kill()
        return None
    return early or Compilers.for_kernels()


class CompileJob:
    """compile_ahead's compiling, under way in the background while the dry run streams variants to it (offer,
    then finish); wait() gives the report."""

    def __init__(self, run_id: str, compilers: Compilers | None, started: float, cached: int = 0):
        """compilers None: nothing to compile, `cached` variants compiled before."""
        self.run_id, self.compilers, self.cached, self.started = run_id, compilers, cached, started
        self.variants: list[Variant] | None = None  # the dry run's, when it ended well
        self.met = 0  # variants the dry run met so far, compiled here before or not
        self.todo: list[Variant] = []  # those handed to the compilers, in the order met
        self.dry_run_seconds = 0.0  # seconds spent before the job went to the background
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order: list[int] = []  # todo's indices in the order the workers took them
        self.errors = in_background(lambda: compilers.compile(self._handed()), "policyscan-compile") \
            if compilers is not None else None

    def offer(self, v: Variant) -> None:
        """A variant the dry run met: compiled by the next free worker (the slowest kernels first of those
        waiting) unless a marker says it compiled here before."""
        self.met += 1
        if self.compilers is not None and not _marked(v):
            self.todo.append(v)
            self._queue.put((-COMPILE_SECONDS.get(v.name, 0.0), len(self.todo) - 1))

    def finish(self, variants: list[Variant] | None) -> None:
        """The dry run's end: its variants, or None when it failed (those offered still compile; no manifest)."""
        self.variants, self.dry_run_seconds = variants, time.perf_counter() - self.started
        self._queue.put((math.inf, -1))
        if not self.todo and self.compilers is not None:  # nothing to compile: the children would only compete
            self.compilers.kill()  # with the load

    def _handed(self) -> Iterator[tuple[str, str, str]]:
        while (i := self._queue.get()[1]) >= 0:
            self._order.append(i)
            v = self.todo[i]
            yield v.module, v.name, v.data

    def wait(self) -> CompileReport:
        """The compiling's end (the children closed), the markers and the manifest written; the report's seconds:
        the dry run and this wait, the part not hidden behind the load."""
        t0 = time.perf_counter()
        if self.errors is None:
            return CompileReport(self.cached, 0, 0, 0, self.dry_run_seconds + time.perf_counter() - t0)
        try:
            errors = self.errors.result()
        except Exception as e:  # noqa: BLE001  (no thread to feed them, say): they compile when launched
            errors = [f"not compiled: {e}"] * len(self._order)
        except BaseException:  # Ctrl-C, SIGTERM: no waiting for the variants under way
            self.cancel()
            raise
        workers = min(len(self.todo), len(self.compilers.workers))
        self.compilers.close()
        seconds = self.dry_run_seconds + time.perf_counter() - t0
        done = [self.todo[i] for i, err in zip(self._order, errors) if err is None]
        try:
            marks = _marker_dir()
            marks.mkdir(parents=True, exist_ok=True)
            for v in done:
                (marks / v.key).touch()
            if self.variants is not None and len(done) == len(self.todo):
                tmp = marks / f"run-{self.run_id}.{os.getpid()}.tmp"
                tmp.write_text("\n".join(v.key for v in self.variants))
                os.replace(tmp, marks / f"run-{self.run_id}")
        except OSError:  # a read-only or foreign cache folder: the next run dry-runs again, nothing worse
            pass
        return CompileReport(self.met, len(done), len(self.todo) - len(done), workers, seconds)

    def cancel(self) -> None:
        """Stop compiling (the run failed before it needed the kernels)."""
        if self.compilers is not None:
            self.compilers.kill()


def compile_ahead(decoder: Decoder, heads: list[list[int]], batch_tokens: int, graphs: bool, run_id: str,
                  compilers: Compilers | None = None) -> CompileJob:
    """The dry run on `decoder` (its weights' shapes and dtypes are what count: loader.shaped_decoder's will do),
    each variant no marker covers handed as the dry run meets it to child processes (`compilers`, from
    start_compilers, else started here), which compile in the background (see the module docstring): a
    CompileJob. run_id names everything that decides the variants (model, precision, policies, settings, kernel
    sources: variants_id); a run whose id compiled before, its every variant still marked, skips the dry run too."""
    t0 = time.perf_counter()
    known = _compiled_before(run_id)
    if known is not None:
        if compilers is not None:
            compilers.kill()
        return CompileJob(run_id, None, t0, cached=len(known))
    job = CompileJob(run_id, compilers or Compilers.for_kernels(), t0)
    variants = None
    try:
        variants = dry_run(decoder, heads, shape_classes(batch_tokens, graphs), job.offer)
    except Exception:  # noqa: BLE001  a Triton whose hooks differ: the kernels compile as launched, as before
        pass
    except BaseException:  # Ctrl-C, SIGTERM: the workers end with the dry run
        job.cancel()
        raise
    finally:
        job.finish(variants)
    return job


def variants_id(*parts: object) -> str:
    """A hash of what decides a run's kernel variants (compile_ahead's run_id): the caller's parts, Triton's
    version, the GPU, and the source of policyscan's engine and kernels (shapes, buckets, launchers)."""
    import triton

    gpu = torch.cuda.get_device_properties(torch.cuda.current_device())
    h = hashlib.sha256(repr((triton.__version__, gpu.name, gpu.major, gpu.minor, gpu.multi_processor_count,
                             parts)).encode())
    for f in source_files():
        h.update(f.read_bytes())
    return h.hexdigest()[:32]


def source_files() -> list[Path]:
    """Every module of policyscan's engine and kernels, in a fixed order: what variants_id hashes."""
    root = Path(__file__).resolve().parents[2]
    return sorted([*(root / "engine").rglob("*.py"), *(root / "kernels").glob("*.py")])


def _compiled_before(run_id: str) -> list[str] | None:
    """The variant keys of the run's manifest when every one is still marked, else None."""
    marks = _marker_dir()
    try:
        known = (marks / f"run-{run_id}").read_text().split()
    except OSError:
        return None
    try:
        return known if known and all((marks / k).exists() for k in known) else None
    except OSError:  # an unsearchable foreign cache folder: compiled here or not, this run cannot tell
        return None


def _marked(v: Variant) -> bool:
    try:
        return (_marker_dir() / v.key).exists()
    except OSError:
        return False


def _marker_dir() -> Path:
    import triton

    return Path(triton.knobs.cache.dir) / "policyscan_variants"


def dry_run(decoder: Decoder, heads: list[list[int]], shapes: list[tuple[int, int]],
             offer: Callable[[Variant], None]) -> list[Variant] | None:
    """Every variant the batches `shapes` launch, each offered as first met; None if one came without Triton's
    serialized specialization (a Triton whose hook differs)."""
    seen: dict[str, Variant] = {}
    missing = []
    with _record(seen, missing, offer), torch.inference_mode():
        prefix = decoder.prefill_prefixes(heads)
        for t, b in shapes:
            decoder.forward(static_batch(t, b, decoder.device), prefix)
        torch.cuda.synchronize(decoder.device)
    return None if missing else list(seen.values())


@contextmanager
def _record(seen: dict[str, Variant], missing: list, offer: Callable[[Variant], None]):
    """Every Triton launch of this thread in the block runs as a warm-up (nothing launches); each variant not
    loaded in this process is recorded and its compile skipped. Other threads launch and compile as usual."""
    import triton
    from triton.runtime.jit import JITFunction

    with _LOCK:
        run, old_hook = JITFunction.run, triton.knobs.runtime.jit_cache_hook

        def hook(*, fn, compile, **kwargs):
            if not getattr(_LOCAL, "on", False):
                return old_hook(fn=fn, compile=compile, **kwargs) if old_hook else None
            data = compile.get("specialization_data")
            if data is None:
                missing.append(fn.name)
            else:
                v = Variant(fn.module, fn.name, data, str(getattr(getattr(fn, "jit_function", None), "cache_key", "")))
                if v.key not in seen:
                    seen[v.key] = v
                    offer(v)
            return True  # skip: a child process compiles it

        def warmup_in_dry_run(self, *args, grid, warmup, **kwargs):
            return run(self, *args, grid=grid, warmup=warmup or getattr(_LOCAL, "on", False), **kwargs)

        JITFunction.run, triton.knobs.runtime.jit_cache_hook = warmup_in_dry_run, hook
        _LOCAL.on = True
        try:
            yield
        finally:
            _LOCAL.on = False
            JITFunction.run, triton.knobs.runtime.jit_cache_hook = run, old_hook
