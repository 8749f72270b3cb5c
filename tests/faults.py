"""Faults injected from the test side, as a machine causes them: a worker process SIGKILLed (an OOM kill) as it
takes a unit, and a Ray actor SIGKILLed between two batches. Nothing in policyscan itself knows of them."""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from policyscan.engine.parallel.workers import WorkerPool


@dataclass(frozen=True)
class Lethal:
    """Sent to a worker in place of a unit: unpickling it there, as the worker takes the unit, calls
    signal.raise_signal(SIGKILL), which every Python process has, so the worker imports nothing of the tests."""

    index: int  # the unit's: the pool records it as held by the worker that dies

    def __reduce__(self):
        return signal.raise_signal, (int(signal.SIGKILL),)


def kill_workers_taking(monkeypatch: pytest.MonkeyPatch, kills: Callable[[int, int], bool]) -> None:
    """Each worker sent a unit for which kills(unit index, attempt) holds dies of SIGKILL as it takes it. The
    patch is on the parent's WorkerPool.send: workers fork from a fork server that a patch here does not reach,
    but what the parent sends reaches them."""
    send = WorkerPool.send

    def lethal_send(pool, worker, unit, attempt, spec, strict):
        send(pool, worker, Lethal(unit.index) if kills(unit.index, attempt) else unit, attempt, spec, strict)

    monkeypatch.setattr(WorkerPool, "send", lethal_send)


def actor_killer(arm: Path) -> Callable[[], None]:
    """A Ray worker_process_setup_hook: in each worker process of the job, PolicyScorer SIGKILLs its process at its
    second call while the file `arm` exists, and removes the file as it dies, so that an arming kills one actor
    once. A closure, so that Ray ships it by value: Ray's workers cannot import the tests."""

    def kill_at_second_batch() -> None:
        from policyscan.ray.scorer import PolicyScorer

        score = PolicyScorer.__call__
        calls = [0]

        def call(self, batch):
            calls[0] += 1
            if calls[0] >= 2:  # after a batch, so that the kill lands mid-run
                try:
                    os.unlink(arm)
                except FileNotFoundError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            return score(self, batch)

        PolicyScorer.__call__ = call

    return kill_at_second_batch
