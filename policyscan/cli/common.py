"""Shared CLI pieces: default model and policies, engine options, errors printed for people."""
from __future__ import annotations

import errno
import functools
import math
import os
import re
import sys
import threading
from pathlib import Path

import click

from policyscan.engine.errors import InputError, PolicyscanError
from policyscan.engine.files import check_regular
from policyscan.engine.inputs.discover import named_inputs
from policyscan.engine.inputs.jsonl import parsed_lines
from policyscan.engine.inputs.sources import ReadSpec, pick_column
from policyscan.engine.model.config import ModelConfig, read_config
from policyscan.engine.settings import (
    MAX_BATCH_TOKENS,
    MAX_DEVICES,
    MAX_LENGTH_LIMIT,
    MIN_TOKENS,
    OptionError,
    check_device_name,
    max_threads,
)
from policyscan.engine.text.chat_template import TemplateChoiceError, choose_template, read_tokenizer_config
from policyscan.engine.text.content import NO_TEMPLATE

# the repository's sample_data; an installed wheel ships it as the package policyscan.sample_data, the same place
SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_ROW_ERRORS = 0, 1, 2, 3


def default_model() -> str:
    return os.environ.get("POLICYSCAN_MODEL") or str(SAMPLE / "model")


def default_policies() -> tuple[str, ...]:
    env = os.environ.get("POLICYSCAN_POLICIES")
    return tuple(env.split(os.pathsep)) if env else (str(SAMPLE / "policies"),)


def preload_arrow() -> None:
    """Start pyarrow's one-time setup in a thread while the policies load: pyarrow imports pandas (when it is
    installed) on the first array it builds from Python or numpy objects, which was the first chunk's write,
    inside the scoring window; and the writer's first `take` imports pyarrow.compute. Not beside the model load:
    an import holds the GIL, which each of the load's GPU calls must take back, and they waited seconds for it
    while pandas compiled on a machine without bytecode caches (docs/performance.md)."""
    threading.Thread(target=_first_arrays, name="policyscan-preload-arrow", daemon=True).start()


def _first_arrays() -> None:
    import pyarrow as pa

    pa.array([0.0]).take(pa.array([0]))


def model_option(f):
    return click.option("--model", "model", default=None, metavar="DIR",
                        help="Hugging Face model directory [default: $POLICYSCAN_MODEL, else the sample model]")(f)


class Share(click.FloatRange):
    """A number in a closed range. FloatRange lets NaN through (it compares false with both bounds): refused here."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if math.isnan(rv):
            self.fail(f"{value!r} is not a number; give one in the range {self.min}<=x<={self.max}", param, ctx)
        return rv


def engine_options(f):
    """--device, --precision, --batch-tokens, --max-length, --cuda-graphs, --fp8-flip-limit, --threads. Their
    bounds are engine/settings.py's, which EngineSettings checks again for callers of the library."""
    for opt in reversed([
        click.option("--device", default="auto", show_default=True, callback=check_device,
                     help="auto | cpu | cuda | cuda:N"),
        click.option("--precision", default="auto", show_default=True,
                     type=click.Choice(["auto", "fp8", "bf16", "fp32"]),
                     help="auto: FP8 on a GPU, fp32 on the CPU"),
        click.option("--batch-tokens", default=65536, show_default=True,
                     type=click.IntRange(MIN_TOKENS, MAX_BATCH_TOKENS),
                     help="prompt tokens per packed batch (the model may allow fewer: checked when it loads)"),
        click.option("--max-length", default=2048, show_default=True, type=click.IntRange(MIN_TOKENS, MAX_LENGTH_LIMIT),
                     help="longest prompt; longer conversations lose their oldest tokens"),
        click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                     help="replay batches of up to 4096 tokens from CUDA graphs (GPU only; same results bit "
                          "for bit, fewer kernel launches)"),
        click.option("--fp8-flip-limit", default=0.01, show_default=True, type=Share(0, 1),
                     metavar="SHARE", help="--precision auto on a GPU runs bf16 when calibrate found FP8 flipping "
                                           "more than this share of a policy's labeled verdicts"),
        click.option("--threads", default=None, type=click.IntRange(1, max_threads()), metavar="N",
                     help="CPU threads (CPU path only; the same results bit for bit at any count; at most 4 per "
                          "CPU of this machine) [default: the CPUs this process may use, at most 4]"),
    ]):
        f = opt(f)
    return f


