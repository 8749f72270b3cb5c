"""Where a start-up's time goes (docs/performance.md): `policyscan score ARGS` in this process with the
engine's start-up steps timed from the process's start, the time spent inside the policies' attach summed per
step, when each compiling worker answered its first variant, and each compiled variant's seconds from hand-out to
answer (per kernel, then one line a variant with Triton's specialization). Times count from this script's first
line (the interpreter's own start, about 0.05 s, comes before).

    TRITON_CACHE_DIR=/tmp/fresh python bench/startup_phases.py score IN -o OUT.parquet --model M --policies P \
        --no-progress

A new TRITON_CACHE_DIR is a fresh machine's start; the same again, a warm one."""
import time

T0 = time.perf_counter()

import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import policyscan.cli.main as cli  # noqa: E402
import policyscan.engine.model.layers as layers  # noqa: E402
import policyscan.engine.model.loader as loader  # noqa: E402
import policyscan.engine.run.runner as runner  # noqa: E402
import policyscan.engine.warmup.compile_ahead as ca  # noqa: E402
import policyscan.engine.warmup.compile_procs as cp  # noqa: E402

EVENTS: list[tuple[float, str]] = []
INSIDE: dict[str, float] = collections.defaultdict(float)
HANDED: dict[str, list[float]] = collections.defaultdict(list)
COMPILED: list[tuple[tuple[str, str, str], float]] = []  # (variant, hand-out to answer) of those that compiled


def _now() -> float:
    return time.perf_counter() - T0


def steps(module, name: str) -> None:
    """Log the start and end of every call of module.name."""
    fn = getattr(module, name)

    def logged(*args, **kwargs):
        EVENTS.append((_now(), f"{name} start"))
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((_now(), f"{name} end"))
    setattr(module, name, logged)


def summed(owner, name: str) -> None:
    """Sum the time of every call of owner.name."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            INSIDE[name] += time.perf_counter() - t
    setattr(owner, name, timed)


class _Handing:
    """compile_procs' json, logging each variant handed to a worker (a worker's second: its first answer)."""
    loads = staticmethod(json.loads)

    @staticmethod
    def dumps(v) -> str:
        HANDED[threading.current_thread().name].append(_now())
        return json.dumps(v)


def record_compiles() -> None:
    """Keep each compiled variant's seconds (Compilers.seconds) for the table at the end."""
    fn = cp.Compilers.compile

    def compile(self, variants):
        taken = []  # in the order handed out: the order of the answers (variants may be a stream)
        errors = fn(self, (taken.append(v) or v for v in variants))
        COMPILED.extend((v, t) for v, t, e in zip(taken, self.seconds, errors) if e is None)
        return errors
    cp.Compilers.compile = compile


def compile_table() -> None:
    """Per kernel: variants, compile seconds summed and slowest; then each variant's specialization key."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for (_, name, _), t in COMPILED:
        by_name[name].append(t)
    print("| kernel | variants | seconds summed | slowest |\n|---|---|---|---|")
    for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(ts)} | {sum(ts):.1f} | {max(ts):.2f} |")
    for (_, name, data), t in sorted(COMPILED, key=lambda c: c[0][1]):
        print(f"{name} {t:.2f} s {json.loads(data).get('key', '')}")


def main() -> None:
    for name in ("start_compilers", "_compile_on_shapes", "shaped_decoder", "attach_policies", "load_decoder",
                 "_compile_after_load"):
        steps(runner, name)
    steps(ca, "_dry_run")
    steps(ca.CompileJob, "wait")
    summed(runner, "factors_on")  # the shaped decoder's (factors of 1), before a fresh run's dry run
    summed(loader, "factors_on")  # attach_policies' own: the real decoder's
    summed(loader, "_stack")
    summed(layers.DenseLoraLinear, "set_lora")
    cp.json = _Handing
    record_compiles()
    sys.argv = ["policyscan", *sys.argv[1:]]
    try:
        cli.main()
    except SystemExit as e:
        EVENTS.append((_now(), f"exit {e.code}"))
    for t, what in EVENTS:
        print(f"{t:7.2f} s  {what}")
    print("summed inside the attach:", {k: round(v, 2) for k, v in INSIDE.items()})
    firsts = sorted(times[1] for times in HANDED.values() if len(times) > 1)
    if firsts:
        print(f"{len(HANDED)} workers: first answers at {firsts[0]:.2f}-{firsts[-1]:.2f} s, "
              f"last variant handed at {max(t[-1] for t in HANDED.values()):.2f} s")
    if COMPILED:
        compile_table()


if __name__ == "__main__":
    main()
