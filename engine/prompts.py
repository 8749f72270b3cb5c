"""Conversation x policy -> token ids: [BOS] + enc(prefix) + enc(conversation) + enc(suffix).

Each piece is encoded without special tokens; a SentencePiece-style tokenizer's '▁' before the text (Llama 2,
Mistral) goes on the prefix only, as in the whole prompt's tokenization: what follows is encoded with the
tokenizer's continuation form (`_continuation`). gigatoken is the fast path (about 70x faster than
`tokenizers` on 2 cores, measured on byte-level BPE); it is used only after it agreed with `tokenizers`
on probe texts, and any tokenizer it refuses falls back to `tokenizers`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from policyscan.engine.chat_template import ChatTemplate, choose_template, config_templates, token_str
from policyscan.engine.errors import CheckpointError, InputError, PolicyError
from policyscan.engine.policy import Policy

NO_TEMPLATE = "the model ships no chat template and no --chat-template or policy chat_template names one"
PROBES = ["Hello, world!", "  leading spaces\tand\ttabs\n\nnew lines  ", "Ünïcödé — 中文 ✓ 😀 émoji",
          "user: my SSN is 123-45-6789.\nassistant: I can't store that.", "numbers 3.14159 and 1,000,000",
          "<|begin_of_text|>not special here?", "'s 're 've 'll don't CAPS MiXeD", ""]


class TextEncoder:
    """Encodes texts without special tokens; knows the BOS the tokenizer adds and the chat template."""

    def __init__(self, model_dir: str | Path, fast: bool = True, chat_template: str | None = None,
                 policies: list[Policy] = ()):
        """chat_template: --chat-template (plain, a file, a name of the model's templates); None: the one the
        policies name, else the model's default (chat_template.choose_template)."""
        self.model_dir = model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json; policyscan needs the fast-tokenizer file")
        self.tok = Tokenizer.from_file(str(path))
        self.cont = _continuation(self.tok)
        # gigatoken encodes as the file says, prepending included: a continuation form runs on `tokenizers`
        self.fast = _gigatoken(path, self.tok) if fast and self.cont is None else None
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a", add_special_tokens=True).ids
        self.bos: int | None = full[0] if len(full) > len(plain) and full[1:1 + len(plain)] == plain else None
        cfg_path = model_dir / "tokenizer_config.json"
        self.tokenizer_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = choose_template(model_dir, self.tokenizer_config, chat_template, policies)
        self.backend = ("gigatoken" if self.fast is not None else "tokenizers"
                        + (" (continuation form: no '▁' before a conversation, suffix or label)" if self.cont else ""))
        self.fast_texts = 0  # texts gigatoken encoded (and was trusted with) so far

    def encode_batch(self, texts: list[str], spot_checks: int = 8, full_checks: int = 4096) -> list[list[int]]:
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
        return [e.ids for e in (self.cont or self.tok).encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """A piece that follows other text (a conversation, a suffix)."""
        return self.encode_batch([text])[0]

    def encode_first(self, text: str) -> list[int]:
        """The piece that opens the prompt's text (a policy's prefix)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def render(self, messages: list[dict]) -> str:
        """A messages list as text, through the run's chat template."""
        if self.chat_template is None:  # the CLI refuses this before scoring; a row error for other callers
            raise InputError(f"{NO_TEMPLATE}; pass --chat-template plain for 'role: content' lines")
        return self.chat_template.render(messages)

    def describe_template(self) -> dict | None:
        """What the output's metadata records: the template's source and sha256 (None: no template)."""
        return None if self.chat_template is None else self.chat_template.describe()

    def verdict_ids(self, policy: Policy) -> tuple[int, int]:
        """(compliant, violation) token ids the verdict reads: each label's first token, as a guard model's card
        reads P(unsafe) from the first generated token; refused when the two labels start with the same token."""
        c, v = (self.encode(label) for label in (policy.compliant, policy.violation))
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


def _continuation(tok: Tokenizer) -> Tokenizer | None:
    """The tokenizer as it encodes text that follows other text, or None when that is the tokenizer itself. A
    SentencePiece-style tokenizer puts '▁' before the start of what it encodes (a Prepend normalizer, or a
    Metaspace pre-tokenizer that prepends): inside a prompt that holds for the prompt's first piece only."""
    spec = json.loads(tok.to_str())
    changed = False

    def strip(node: dict | None) -> dict | None:
        nonlocal changed
        if not isinstance(node, dict):
            return node
        if node.get("type") == "Prepend":
            changed = True
            return None
        if node.get("type") == "Metaspace" and (node.get("prepend_scheme", "always") != "never"
                                                or node.get("add_prefix_space")):
            changed = True
            node = {**node, "prepend_scheme": "never", "add_prefix_space": False}
        for key in ("normalizers", "pretokenizers"):
            if isinstance(node.get(key), list):
                node[key] = [n for n in (strip(n) for n in node[key]) if n is not None]
        return node

    spec["normalizer"] = strip(spec.get("normalizer"))
    spec["pre_tokenizer"] = strip(spec.get("pre_tokenizer"))
    return Tokenizer.from_str(json.dumps(spec)) if changed else None


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

    def __post_init__(self) -> None:
        fixed = len(self.bos) + len(self.prefix) + len(self.suffix)
        if fixed >= self.max_length:
            raise PolicyError(f"the policy's prefix and suffix take {fixed} tokens, leaving none of "
                              f"--max-length {self.max_length} for the conversation; raise --max-length")

    @classmethod
    def for_policy(cls, enc: TextEncoder, policy: Policy, max_length: int) -> "PromptBuilder":
        if enc.cont is not None and not policy.prefix:
            raise PolicyError(f"policy {policy.name!r} ({policy.path}) has no template prefix, so the conversation "
                              "would open the prompt's text, and this model's tokenizer puts '▁' before a text's "
                              "start: the conversation's tokens would depend on the policy. Give the policy a "
                              "prefix (e.g. the model's instruction header, such as '[INST] ')")
        return cls(tuple([enc.bos] if enc.bos is not None else []), tuple(enc.encode_first(policy.prefix)),
                   tuple(enc.encode(policy.suffix)), max_length)

    @property
    def budget(self) -> int:
        """Conversation tokens that fit."""
        return self.max_length - len(self.bos) - len(self.prefix) - len(self.suffix)

    @property
    def head(self) -> list[int]:
        """The fixed start of every prompt of this policy: what the prefix cache holds."""
        return [*self.bos, *self.prefix]

    def tail(self, conversation) -> list[int]:
        """The prompt after its head: the (left-truncated) conversation and the suffix."""
        conv = conversation[len(conversation) - self.budget:] if len(conversation) > self.budget else conversation
        return [*list(conv), *self.suffix]

    def build(self, conversation) -> tuple[list[int], bool]:
        """(ids, truncated): the latest conversation tokens are kept when it is too long."""
        return self.head + self.tail(conversation), len(conversation) > self.budget


def render_messages(messages: list[dict], template: str | None, tokenizer_config: dict) -> str:
    """A messages list -> text through a chat template (`template`, else the tokenizer config's)."""
    source = template if template is not None else config_templates(tokenizer_config, "")["default"][0]
    return ChatTemplate(source, "render_messages", token_str(tokenizer_config.get("eos_token"))).render(messages)