def conversation_options(f):
    """--chat-template and --text-is-rendered: how a conversation cell becomes the text the model reads."""
    f = click.option("--text-is-rendered", is_flag=True,
                     help="the text column holds trusted prompts rendered with their markup: its special-token "
                          "strings are control tokens (by default everything a conversation holds is text)")(f)
    return click.option("--chat-template", default=None, metavar="FILE|NAME|plain",
                        help="renders a messages column: a Jinja file, a name of the model's templates, or plain "
                             "('role: content' lines) [default: the policies' chat_template, else the model's]")(f)


def resolve_chat_template(model_dir: Path, choice: str | None, policies: list, files: list[Path],
                          spec: ReadSpec, text_is_rendered: bool = False) -> str | None:
    """--chat-template made absolute (the metadata records it; verify reruns from anywhere), after checking,
    before anything loads, that it names a template, that every input with a messages column has one, and that
    --text-is-rendered (which a messages column would ignore) meets text columns only."""
    if text_is_rendered and (messages := next((f for f in files if _has_messages(f, spec)), None)):
        raise click.UsageError(f"--text-is-rendered declares text columns of prompts rendered with their markup, "
                               f"but {messages} holds its conversations in a messages column, which the chat "
                               "template renders: drop --text-is-rendered, or name the text column with "
                               "--text-column")
    try:
        template = choose_template(model_dir, read_tokenizer_config(model_dir), choice, policies)
    except TemplateChoiceError as e:
        raise click.UsageError(str(e)) from e
    if template is None and (needing := [f for f in files if _has_messages(f, spec)]):
        raise click.UsageError(f"{needing[0]} has a messages column, but {NO_TEMPLATE} ({model_dir}); pass "
                               "--chat-template FILE or a template's name, or --chat-template plain for "
                               "'role: content' lines")
    return template_arg(choice)


def template_arg(choice: str | None) -> str | None:
    """--chat-template as the engine takes it: a file's path made absolute, anything else as given."""
    return choice if choice is None or choice == "plain" or not Path(choice).is_file() else str(Path(choice).resolve())


def _has_messages(path: Path, spec: ReadSpec) -> bool:
    """Whether the reader will take `path`'s conversation from a messages column (pick_column on the names the
    reader sees: a Parquet schema, the keys of a JSONL file's first chunk). A file it cannot read is its error."""
    import pyarrow.parquet as pq

    if spec.text_column or spec.messages_column:
        return spec.messages_column is not None
    try:
        check_regular(path)
        if path.name.endswith(".parquet"):
            names = pq.ParquetFile(path).schema_arrow.names
        else:
            keys: dict[str, None] = {}
            for n, ((_, obj, _), _) in enumerate(parsed_lines(path)):
                keys.update(dict.fromkeys(obj or {}))
                if n + 1 >= spec.chunk_rows:
                    break
            names = list(keys)
        return pick_column(spec, names, path)[1]
    except Exception:  # unreadable, or no conversation column: reported per file when it is read
        return False


def check_device(ctx, param, value: str | None) -> str | None:
    """--device: a usage error (exit 2) before anything loads."""
    if value is not None:
        try:
            check_device_name(value)
        except OptionError:
            raise click.BadParameter(f"{value!r}: use auto, cpu, cuda or cuda:N (N below {MAX_DEVICES})") from None
    return value


def check_devices(ctx, param, value: str) -> str:
    """--devices: all, a count of 1 to MAX_DEVICES, or distinct indices below it; whether the host has those GPUs
    is checked once they are counted (workers.parse_devices)."""
    text = value.strip()
    if text == "all":
        return value
    if "," not in text:
        if re.fullmatch(r"\d{1,3}", text) and 1 <= int(text) <= MAX_DEVICES:
            return value
    else:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        indices = [int(p) for p in parts if re.fullmatch(r"\d{1,3}", p)]
        if parts and len(indices) == len(parts) == len(set(indices)) and max(indices) < MAX_DEVICES:
            return value
    raise click.BadParameter(f"{value!r}: use all, a count of 1 to {MAX_DEVICES}, or distinct GPU indices below "
                             f"{MAX_DEVICES} separated by commas, such as 0,2")


