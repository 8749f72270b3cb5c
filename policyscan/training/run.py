"""One `train` run from labeled files to a committed policy bundle: checks first (policy against model, labels,
class counts), then the fit, the engine's parity check, the calibration and the record."""
from __future__ import annotations

import datetime
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from policyscan.calibration.record import data_sha256
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.files import file_sha256
from policyscan.engine.inputs.rows import ReadSpec
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.outputs.sinks import ErrorWriter, commit_together
from policyscan.engine.policy.bundle import Policy, load_policy
from policyscan.engine.run.runner import Engine, check_token_ids, resolve_device
from policyscan.engine.settings import EngineSettings, OptionError
from policyscan.engine.text.prompts import PolicyPrompts
from policyscan.training import bundle
from policyscan.training.data import Examples, read_examples
from policyscan.training.fake_fp8 import swap_projections
from policyscan.training.loop import Fit, LoopSettings, fit, verdicts
from policyscan.training.verdict import LoraSpec, VerdictModel

MIN_TRAIN, MIN_HOLDOUT = 10, 5  # rows of each class below which a fit (or its holdout check) means nothing
PRECISIONS = ("auto", "fp32", "bf16", "fp8")


class UsageProblem(OptionError):
    """A problem with what was asked (too few rows, an adapter already there): the command line's usage error."""


@dataclass(frozen=True)
class TrainJob:
    """Everything one `train` run needs; checked when made."""

    model_dir: Path
    policy_dir: Path
    files: tuple[Path, ...]
    spec: ReadSpec
    errors: Path
    lora: LoraSpec = field(default_factory=LoraSpec)
    loop: LoopSettings = field(default_factory=LoopSettings)
    label_column: str | None = None
    holdout: float = 0.2
    device: str = "auto"
    precision: str = "auto"
    max_length: int = 2048
    chat_template: str | None = None
    text_is_rendered: bool = False
    force: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.holdout < 1.0:
            raise OptionError(f"--holdout {self.holdout}: give a share in (0, 1); the holdout stops the "
                                  "training, checks it against score and calibrates it")
        if self.precision not in PRECISIONS:
            raise OptionError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclass(frozen=True)
class TrainResult:
    examples: Examples
    fit: Fit
    parity: bundle.Parity
    record: dict


def train_policy(job: TrainJob, progress: Callable[[str, float], None] | None = None,
                 say: Callable[[str], None] = print) -> TrainResult:
    policy = load_policy(job.policy_dir)
    _refuse_existing(policy, job.force)
    device = resolve_device(job.device)
    precision = job.precision if job.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    ckpt = Checkpoint.open(job.model_dir)  # config against the weights' headers, before any weight is read
    prompts = PolicyPrompts.for_policies(job.model_dir, [policy], ckpt.config.prompt_length(job.max_length),
                                         job.chat_template, job.text_is_rendered)
    label_ids = prompts.encoder.verdict_ids(policy)
    check_token_ids(prompts.encoder, ckpt, [policy], [label_ids])
    errors = ErrorWriter(job.errors)
    try:
        examples = read_examples(prompts, policy, list(job.files), job.spec, job.label_column, job.holdout, errors)
        _check_counts(examples)
        say(f"{examples.read} rows read: {len(examples.train)} to train on, {len(examples.holdout)} held out, "
            f"{examples.errors} in {job.errors if examples.errors else 'no errors file'}")
        result = _train(job, policy, device, precision, ckpt, label_ids, examples, progress, say)
        moves, remove = errors.finish()
        commit_together(moves, remove)
        return result
    except BaseException:
        errors.abort()
        raise


