"""The run's settings and the package's version: torch-free, for a process that only plans and checks a run (the
`score --ray` driver; the command line before it knows which command runs)."""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from policyscan.engine.errors import PolicyscanError

PRECISIONS = ("auto", "fp8", "bf16", "fp32")


def version(package: str = "policyscan") -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class EngineSettings:
    device: str = "auto"
    precision: str = "auto"
    # 65536: W1 +1.6%, W4 +1.8% against 32768 (fewer, fuller batches); 131072 within 0.1% (docs/performance.md).
    # About 2.5 GB of activations at W1's shape.
    batch_tokens: int = 65536
    max_length: int = 2048
    prefix_cache: bool = True  # results are bitwise the same either way; off only to measure it
    cuda_graphs: bool = True   # GPU only; bitwise the same either way (engine/graphs.py)
    compile_ahead: bool = True  # GPU only: kernels compile in parallel at load, not one by one in the first
    # batches; the same bits either way (engine/compile_ahead.py)
    chat_template: str | None = None  # --chat-template; None: the policies' chat_template, else the model's
    threads: int | None = None  # CPU path only (cpu_rows.set_threads); None: default_threads(); f is the same
    # --precision auto runs bf16 when FP8 flipped more than this share of a policy's labeled verdicts
    fp8_flip_limit: float = 0.01

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PolicyscanError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise PolicyscanError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 <= self.fp8_flip_limit <= 1:
            raise PolicyscanError(f"the FP8 flip limit is a share in [0, 1], got {self.fp8_flip_limit}")
        if self.threads is not None and self.threads < 1:
            raise PolicyscanError(f"--threads must be at least 1, got {self.threads}")
        if self.max_length < 2:
            raise PolicyscanError(f"--max-length must be at least 2, got {self.max_length}")
        if self.batch_tokens < self.max_length:
            raise PolicyscanError(f"--batch-tokens ({self.batch_tokens}) must be at least --max-length "
                                  f"({self.max_length}): a whole prompt must fit in one batch")
