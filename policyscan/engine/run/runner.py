"""The engine's public API: a model + policies on a device; prompts in, f values out."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from policyscan.engine.errors import CheckpointError, PolicyscanError
from policyscan.engine.files import in_background
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.config import ModelConfig
from policyscan.engine.model.loader import attach_policies, factors_on, load_decoder, shaped_decoder
from policyscan.engine.model.model import Decoder
from policyscan.engine.model.precision import Precision, decide_precision
from policyscan.engine.policy.bundle import Policy
from policyscan.engine.run.batch import pack, plan_batches
from policyscan.engine.run.graphs import GraphedForward
from policyscan.engine.settings import EngineSettings, OptionError, version
from policyscan.engine.text.prompts import PolicyPrompts, TextEncoder
from policyscan.engine.warmup import compile_start
from policyscan.engine.warmup.compile_ahead import (
    CompileJob,
    CompileReport,
    compile_ahead,
    start_compilers,
    variants_id,
)
from policyscan.engine.warmup.compile_procs import Compilers, usable_cpus


def default_threads() -> int:
    """The CPUs this process may run on, at most 4 (more were never tried). All of them even on a busy machine:
    the pool's idle threads sleep where OpenMP's spun and collapsed, so a second thread costs little there
    (docs/performance.md). f is bitwise the same for any count (tests/test_cpu_threads.py)."""
    return max(1, min(usable_cpus(), 4))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PolicyscanError(f"--device {name}: no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


class Engine:
    """Loads the model and policies once; `score` runs packed multi-LoRA batches and returns f per prompt."""

    def __init__(self, model_dir: str | Path, policies: list[Policy], settings: EngineSettings = EngineSettings(),
                 precision: Precision | None = None):
        """precision: compute exactly so (`verify` repeating a run), instead of deciding from the settings."""
        if not policies:
            raise PolicyscanError("no policies given: pass --policies DIR (a bundle or a folder of bundles)")
        self.load_started = time.perf_counter()
        self.settings, self.policies = settings, policies
        self.device = resolve_device(settings.device)
        gpu = self.device.type == "cuda"
        if not gpu:
            from policyscan.kernels import cpu_rows
            cpu_rows.set_threads(settings.threads or default_threads())
        self.checkpoint = Checkpoint.open(model_dir)
        if small := self.checkpoint.config.batch_too_small(settings.batch_tokens, settings.max_length):
            raise OptionError(small)
        _check_offsets(self.checkpoint.config, settings.batch_tokens)
        self.precision, self.precision_reason = (precision, None) if precision is not None else decide_precision(
            settings.precision, gpu, self.checkpoint.fp8, policies, settings.fp8_flip_limit)
        self.max_length = self.checkpoint.config.prompt_length(settings.max_length)
        sides = PolicyPrompts.for_policies(model_dir, policies, self.max_length, settings.chat_template,
                                           settings.text_is_rendered)
        self.encoder, self.builders = sides.encoder, list(sides.builders)
        label_ids = [self.encoder.verdict_ids(p) for p in policies]
        check_token_ids(self.encoder, self.checkpoint, policies, label_ids)
        heads = [b.head for b in self.builders] if settings.prefix_cache else []
        self.compile: CompileReport | None = None
        ahead, job, compilers = gpu and settings.compile_ahead, None, None
        if not ahead:
            compile_start.end()  # the command line's guess was wrong (no CUDA here, say): their import stops now
        else:
            run_id = variants_id(self.checkpoint.config, self.precision.record(), heads, settings.batch_tokens,
                                 settings.cuda_graphs, [p.adapter_sha256 for p in policies], str(self.device))
            compilers = start_compilers(run_id)
        try:
            if compilers is not None:  # not compiled here before: the kernels compile while the weights load
                job = _compile_on_shapes(self.checkpoint, self.precision, self.device, policies, label_ids, heads,
                                         settings, run_id, compilers)
            self.decoder = load_decoder(self.checkpoint, _ops(gpu), self.precision, self.device)
            # The outputs' metadata names the model by a sha256 of its files (remembered across runs, files.py); a
            # first run hashes them behind the attach, the compile and the scoring, not the load, which a hash
            # beside it slows by most of the hash's own time (docs/performance.md).
            self._model_sha = in_background(self.checkpoint.fingerprint, "policyscan-model-sha256")
            attach_policies(self.decoder, policies, label_ids)
        except BaseException:
            if job is not None:
                job.cancel()
            elif compilers is not None:
                compilers.kill()
            raise
        if ahead:
            self.compile = job.wait() if job is not None else _compile_after_load(
                self.decoder, heads, settings, run_id, compilers)
        self._prefix = None
        if settings.prefix_cache:
            with torch.inference_mode():
                self._prefix = self.decoder.prefill_prefixes(heads)
        self._graphs: dict[bool, GraphedForward] = {}
        # weights read, moved, prefixes prefilled; not the kernels' compile
        self.load_seconds = time.perf_counter() - self.load_started - (self.compile.seconds if self.compile else 0)

    def score(self, prompts: list[list[int]], adapters: list[int] | np.ndarray) -> np.ndarray:
        """f (float32) for each prompt, in the order given; prompts are token-id lists, adapters index policies."""
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        return self._run(lengths, np.asarray(adapters, dtype=np.int64), lambda i, a: prompts[i])

    def score_conversations(self, convs: list[np.ndarray]) -> tuple[np.ndarray, int, int]:
        """f [conversations, policies] for encoded conversations, every one under every policy; also the number
        of prompt tokens and of truncated prompts. Prompts are assembled batch by batch, never all at once."""
        n, k = len(convs), len(self.builders)
        conv_len = np.fromiter((len(c) for c in convs), dtype=np.int64, count=n)
        if n and not conv_len.all():  # callers turn these into error rows first (pipeline, calibrate)
            raise ValueError(f"conversation {int(np.argmin(conv_len))} encodes to no tokens: nothing to score")
        fixed = np.array([b.max_length - b.budget for b in self.builders], dtype=np.int64)
        budget = np.array([b.budget for b in self.builders], dtype=np.int64)
        lengths = (fixed[None, :] + np.minimum(conv_len[:, None], budget[None, :])).reshape(-1)
        truncated = int((conv_len[:, None] > budget[None, :]).sum())
        adapters = np.tile(np.arange(k), n)
        if self._prefix is None:
            f = self._run(lengths, adapters, lambda i, a: self.builders[a].build(convs[i // k])[0])
        else:  # the heads are cached: batches hold only each prompt's tail
            heads = np.array([len(b.head) for b in self.builders], dtype=np.int64)
            f = self._run(lengths - heads[adapters], adapters, lambda i, a: self.builders[a].tail(convs[i // k]),
                          self._prefix)
        return f.reshape(n, k), int(lengths.sum()), truncated

    def _forward(self, prefix):
        """Host batch -> f on the device: through CUDA graphs for small batches on a GPU, else eagerly."""
        if self.device.type != "cuda" or not self.settings.cuda_graphs:
            return lambda batch: self.decoder.forward(batch.to(self.device), prefix)
        key = prefix is not None
        if key not in self._graphs:
            self._graphs[key] = GraphedForward(self.decoder, prefix)
        return self._graphs[key]

    def _run(self, lengths: np.ndarray, adapters: np.ndarray, prompt, prefix=None) -> np.ndarray:
        f = np.empty(len(lengths), dtype=np.float32)
        pending = []
        forward = self._forward(prefix)
        with torch.inference_mode():
            for plan in plan_batches(lengths, adapters, self.settings.batch_tokens):
                batch = pack([prompt(i, adapters[i]) for i in plan.items.tolist()], adapters[plan.items].tolist())
                # no copy back per batch: the host packs the next batch while the GPU runs this one
                pending.append((plan.items, forward(batch)))
            for items, out in pending:
                f[items] = out.cpu().numpy()
        return f

    def file_hashes(self) -> dict:
        """The model's files and their sha256 (Checkpoint.file_hashes)."""
        return self.checkpoint.file_hashes()

    def describe(self) -> dict:
        """Everything an auditor needs to reproduce a run: model, adapters, calibration, settings, versions."""
        return {
            "policyscan_version": version(), "torch_version": torch.__version__,
            "model": {"path": str(self.checkpoint.model_dir.resolve()), "sha256": self.model_sha256,
                      "arch": self.checkpoint.config.arch, "fp8_checkpoint": self.checkpoint.fp8},
            "device": str(self.device), "precision": self.precision.name, "precision_reason": self.precision_reason,
            "numerics": self.precision.record(),
            "tokenizer_backend": self.encoder.backend,
            "chat_template": self.encoder.describe_template(),
            # GPU results are reproducible bitwise only on the same GPU, CUDA and Triton (the kernels' code)
            **({"gpu": torch.cuda.get_device_name(self.device), "cuda_version": torch.version.cuda,
                "triton_version": version("triton")} if self.device.type == "cuda" else {}),
            "settings": asdict(self.settings), "max_length": self.max_length,
            "policies": [{"name": p.name, "path": str(p.path.resolve()), "adapter_sha256": p.adapter_sha256,
                          "labels": [p.compliant, p.violation], "verdict_token_ids": list(self.encoder.verdict_ids(p)),
                          "prefix": p.prefix, "suffix": p.suffix,
                          "calibration": {**p.calibration, "a": p.a, "b": p.b}, "threshold": p.threshold,
                          "precision": self.precision.name}
                         for p in self.policies],
        }

    @property
    def model_sha256(self) -> str:
        return self._model_sha.result()


