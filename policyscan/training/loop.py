"""The training loop: length-bucketed batches under a token budget (padding kept small by sorting), binary
cross-entropy of sigmoid(f) against the label, AdamW with a linear warm-up and decay, the holdout scored each
epoch, early stopping on holdout loss, and the best epoch's factors kept."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from policyscan.calibration.metrics import roc_auc
from policyscan.engine.settings import OptionError
from policyscan.training.data import Example
from policyscan.training.verdict import VerdictModel


@dataclass(frozen=True)
class LoopSettings:
    """How the adapter is fitted; each field is a `train` option."""

    epochs: int = 3
    lr: float = 2e-4
    batch_tokens: int = 16384
    seed: int = 0
    patience: int = 2          # epochs without a better holdout loss before stopping
    warmup: float = 0.06       # share of the steps the learning rate ramps up over
    weight_decay: float = 0.0
    class_weight: str = "none"  # "balanced": each class weighs as much as the other in the loss
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.epochs <= 1000:
            raise OptionError(f"--epochs {self.epochs}: give 1 to 1000")
        if not (math.isfinite(self.lr) and 0 < self.lr < 1):
            raise OptionError(f"--lr {self.lr}: give a learning rate in (0, 1)")
        if self.batch_tokens < 16:
            raise OptionError(f"--batch-tokens {self.batch_tokens}: give at least 16")
        if self.class_weight not in ("none", "balanced"):
            raise OptionError(f"--class-weight {self.class_weight!r}: give none or balanced")
        if self.patience < 1:
            raise OptionError(f"--patience {self.patience}: give at least 1")


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float | None  # None before training
    holdout_loss: float
    holdout_roc_auc: float | None
    seconds: float


@dataclass
class Fit:
    """What the loop found: the best epoch's factors, each epoch's figures, the tokens trained on."""

    state: dict[str, torch.Tensor]
    best_epoch: int
    initial: EpochRecord | None = None  # the holdout under the untrained adapter (B = 0: the base model's f)
    epochs: list[EpochRecord] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def batches(examples: list[Example], budget: int) -> list[list[int]]:
    """Row indices in batches of similar length: sorted by length (ties by position), cut where the padded
    batch (rows x longest) would pass `budget` tokens. A prompt longer than the budget is a batch alone."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), i))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(examples[i].ids)
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def padded(examples: list[Example], rows: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, last position) of right-padded rows."""
    n = max(len(examples[i].ids) for i in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for j, i in enumerate(rows):
        k = len(examples[i].ids)
        ids[j, :k] = torch.tensor(examples[i].ids)
        mask[j, :k] = 1
    last = mask.sum(1) - 1
    return ids.to(device), mask.to(device), last.to(device)


def verdicts(model: VerdictModel, examples: list[Example], budget: int, autocast: torch.dtype | None) -> np.ndarray:
    """f (float64) of each example in eval mode, in the examples' order."""
    f = np.zeros(len(examples))
    model.peft.eval()
    with torch.no_grad(), _autocast(model.device, autocast):
        for rows in batches(examples, budget):
            f[rows] = model.f(*padded(examples, rows, model.device)).double().cpu().numpy()
    return f


def fit(model: VerdictModel, train: list[Example], holdout: list[Example], s: LoopSettings,
        autocast: torch.dtype | None, progress: Callable[[str, float], None] | None = None) -> Fit:
    """The adapter fitted on `train`, the holdout scored after each epoch; stops after `patience` epochs without
    a lower holdout loss and returns the best epoch's factors."""
    t0 = time.perf_counter()
    y_train = torch.tensor([e.label for e in train], dtype=torch.float32)
    y_hold = np.array([e.label for e in holdout], dtype=np.float64)
    pos = float(y_train.sum())
    weights = (len(train) / (2 * pos), len(train) / (2 * (len(train) - pos))) if s.class_weight == "balanced" \
        else (1.0, 1.0)
    params = model.trainable()
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    plan = batches(train, s.batch_tokens)
    total = s.epochs * len(plan)
    warm = max(1, round(s.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: (step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm)))
    if progress:
        progress("total", float(total))
    rng = np.random.default_rng(s.seed)
    best = Fit(model.state(), 0)
    best.initial = _holdout_record(model, holdout, y_hold, s, autocast, 0, None, 0.0)
    best_loss, stale, step = best.initial.holdout_loss, 0, 0
    for epoch in range(1, s.epochs + 1):
        started, losses, seen = time.perf_counter(), 0.0, 0
        model.peft.train()
        for b in rng.permutation(len(plan)):
            rows = plan[b]
            ids, mask, last = padded(train, rows, model.device)
            y = y_train[rows].to(model.device)
            w = torch.where(y > 0, weights[0], weights[1])
            with _autocast(model.device, autocast):
                f = model.f(ids, mask, last)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(f.float(), y, weight=w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            losses += float(loss.detach()) * len(rows)
            seen += len(rows)
            best.tokens += int(mask.sum())
            if progress:
                progress("step", float(loss.detach()))
        record = _holdout_record(model, holdout, y_hold, s, autocast, epoch, losses / max(1, seen), started)
        hold_loss = record.holdout_loss
        best.epochs.append(record)
        if progress:
            progress("epoch", hold_loss)
        if hold_loss < best_loss:
            best_loss, stale, best.best_epoch, best.state = hold_loss, 0, epoch, model.state()
        else:
            stale += 1
            if stale >= s.patience:
                break
    model.load_state(best.state)
    best.seconds = time.perf_counter() - t0
    return best


def _holdout_record(model: VerdictModel, holdout: list[Example], y: np.ndarray, s: LoopSettings,
                    autocast: torch.dtype | None, epoch: int, train_loss: float | None, started: float) -> EpochRecord:
    f = verdicts(model, holdout, s.batch_tokens, autocast)
    loss = float(np.mean(np.logaddexp(0.0, f) - y * f))  # BCE of sigmoid(f), never overflowing
    return EpochRecord(epoch, train_loss, loss, _auc(f, y), time.perf_counter() - started if started else 0.0)


def _auc(f: np.ndarray, y: np.ndarray) -> float | None:
    return roc_auc(f, y.astype(bool)) if 0 < y.sum() < len(y) else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