def check_lengths(batch_tokens: int, max_length: int, model_dir: Path) -> None:
    """Before any input is read: a packed batch holds a whole prompt, as long as the model lets a prompt be."""
    if batch_tokens < max_length:  # only then does the model's config.json matter
        if small := ModelConfig.from_dict(read_config(model_dir)).batch_too_small(batch_tokens, max_length):
            raise click.UsageError(small)


def input_files(inputs: list[str]) -> list[Path]:
    """The files INPUTs name; one that names nothing is a usage error (exit 2)."""
    return [f for f, _ in named_input_files(inputs)]


def named_input_files(inputs: list[str]) -> list[tuple[Path, Path]]:
    """The files INPUTs name, each with its name below the folder or glob that found it (discover.named_inputs)."""
    try:
        return named_inputs(inputs)
    except InputError as e:
        raise click.UsageError(str(e)) from e


def check_writable_dir(folder: Path, what: str) -> None:
    """Before any scoring: the folder an output goes to exists and takes new files."""
    if folder.exists() and not folder.is_dir():
        raise click.UsageError(f"{what}: {folder} is not a folder; write elsewhere")
    if not folder.is_dir():
        raise click.UsageError(f"{what}: folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise click.UsageError(f"{what}: folder {folder} is not writable; write elsewhere")


def protected_files(inputs: list[Path], model_dir: Path, policy_dirs: list[Path]) -> dict[Path, str]:
    """What a run reads and must never write over: inputs, the model's files, the policies' files."""
    out = {p: "an input" for p in inputs}
    if model_dir.is_dir():
        out.update({p: f"a file of the model {model_dir}" for p in model_dir.rglob("*") if p.is_file()})
    for d in policy_dirs:
        out.update({p: f"a file of the policy {d}" for p in d.iterdir() if p.is_file()})
    return out


def refuse_overwrites(outputs: list[tuple[Path, str]], protected: dict[Path, str]) -> None:
    """outputs: (path, what it is: output, errors file, metadata). None may be a protected file (by its
    resolved path or as the same file through a link) or another of the outputs."""
    ids = {key: (p, what) for p, what in protected.items() if (key := _file_id(p)) is not None}
    resolved = {p.resolve(): (p, what) for p, what in protected.items()}
    seen: dict[Path, str] = {}
    for path, what in outputs:
        key = _file_id(path)
        hit = resolved.get(path.resolve()) or (ids.get(key) if key is not None else None)
        if hit:
            raise click.UsageError(f"{what} {path} is {hit[1]} ({hit[0]}); writing it would destroy it: "
                                   "choose another path")
        if path.resolve() in seen:
            raise click.UsageError(f"{what} {path} is also the {seen[path.resolve()]}; give them different paths")
        seen[path.resolve()] = what


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:  # not there yet: no file it could be
        return None
    return st.st_dev, st.st_ino


def friendly_errors(f):
    """OptionError -> a usage error (exit 2); another PolicyscanError or OSError (a full disk) -> one line on stderr
    and exit 1; Ctrl-C -> exit 130."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except OptionError as e:  # a setting out of range or clashing with another, found past click's own checks
            raise click.UsageError(str(e)) from e
        except PolicyscanError as e:
            click.echo(f"policyscan: error: {e}", err=True)
            sys.exit(EXIT_FAILURE)
        except OSError as e:
            hint = "; the disk is full: free space or write elsewhere" if e.errno == errno.ENOSPC else ""
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"policyscan: error: {where}{e.strerror or e}{hint}; no partial output was left behind",
                       err=True)
            sys.exit(EXIT_FAILURE)
        except KeyboardInterrupt:
            click.echo("policyscan: interrupted; no partial output was left behind", err=True)
            sys.exit(130)
    return wrapper
