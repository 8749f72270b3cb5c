"""policyscan's engine: conversations in, per-policy verdict scores out.

The public API, by stage (each name is imported from its module on first use, so that a process which only
plans or checks, the `score --ray` driver, never imports torch):

    inputs    ReadSpec, read_chunks           what to read from Parquet/JSONL, and the chunks read
    text      TextEncoder, PromptBuilder      token ids of a policy's prompt, built as `score` builds them
    policy    Policy, load_policy, load_policies
    run       Engine, EngineSettings, score_inputs, encoded_inputs, encode_chunk, score_chunk
    outputs   OutputSpec, RunOutput, Job, Scorer, Accounting, read_metadata
    errors    PolicyscanError, CheckpointError, PolicyError, InputError"""
from __future__ import annotations

import importlib

_WHERE = {
    "ReadSpec": "inputs.rows", "read_chunks": "inputs.sources",
    "TextEncoder": "text.prompts", "PromptBuilder": "text.prompts",
    "Policy": "policy.bundle", "load_policy": "policy.bundle", "load_policies": "policy.bundle",
    "Engine": "run.runner", "EngineSettings": "settings", "score_inputs": "run.pipeline",
    "encoded_inputs": "run.pipeline", "encode_chunk": "run.pipeline", "score_chunk": "run.pipeline",
    "OutputSpec": "outputs.accounting", "RunOutput": "outputs.run_output", "Job": "outputs.run_output",
    "Scorer": "outputs.run_output", "Accounting": "outputs.accounting", "read_metadata": "outputs.sinks",
    "PolicyscanError": "errors", "CheckpointError": "errors", "PolicyError": "errors", "InputError": "errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'policyscan.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"policyscan.engine.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
