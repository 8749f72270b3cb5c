"""policyscan train: fit a policy's LoRA adapter on labeled conversations, on the prompt and verdict `score` reads."""
from __future__ import annotations

from pathlib import Path

import click

from policyscan.cli.common import (
    Share,
    check_device,
    conversation_options,
    default_model,
    friendly_errors,
    input_files,
    model_option,
    resolve_chat_template,
)
from policyscan.engine.inputs.rows import ReadSpec, clip_chars
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.settings import MAX_BATCH_TOKENS, MAX_LENGTH_LIMIT, MIN_TOKENS


@click.command()
@click.argument("labeled", nargs=-1, required=True)
@click.option("--policy", "policy_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="the policy folder: its policy.json (name, labels, template, threshold) is read; the adapter is "
                   "written into it and the calibration and training record into policy.json")
@model_option
@click.option("--label-column", default=None, metavar="C",
              help="0/1, booleans, or the policy's two label strings [default: label, else the policy's name]")
@click.option("--text-column", default=None, metavar="C")
@click.option("--messages-column", default=None, metavar="C")
@click.option("--id-column", default=None, metavar="C")
@conversation_options
@click.option("--rank", default=16, show_default=True, type=click.IntRange(1, 1024), help="LoRA rank r")
@click.option("--alpha", default=None, type=click.FloatRange(0, 1e6, min_open=True),
              help="LoRA alpha [default: 2 x rank]")
@click.option("--targets", default="q,k,v,o,gate,up,down", show_default=True,
              help="the projections the adapter adapts, comma-separated")
@click.option("--rslora", is_flag=True, help="scale by alpha / sqrt(r) (rank-stabilized LoRA), not alpha / r")
@click.option("--epochs", default=3, show_default=True, type=click.IntRange(1, 1000))
@click.option("--lr", default=2e-4, show_default=True, type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="AdamW's peak learning rate (a linear warm-up over 6% of the steps, then a linear decay)")
@click.option("--batch-tokens", default=16384, show_default=True, type=click.IntRange(MIN_TOKENS, MAX_BATCH_TOKENS),
              help="padded tokens per training batch (rows of similar length batched together)")
@click.option("--max-length", default=2048, show_default=True, type=click.IntRange(MIN_TOKENS, MAX_LENGTH_LIMIT),
              help="longest prompt; longer conversations lose their oldest tokens, as score cuts them")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**31 - 1))
@click.option("--holdout", default=0.2, show_default=True, type=Share(0.01, 0.9),
              help="share of rows, chosen by a hash of the id, held out: early stopping, the check against score, "
                   "the calibration")
@click.option("--patience", default=2, show_default=True, type=click.IntRange(1, 1000),
              help="epochs without a lower holdout loss before training stops (the best epoch is kept)")
@click.option("--class-weight", default="none", show_default=True, type=click.Choice(["none", "balanced"]),
              help="balanced: each class weighs the same in the loss, however rare")
@click.option("--device", default="auto", show_default=True, callback=check_device, help="auto | cpu | cuda | cuda:N")
@click.option("--precision", default="auto", show_default=True, type=click.Choice(["auto", "fp32", "bf16", "fp8"]),
              help="auto: bf16 on a GPU, fp32 on the CPU; fp8: the base runs FP8 scoring's numerics (fake-quantized), "
                   "for a policy that will be scored in FP8")
@click.option("--errors", "errors_path", default=None, type=click.Path(dir_okay=False),
              help="rows that cannot be used, with file, row and reason [default: <policy folder>.train-errors.jsonl]")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@click.option("--force", is_flag=True, help="replace the folder's adapter (kept until the new one is complete)")
@friendly_errors
def train(labeled, policy_dir, model, label_column, text_column, messages_column, id_column, chat_template,
          text_is_rendered, rank, alpha, targets, rslora, epochs, lr, batch_tokens, max_length, seed, holdout,
          patience, class_weight, device, precision, errors_path, no_progress, force) -> None:
    """Fit a LoRA policy on LABELED conversations: f = logit(violation) - logit(compliant) at the prompt's last
    position, trained with binary cross-entropy on exactly the prompts `score` builds; then checked through
    score's engine, calibrated on the holdout and recorded in the policy folder."""
    from policyscan.training.loop import LoopSettings
    from policyscan.training.run import TrainJob, train_policy
    from policyscan.training.verdict import LoraSpec

    if text_column and messages_column:
        raise click.UsageError("give --text-column or --messages-column, not both")
    _require_training_libraries()
    policy_dir = Path(policy_dir)
    files = input_files(list(labeled))
    spec = ReadSpec(text_column, messages_column, id_column, max_chars=clip_chars(max_length))
    model_dir = Path(model or default_model())
    template = resolve_chat_template(model_dir, chat_template, [load_policy(policy_dir)], files, spec,
                                     text_is_rendered)
    job = TrainJob(model_dir, policy_dir, tuple(files), spec,
                   Path(errors_path) if errors_path else policy_dir.with_name(policy_dir.name + ".train-errors.jsonl"),
                   LoraSpec(rank, alpha if alpha is not None else 2.0 * rank, LoraSpec.parse_targets(targets), rslora),
                   LoopSettings(epochs, lr, batch_tokens, seed, patience, class_weight=class_weight),
                   label_column, holdout, device, precision, max_length, template, text_is_rendered, force)
    bar = None if no_progress else _Progress(epochs)
    try:
        result = train_policy(job, bar.update if bar else None, say=click.echo)
    finally:
        if bar:
            bar.close()
    fit, rec = result.fit, result.record
    for e in [fit.initial, *fit.epochs]:
        auc = "n/a" if e.holdout_roc_auc is None else f"{e.holdout_roc_auc:.4f}"
        head = "untrained" if e.train_loss is None else f"epoch {e.epoch}: train loss {e.train_loss:.4f},"
        click.echo(f"{head} holdout loss {e.holdout_loss:.4f}, holdout ROC AUC {auc} ({e.seconds:.1f} s)")
    after = rec["holdout_after_calibration"]
    click.echo(f"kept epoch {fit.best_epoch} of {len(fit.epochs)}; {fit.tokens:,} tokens in {fit.seconds:.1f} s "
               f"({fit.tokens / max(fit.seconds, 1e-9):,.0f} tokens/s)")
    figures = (f"{k} {'n/a' if after[k] is None else format(after[k], '.4f')}"
               for k in ("log_loss", "roc_auc", "pr_auc", "f1"))
    click.echo("holdout after calibration: " + ", ".join(figures))
    click.echo(f"wrote {policy_dir / 'adapter_model.safetensors'} and {policy_dir / 'policy.json'}")


def _require_training_libraries() -> None:
    import importlib.util

    missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.UsageError(f"train needs {' and '.join(missing)}: pip install 'policyscan[train]'")


class _Progress:
    """A bar over training steps with the last loss and holdout loss; created on the first step (the step count is
    known only once the rows are read)."""

    def __init__(self, epochs: int):
        from tqdm import tqdm

        self.bar = tqdm(unit="step", desc="train", dynamic_ncols=True)
        self.epochs, self.holdout = epochs, None

    def update(self, what: str, value: float) -> None:
        if what == "total":
            self.bar.reset(total=int(value))
        elif what == "step":
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{value:.4f}", holdout=self.holdout or "-", refresh=False)
        else:
            self.holdout = f"{value:.4f}"

    def close(self) -> None:
        self.bar.close()
