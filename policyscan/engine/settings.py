"""The run's settings and the package's version: torch-free, for a process that only plans and checks a run (the
`score --ray` driver; the command line before it knows which command runs)."""
from __future__ import annotations

import importlib.metadata
import math
import operator
import os
import re
from dataclasses import dataclass

from policyscan.engine.errors import PolicyscanError

PRECISIONS = ("auto", "fp8", "bf16", "fp32")
# The longest prompt a run may ask for: above the positions of the models policyscan runs (Llama 3.1's
# max_position_embeddings is 131072), so it refuses only a mistyped value, before anything is read or allocated.
MAX_LENGTH_LIMIT = 1 << 20
# Tokens per packed batch: the GPU kernels address activations with 32-bit offsets (rows x widest row below 2^31,
# checked per model when it loads), and 2^22 rows reach that at 512 columns, narrower than any real model.
MAX_BATCH_TOKENS = 1 << 22
MIN_TOKENS = 2  # the least --max-length and --batch-tokens take
# CPU threads and worker processes beyond a small multiple of the machine's CPUs only contend for them.
THREADS_PER_CPU = 4
WORKERS_PER_CPU = 2
MAX_DEVICES = 64  # GPU indices and counts: far more than one host holds


class OptionError(PolicyscanError):
    """A setting outside its documented range, or one that clashes with another: the command line's usage error."""


def version(package: str = "policyscan") -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def max_threads() -> int:
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def max_workers() -> int:
    return WORKERS_PER_CPU * (os.cpu_count() or 1)


def check_int(option: str, value, low: int, high: int, why: str) -> int:
    """`value` as an int in [low, high], else an OptionError naming the option, the value and the range."""
    try:
        n = operator.index(value)
    except TypeError:
        raise OptionError(f"{option} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not low <= n <= high:
        raise OptionError(f"{option} must be in [{low}, {high}] ({why}), got {value!r}")
    return n


def check_share(option: str, value, low: float, high: float) -> float:
    """`value` as a finite number in [low, high] (NaN compares false with everything, so it is refused by name)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not low <= value <= high:
        raise OptionError(f"{option} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def check_device_name(value: str) -> str:
    """auto, cpu, cuda or cuda:N with N below MAX_DEVICES, else an OptionError."""
    m = re.fullmatch(r"auto|cpu|cuda(?::(\d+))?", value) if isinstance(value, str) else None
    if m is None or (m[1] is not None and int(m[1]) >= MAX_DEVICES):
        raise OptionError(f"--device must be auto, cpu, cuda or cuda:N (N below {MAX_DEVICES}), got {value!r}")
    return value


@dataclass(frozen=True)
class EngineSettings:
    device: str = "auto"
    precision: str = "auto"
    # 65536: fewer, fuller batches ran faster than 32768's and 131072's no faster; the activations take a few GB
    # at a 3B model's shape (docs/performance.md).
    batch_tokens: int = 65536
    max_length: int = 2048
    prefix_cache: bool = True  # results are bitwise the same either way; off only to measure it
    cuda_graphs: bool = True   # GPU only; bitwise the same either way (engine/run/graphs.py)
    compile_ahead: bool = True  # GPU only: kernels compile in parallel at load, not one by one in the first
    # batches; the same bits either way (engine/warmup/compile_ahead.py)
    chat_template: str | None = None  # --chat-template; None: the policies' chat_template, else the model's
    text_is_rendered: bool = False  # --text-is-rendered: a text column's special-token strings are control tokens
    threads: int | None = None  # CPU path only (cpu_rows.set_threads); None: default_threads(); f is the same
    # --precision auto runs bf16 when FP8 flipped more than this share of a policy's labeled verdicts
    fp8_flip_limit: float = 0.01

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise OptionError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        check_device_name(self.device)
        check_share("--fp8-flip-limit", self.fp8_flip_limit, 0, 1)
        if self.threads is not None:
            check_int("--threads", self.threads, 1, max_threads(), f"{THREADS_PER_CPU} per CPU of this machine")
        check_int("--max-length", self.max_length, MIN_TOKENS, MAX_LENGTH_LIMIT, "tokens of one prompt")
        check_int("--batch-tokens", self.batch_tokens, MIN_TOKENS, MAX_BATCH_TOKENS, "tokens of one packed batch")