def check_token_ids(encoder: TextEncoder, ckpt: Checkpoint, policies: list[Policy],
                    label_ids: list[tuple[int, int]]) -> None:
    """Every id the tokenizer can give (its vocabulary and added tokens, its BOS, the label tokens) must be a row of
    the embedding and the head (vocab_size rows, checked against them when the checkpoint opened): past them the
    lookup would read outside the table. A tokenizer of another model is refused before any weight is read."""
    rows, tok = ckpt.config.vocab, encoder.tok
    where = f"{ckpt.model_dir / 'tokenizer.json'}: the tokenizer"
    fix = (f"but the model's embedding has {rows} rows (vocab_size in config.json); use the tokenizer.json that "
           "came with these weights")
    size = tok.get_vocab_size(with_added_tokens=True)
    # size tokens with distinct ids: all below `rows` exactly when ids 0..rows-1 hold `size` tokens (a vocabulary may
    # leave ids out); looking each id up is faster than building the vocabulary as a dict (docs/performance.md)
    if size > rows or rows - list(map(tok.id_to_token, range(rows))).count(None) < size:
        top = max(tok.get_vocab(with_added_tokens=True).values())
        raise CheckpointError(f"{where} has {size} tokens with its added tokens, ids up to {top}, {fix}")
    if encoder.bos is not None and encoder.bos >= rows:
        raise CheckpointError(f"{where} adds BOS token id {encoder.bos}, {fix}")
    for policy, ids in zip(policies, label_ids):
        if max(ids) >= rows:
            raise CheckpointError(f"{where} gives policy {policy.name!r} ({policy.path}) label token ids {ids}, {fix}")