def _train(job: TrainJob, policy: Policy, device: torch.device, precision: str, ckpt: Checkpoint,
           label_ids: tuple[int, int], examples: Examples, progress, say) -> TrainResult:
    deterministic = _deterministic(device)
    dtype = torch.float32 if precision == "fp32" or device.type == "cpu" else torch.bfloat16
    model = VerdictModel.load(job.model_dir, label_ids, job.lora, device, dtype, job.loop.seed)
    if precision == "fp8":
        swap_projections(model.causal)
    if device.type == "cuda":
        model.causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autocast = torch.bfloat16 if precision in ("bf16", "fp8") and device.type == "cuda" else None
    result = fit(model, examples.train, examples.holdout, job.loop, autocast, progress)
    f_trainer = verdicts(model, examples.holdout, job.loop.batch_tokens, autocast)
    f_ref, f_16 = f_trainer, None
    if precision != "fp32" and device.type == "cpu":  # the trainer ran fp32: its bf16 rounding measured here
        f_16 = verdicts(model, examples.holdout, job.loop.batch_tokens, torch.bfloat16)
    elif precision != "fp32":
        f_16, f_ref = f_trainer, None
    stage = bundle.staging(job.policy_dir)
    try:
        model.save(stage, result.state)
        del model
        if f_ref is None:  # the 16-bit trainer's own reference: the same adapter on the base read in fp32
            f_ref = _fp32_verdicts(job, label_ids, device, precision, result.state, examples)
        whole = max(EngineSettings.batch_tokens, ckpt.config.prompt_length(job.max_length))  # a batch holds a prompt
        settings = EngineSettings(str(device), "fp32" if precision == "fp32" else precision, batch_tokens=whole,
                                  max_length=job.max_length, chat_template=job.chat_template,
                                  text_is_rendered=job.text_is_rendered)
        engine = Engine(job.model_dir, [load_policy(stage)], settings)
        check, f_engine = bundle.parity(engine, examples.holdout, f_trainer, f_ref, f_16)
        del engine
        say(f"train/serve parity on {len(examples.holdout)} held-out rows ({precision}, {device}): {check.describe()}")
        if not check.ok:
            raise PolicyscanError(f"{check.first_row}: score's f is further from the fp32 computation than the "
                                  f"bound ({check.describe()}); the policy folder was left as it was")
        y = np.array([e.label for e in examples.holdout], dtype=np.float64)
        platt = bundle.calibrate(f_engine, y)
        before = bundle.holdout_metrics(1.0 / (1.0 + np.exp(-f_engine)), y, policy.threshold)
        after = bundle.holdout_metrics(platt(f_engine), y, policy.threshold)
        fp8 = bundle.fp8_check(job.model_dir, stage, settings, examples.holdout, platt, policy.threshold)
        record = _record(job, ckpt, examples, result, check, before, after, precision, device, deterministic)
        bundle.write_record(stage, platt, _calibration_provenance(job, examples), fp8, record)
        bundle.commit(stage, job.policy_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return TrainResult(examples, result, check, record)


def _fp32_verdicts(job: TrainJob, label_ids: tuple[int, int], device: torch.device, precision: str,
                   state: dict[str, torch.Tensor], examples: Examples) -> np.ndarray:
    ref = VerdictModel.load(job.model_dir, label_ids, job.lora, device, torch.float32, job.loop.seed)
    if precision == "fp8":
        swap_projections(ref.causal)
    ref.load_state(state)
    f = verdicts(ref, examples.holdout, job.loop.batch_tokens, None)
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return f


def _refuse_existing(policy: Policy, force: bool) -> None:
    held = [n for n in bundle.ADAPTER_FILES if (policy.path / n).exists()]
    if held and not force:
        raise UsageProblem(f"{policy.path} already holds an adapter ({', '.join(held)}); pass --force to replace it "
                           "(the old one stays until the new one is complete)")


def _check_counts(ex: Examples) -> None:
    c = ex.counts()
    for part, least in (("train", MIN_TRAIN), ("holdout", MIN_HOLDOUT)):
        if min(c[part].values()) < least:
            raise UsageProblem(f"the {part} rows hold {c[part]['violation']} violation and {c[part]['compliant']} "
                               f"compliant rows; training needs at least {least} of each there (label more rows"
                               + (", or raise --holdout)" if part == "holdout" else ")"))


def _deterministic(device: torch.device) -> str:
    """torch's deterministic algorithms on (bitwise repeatable runs on the CPU); on the GPU cuBLAS needs its
    workspace setting, and ops without a deterministic kernel only warn."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        return "on (ops without a deterministic kernel warn)"
    torch.use_deterministic_algorithms(True)
    return "on"


def _calibration_provenance(job: TrainJob, ex: Examples) -> dict:
    return {"data_sha256": data_sha256(list(job.files)), "rows": len(ex.holdout), "fit_rows": len(ex.holdout),
            "holdout_fraction": job.holdout, "label_column": ex.label_column, "from_scores": False,
            "fitted_on": "the training holdout, scored through score's engine",
            "date": _now()}


def _record(job: TrainJob, ckpt: Checkpoint, ex: Examples, result: Fit, check: bundle.Parity, before: dict,
            after: dict, precision: str, device: torch.device, deterministic: str) -> dict:
    return {
        "files": [{"path": os.path.relpath(p.resolve(), job.policy_dir.resolve()), "sha256": sha}
                  for p, sha in zip(job.files, _shas(job.files))],
        "rows": ex.counts(), "label_column": ex.label_column,
        "lora": {"rank": job.lora.rank, "alpha": job.lora.alpha, "targets": list(job.lora.targets),
                 "rslora": job.lora.rslora},
        "loop": asdict(job.loop), "holdout_fraction": job.holdout,
        "max_length": ckpt.config.prompt_length(job.max_length),  # the length prompts were cut at, as score records
        "precision": precision, "device": str(device), "deterministic_algorithms": deterministic,
        "epochs_run": len(result.epochs), "best_epoch": result.best_epoch,
        "untrained": asdict(result.initial), "epochs": [asdict(e) for e in result.epochs],
        "tokens": result.tokens, "seconds": round(result.seconds, 3),
        "base_model_sha256": ckpt.fingerprint(),
        "holdout_before_calibration": before, "holdout_after_calibration": after,
        "parity": check.record(), "date": _now(),
    }


def _shas(files) -> list[str]:
    return [file_sha256(p) for p in files]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
