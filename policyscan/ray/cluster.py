"""The Ray cluster as `score --ray` uses it: the connection, the actors it may run, a probe task's report of the run,
and the cluster's failures in one line."""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

import click

from policyscan.engine.errors import PolicyscanError
from policyscan.engine.settings import EngineSettings
from policyscan.ray.scorer import PolicyScorer

ADDRESS = re.compile(r"auto|local|ray://\S+|[^\s/:]+:\d+")


def connect(address: str):
    """Ray, connected: (the module, whether this call joined the cluster)."""
    if address and not ADDRESS.fullmatch(address):
        raise click.UsageError(f"--ray {address}: not a Ray address (auto, local, HOST:PORT, ray://HOST:PORT); for "
                               "the cluster RAY_ADDRESS or `ray start` names, put --ray after the inputs")
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise click.UsageError("--ray needs Ray Data: pip install 'policyscan[ray]'") from e
    if ray.is_initialized():
        return ray, False  # the host application's connection, left to it
    ray.init(address=address or None, logging_level=logging.WARNING)
    return ray, True


def plan_actors(ray, settings: EngineSettings, workers: int, devices: str) -> tuple[int, float, float]:
    """(actors at most, GPUs each, CPUs each): one actor a GPU of the cluster, or --workers on the CPU."""
    if devices != "all":
        raise click.UsageError("--devices picks GPUs of this host; with --ray every GPU of the cluster gets an actor")
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if settings.device == "cpu" or (settings.device == "auto" and not gpus):
        return workers, 0.0, float(settings.threads or 1)
    if settings.device not in ("auto", "cuda"):
        raise click.UsageError(f"--device {settings.device} names a GPU of this host; with --ray use --device cuda "
                               "or auto (Ray gives each actor its GPU)")
    if workers > 1:
        raise click.UsageError("--workers is for the CPU (--device cpu); with --ray each GPU of the cluster gets "
                               "one actor")
    if not gpus:
        raise click.UsageError("--device cuda: the Ray cluster has no GPU; use --device cpu")
    return gpus, 1.0, 1.0


def probe(ray, model: str, bundles: list[str], settings: EngineSettings, gpus: float,
           cpus: float) -> tuple[dict, dict]:
    """An actor's report, from a task on the cluster that loads the Engine as an actor does."""
    task = ray.remote(num_gpus=gpus, num_cpus=cpus)(_report)
    report = json.loads(unwrap(ray, lambda: ray.get(task.remote(model, bundles, settings))))
    return report["describe"], report["model_files"]


def _report(model: str, bundles: list[str], settings: EngineSettings) -> str:
    return PolicyScorer(model, bundles, settings).report()


def unwrap(ray, call: Callable):
    """call(), a PolicyscanError raised on the cluster raised here as it is (the CLI prints it in one line); any
    other failure of the run in one line too (Ray has logged its traceback)."""
    try:
        return call()
    except ray.exceptions.RayError as e:
        cause: BaseException | None = e
        while cause is not None:
            if isinstance(cause, PolicyscanError) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None
            inner = getattr(cause, "cause", None)  # a RayTaskError's: the exception its task raised
            cause = inner if isinstance(inner, BaseException) else cause.__cause__
        last = next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), type(e).__name__)
        raise PolicyscanError(f"the Ray run failed ({type(e).__name__}): {last}") from e