def _check_offsets(cfg: ModelConfig, batch_tokens: int) -> None:
    """The GPU kernels address a batch's activations with 32-bit offsets: rows x widest row below 2^31. Checked
    on every device, so that settings recorded on one (`policyscan verify` reruns them) work on the other."""
    widest = max(cfg.hidden, cfg.intermediate, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim)
    if batch_tokens * widest >= 2**31:
        raise PolicyscanError(f"--batch-tokens {batch_tokens} is too large for this model: a batch's widest "
                              f"activation ({widest} columns) would pass 2^31 elements, which the GPU kernels "
                              f"cannot address; use --batch-tokens {(2**31 - 1) // widest} or less")


def _compile_on_shapes(ckpt: Checkpoint, precision: Precision, device: torch.device, policies: list[Policy],
                       label_ids: list[tuple[int, int]], heads: list[list[int]], settings: EngineSettings,
                       run_id: str, compilers: Compilers) -> CompileJob | None:
    """compile_ahead's dry run on a decoder of the model's shapes (weights unread, LoRA factors all 1, so that no
    copy of the real factors delays it), its variants compiling in the background while the weights load, not
    after the load (docs/performance.md). None if that decoder cannot be built: the dry run then follows the load,
    with the same children."""
    try:
        shaped = shaped_decoder(ckpt, _ops(True), precision, device)
        attach_policies(shaped, policies, label_ids, factors_on(policies, device, values=False))
    except Exception:  # noqa: BLE001  only when kernels compile changes: the real load reports what is wrong
        return None
    except BaseException:
        compilers.kill()
        raise
    # not in the try: the workers may already hold variants, so no second dry run may feed them (a dry run that
    # fails leaves its kernels to compile at launch; an interrupt ends the workers)
    return compile_ahead(shaped, heads, settings.batch_tokens, settings.cuda_graphs, run_id, compilers)


def _compile_after_load(decoder: Decoder, heads: list[list[int]], settings: EngineSettings, run_id: str,
                        compilers: Compilers | None) -> CompileReport | None:
    """compile_ahead on the loaded decoder (a manifest gone since start_compilers looked, or no shaped decoder);
    None if it fails: the kernels then compile when launched, as without it."""
    try:
        return compile_ahead(decoder, heads, settings.batch_tokens, settings.cuda_graphs, run_id, compilers).wait()
    except Exception:  # noqa: BLE001  a run never fails for when its kernels compile
        if compilers is not None:
            compilers.kill()
        return None
    except BaseException:  # Ctrl-C, SIGTERM: the compiling processes end with the run
        if compilers is not None:
            compilers.kill()
        raise


def _ops(gpu: bool):
    if gpu:
        from policyscan.kernels import triton_ops
        return triton_ops
    from policyscan.kernels import reference
    return reference
