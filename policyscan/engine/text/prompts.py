"""Conversation x policy -> token ids: [BOS] + enc(prefix) + enc(conversation) + enc(suffix).

Each piece is encoded without special tokens. Most tokenizers encode a piece alone as it does inside the whole
prompt after a newline, where a template's pieces usually meet. A SentencePiece-style one (Llama 2, Mistral)
puts '▁' before a text's start: there the prefix opens the text and the pieces after it are encoded as they
follow other text (`TextEncoder.after`), the suffix as it follows a special token when a conversation ends in one.
gigatoken is the fast path (many times faster than `tokenizers` on byte-level BPE: docs/performance.md); it is used
only after it agreed with `tokenizers` on probe texts, and any tokenizer it refuses falls back to `tokenizers`.

Conversation texts arrive marked (engine/text/content.py): a text without marks is encoded as tokenizers reads it, its
special-token strings control tokens (the template's markup, a policy's prefix and suffix); a marked text is read
into text runs and markup tokens, and its runs are encoded with special-token strings as plain text.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from policyscan.engine.errors import CheckpointError, PolicyError
from policyscan.engine.policy.bundle import Policy
from policyscan.engine.text.chat_template import (
    ChatTemplate,
    choose_template,
    config_templates,
    read_tokenizer_config,
    token_str,
)
from policyscan.engine.text.content import ContentGuard, Conversations

# What a piece after the prefix is encoded behind: text no vocabulary holds (a private-use character, which
# falls back to bytes or <unk>), so nothing merges across it; a newline did merge with a suffix's leading "\n".
SEAM = "\ue000"
PROBES = ["Hello, world!", "  leading spaces\tand\ttabs\n\nnew lines  ", "Ünïcödé — 中文 ✓ 😀 émoji",
          "user: my SSN is 123-45-6789.\nassistant: I can't store that.", "numbers 3.14159 and 1,000,000",
          "<|begin_of_text|>not special here?", "'s 're 've 'll don't CAPS MiXeD", ""]


class TextEncoder:
    """Encodes texts without special tokens; knows the BOS the tokenizer adds and the chat template."""

    def __init__(self, model_dir: str | Path, fast: bool = True, chat_template: str | None = None,
                 policies: list[Policy] = (), text_is_rendered: bool = False):
        """chat_template: --chat-template (plain, a file, a name of the model's templates); None: the one the
        policies name, else the model's default (chat_template.choose_template). text_is_rendered: a text column
        holds trusted rendered prompts whose special-token strings are control tokens."""
        self.model_dir = model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json; policyscan needs the fast-tokenizer file")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"{path}: not a tokenizer file the tokenizers library reads ({e}); "
                                  "re-save it with transformers' save_pretrained") from e
        added = self.tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.guard = ContentGuard.of_tokenizer(self.tok)
        self.plain = Tokenizer.from_str(self.tok.to_str())  # special-token strings encode as text here
        self.plain.encode_special_tokens = True
        # tokenizers matches a normalized special token after normalizing; the guard sees only the raw text
        self.read_all = any(t.special and t.normalized for t in added.values())
        self._special = next((added[i].content for i in sorted(self.special_ids)), None)
        self.apart = _encodes_apart(self.tok)  # pieces encode alone as they do after a newline
        self.fast = _gigatoken(path, self.tok) if fast and self.apart else None
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a", add_special_tokens=True).ids
        self.bos: int | None = full[0] if len(full) > len(plain) and full[1:1 + len(plain)] == plain else None
        self.tokenizer_config = read_tokenizer_config(model_dir)
        self.render = Conversations(choose_template(model_dir, self.tokenizer_config, chat_template, policies),
                                    self.guard, text_is_rendered)
        self.runs_after_special_as_first = self._runs_after_special_as_first()
        self.backend = ("gigatoken" if self.fast is not None else "tokenizers"
                        + ("" if self.apart else " (each piece after the prefix as it follows other text: the "
                                                 "tokenizer puts '▁' before a text's start)"))
        self.fast_texts = 0  # texts gigatoken encoded (and was trusted with) so far

    def encode_batch(self, texts: list[str], spot_checks: int = 8, full_checks: int = 4096) -> list[list[int]]:
        """Token ids, BOS not added, of texts as `render` marks them (see the module's docstring)."""
        marked = [i for i, t in enumerate(texts) if self.read_all or self.guard.needs_reading(t)]
        if not marked:
            return self._encode_unmarked(texts, spot_checks, full_checks)
        out: list[list[int] | None] = [None] * len(texts)
        for i in marked:
            out[i] = self.encode_marked(texts[i])
        rest = [i for i, o in enumerate(out) if o is None]
        for i, ids in zip(rest, self._encode_unmarked([texts[i] for i in rest], spot_checks, full_checks)):
            out[i] = ids
        return out

    def encode_marked(self, text: str) -> list[int]:
        """A marked text: its markup's special tokens, and its text runs encoded with special-token strings as text;
        each run as a piece of text where it stands (the conversation's first as it follows the prefix, the others
        as they follow a special token)."""
        ids: list[int] = []
        for i, piece in enumerate(self.guard.pieces(text)):
            if isinstance(piece, int):
                ids.append(piece)
            elif self.apart or (i > 0 and self.runs_after_special_as_first):
                ids += self.plain.encode(piece, add_special_tokens=False).ids
            else:
                ids += self.after(SEAM, [piece], self.plain)[0]
        return ids

    def _encode_unmarked(self, texts: list[str], spot_checks: int, full_checks: int) -> list[list[int]]:
        """Token ids without special tokens. With gigatoken, the first `full_checks` texts are all encoded by
        `tokenizers` too (most disagreements then show before any row is written), later calls `spot_checks`
        of theirs; on any disagreement policyscan falls back to `tokenizers` for good (this call too), and the
        backend it records says how many texts gigatoken had encoded before."""
        if self.fast is not None:
            ids = self.fast.encode_batch_list(texts)
            full = max(0, min(len(texts), full_checks - self.fast_texts))
            step = max(1, (len(texts) - full) // spot_checks)
            sample = list(range(full)) + list(range(full, len(texts), step))[:spot_checks]
            slow = self.tok.encode_batch([texts[i] for i in sample], add_special_tokens=False)
            if all(ids[i] == e.ids for i, e in zip(sample, slow)):
                self.fast_texts += len(texts)
                return ids
            self.fast = None
            self.backend = (f"tokenizers (gigatoken disagreed on a conversation; it had encoded {self.fast_texts} "
                            f"texts before, the first {min(self.fast_texts, full_checks)} checked in full)")
        if self.apart:
            return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        return self.after(SEAM, texts)

    def encode(self, text: str) -> list[int]:
        """A piece that follows other text (a conversation, a suffix, a label)."""
        return self.encode_batch([text])[0]

    def after(self, lead: str, texts: list[str], tok: Tokenizer | None = None) -> list[list[int]]:
        """Each text's tokens as they follow `lead` in one text: lead + text encoded (by `tok`, default the
        tokenizer), lead's own tokens cut off (a text that still merges with `lead` across the seam: encoded alone)."""
        tok = tok or self.tok
        head = tok.encode(lead, add_special_tokens=False).ids
        return [e.ids[len(head):] if e.ids[:len(head)] == head else tok.encode(t, add_special_tokens=False).ids
                for t, e in zip(texts, tok.encode_batch([lead + t for t in texts], add_special_tokens=False))]

    def _runs_after_special_as_first(self) -> bool:
        """Whether tokenizers encodes text after a special token as it encodes a text's start (a legacy Prepend
        normalizer does, a Metaspace that prepends to the first piece only does not)."""
        if self.apart or self._special is None:
            return True
        probe = "a b"
        return self.tok.encode(self._special + probe, add_special_tokens=False).ids[1:] == \
            self.tok.encode(probe, add_special_tokens=False).ids

    def after_special(self, text: str) -> list[int] | None:
        """The text's tokens after a special token, where that differs from after other text; else None."""
        if self.apart or self._special is None:
            return None
        ids = self.after(self._special, [text])[0]
        return ids if ids != self.encode(text) else None

    def encode_first(self, text: str) -> list[int]:
        """The piece that opens the prompt's text (a policy's prefix)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The run's chat template (None: the model has none and no option names one)."""
        return self.render.template

    def describe_template(self) -> dict | None:
        """What the output's metadata records: the template's source and sha256 (None: no template)."""
        return None if self.chat_template is None else self.chat_template.describe()

    def verdict_ids(self, policy: Policy) -> tuple[int, int]:
        """(compliant, violation) token ids the verdict reads: each label's first token, as a guard model's card
        reads P(unsafe) from the first generated token; refused when the two labels start with the same token."""
        last = self.encode(policy.suffix)[-1:]
        after_special = bool(last) and last[0] in self.special_ids  # the label follows a special token
        c, v = ((self.after_special(label) if after_special else None) or self.encode(label)
                for label in (policy.compliant, policy.violation))
        where = f"policy {policy.name!r} ({policy.path})"
        for label, ids in ((policy.compliant, c), (policy.violation, v)):
            if not ids:
                raise PolicyError(f"{where}: label {label!r} encodes to no tokens with this model's tokenizer")
        if c[0] == v[0]:
            pieces = [[self.tok.id_to_token(i) for i in ids] for ids in (c, v)]
            raise PolicyError(f"{where}: labels {policy.compliant!r} {pieces[0]} and {policy.violation!r} "
                              f"{pieces[1]} start with the same token, so the first token cannot tell them apart; "
                              "choose labels whose first tokens differ (e.g. ' safe' and ' unsafe')")
        return c[0], v[0]

    def label_tokens(self, label: str) -> list[str]:
        """The tokens a label encodes to (what `inspect` shows)."""
        return [self.tok.id_to_token(i) for i in self.encode(label)]


def _encodes_apart(tok: Tokenizer) -> bool:
    """Whether texts encode alone as they do after a newline (False: the tokenizer marks a text's start)."""
    head = tok.encode("\n", add_special_tokens=False).ids
    return all(head + tok.encode(t, add_special_tokens=False).ids == tok.encode("\n" + t, add_special_tokens=False).ids
               for t in ("user: hello", "Yes", " Yes", "a b"))


def _gigatoken(path: Path, tok: Tokenizer):
    try:
        import gigatoken

        fast = gigatoken.Tokenizer(str(path))
        got = fast.encode_batch_list(PROBES)
    except Exception:  # gigatoken refuses some pre-tokenizers (custom Split, Sequence, non-byte-level)
        return None
    want = [e.ids for e in tok.encode_batch(PROBES, add_special_tokens=False)]
    return fast if got == want else None


@dataclass(frozen=True)
class PromptBuilder:
    """One policy's fixed pieces; builds prompts with left truncation of the conversation."""

    bos: tuple[int, ...]
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    max_length: int
    suffix_after_special: tuple[int, ...] | None = None  # the suffix after a conversation that ends in one
    special_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        fixed = len(self.bos) + len(self.prefix) + max(len(self.suffix), len(self.suffix_after_special or ()))
        if fixed >= self.max_length:
            raise PolicyError(f"the policy's prefix and suffix take {fixed} tokens, leaving none of the "
                              f"{self.max_length} a prompt may take (--max-length, or the model's "
                              "max_position_embeddings when fewer) for the conversation; shorten the template, or "
                              "raise --max-length if it is the smaller")

    @classmethod
    def for_policy(cls, enc: TextEncoder, policy: Policy, max_length: int) -> "PromptBuilder":
        prefix = enc.encode_first(policy.prefix)
        if not enc.apart and (not prefix or prefix[-1] in enc.special_ids):
            raise PolicyError(f"policy {policy.name!r} ({policy.path}): this model's tokenizer puts '▁' before a "
                              "text's start, so the conversation is encoded as it follows other text, and this "
                              "policy's template prefix " + ("is empty" if not prefix else "ends in a special token")
                              + ". End the prefix with a newline (e.g. the model's instruction header and '\\n')")
        after = enc.after_special(policy.suffix)
        return cls(tuple([enc.bos] if enc.bos is not None else []), tuple(prefix), tuple(enc.encode(policy.suffix)),
                   max_length, tuple(after) if after is not None else None, enc.special_ids)

    @property
    def budget(self) -> int:
        """Conversation tokens that fit."""
        return self.max_length - len(self.bos) - len(self.prefix) - max(len(self.suffix),
                                                                         len(self.suffix_after_special or ()))

    @property
    def head(self) -> list[int]:
        """The fixed start of every prompt of this policy: what the prefix cache holds."""
        return [*self.bos, *self.prefix]

    def tail(self, conversation) -> list[int]:
        """The prompt after its head: the (left-truncated) conversation and the suffix."""
        conv = conversation[len(conversation) - self.budget:] if len(conversation) > self.budget else conversation
        after = self.suffix_after_special is not None and len(conv) and int(conv[-1]) in self.special_ids
        return [*list(conv), *(self.suffix_after_special if after else self.suffix)]

    def build(self, conversation) -> tuple[list[int], bool]:
        """(ids, truncated): the latest conversation tokens are kept when it is too long."""
        return self.head + self.tail(conversation), len(conversation) > self.budget


def render_messages(messages: list[dict], template: str | None, tokenizer_config: dict) -> str:
    """A messages list -> text through a chat template (`template`, else the tokenizer config's)."""
    source = template if template is not None else config_templates(tokenizer_config, "")["default"][0]
    return ChatTemplate(source, "render_messages", token_str(tokenizer_config.get("eos_token"))).render(messages)


@dataclass(frozen=True)
class PolicyPrompts:
    """The prompt side of an engine without its model: the encoder and each policy's builder, as the Engine builds
    them. What `train` encodes with, so that its prompts are score's."""

    encoder: TextEncoder
    builders: tuple[PromptBuilder, ...]

    @classmethod
    def for_policies(cls, model_dir: str | Path, policies: list[Policy], max_length: int,
                     chat_template: str | None = None, text_is_rendered: bool = False) -> "PolicyPrompts":
        enc = TextEncoder(model_dir, chat_template=chat_template, policies=policies, text_is_rendered=text_is_rendered)
        return cls(enc, tuple(PromptBuilder.for_policy(enc, p, max_length) for p in policies))
