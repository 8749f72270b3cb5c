"""The differentiable verdict: transformers + PEFT loaded from the checkpoint files, and f = logit(violation) -
logit(compliant) at each prompt's last position, read from the two label rows of the head, never the vocabulary.
The same f `score` computes (the final logit soft-capping and granite's logit scaling included)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from policyscan.engine.model.config import PROJECTIONS
from policyscan.engine.settings import OptionError

TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}


@dataclass(frozen=True)
class LoraSpec:
    """The adapter to fit: rank, alpha, the projections it adapts, rsLoRA's alpha / sqrt(r) scaling."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = tuple(TARGETS.values())
    rslora: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= 1024:
            raise OptionError(f"--rank {self.rank}: give a rank from 1 to 1024")
        if not 0 < self.alpha < 1e6:
            raise OptionError(f"--alpha {self.alpha}: give a positive alpha")
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if unknown or not self.targets:
            raise OptionError(f"--targets: {unknown or 'none'} is not among {', '.join(TARGETS)}")

    @classmethod
    def parse_targets(cls, text: str) -> tuple[str, ...]:
        """'q,k,v,o,gate,up,down' (or the projections' own names) -> the projections' names, in layer order."""
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in names if t not in TARGETS and t not in TARGETS.values()]
        if bad or not names:
            raise OptionError(f"--targets {text!r}: {bad or 'nothing'} is not among {', '.join(TARGETS)}")
        chosen = {TARGETS.get(t, t) for t in names}
        return tuple(p for p in TARGETS.values() if p in chosen)


class VerdictModel:
    """A base model with one trainable LoRA adapter; f() is the verdict on a padded batch."""

    def __init__(self, base, label_ids: tuple[int, int], lora: LoraSpec, seed: int):
        """`base`: a transformers causal LM, frozen here and given the adapter."""
        from peft import LoraConfig, get_peft_model

        for p in base.parameters():
            p.requires_grad_(False)
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets), lora_dropout=0.0,
                            use_rslora=lora.rslora, bias="none")
        torch.manual_seed(seed)  # the A factors' initialization; B starts at zero, so f starts as the base's
        self.peft = get_peft_model(base, config)
        self.causal = self.peft.get_base_model()
        self.device = next(base.parameters()).device
        c, v = label_ids
        self.rows = torch.tensor([c, v], device=self.device)
        hf = self.causal.config
        self.softcap = getattr(hf, "final_logit_softcapping", None)
        self.logits_scale = float(getattr(hf, "logits_scaling", 1.0) or 1.0)

    @classmethod
    def load(cls, model_dir: Path, label_ids: tuple[int, int], lora: LoraSpec, device: torch.device,
             dtype: torch.dtype, seed: int) -> "VerdictModel":
        """The base read from the checkpoint files by transformers (never a model cast in memory)."""
        import transformers as tf

        tf.utils.logging.disable_progress_bar()  # train draws its own
        base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        return cls(base.to(device), label_ids, lora, seed)

    def f(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """f (float32) per row of a right-padded batch; `last` holds each row's last token position."""
        hidden = self.causal.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = hidden[torch.arange(len(last), device=hidden.device), last].float()
        logits = h @ self.causal.get_output_embeddings().weight[self.rows].float().T
        logits = logits / self.logits_scale
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits[:, 1] - logits[:, 0]

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.peft.parameters() if p.requires_grad]

    def state(self) -> dict[str, torch.Tensor]:
        """The adapter's factors as PEFT saves them (names without the adapter's name), copied."""
        from peft import get_peft_model_state_dict
        return {k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
                for k, v in get_peft_model_state_dict(self.peft).items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(self.peft, state)

    def save(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """adapter_config.json and adapter_model.safetensors in PEFT's layout (what PeftModel.from_pretrained and
        `score` read), written directly: the same bytes for the same factors."""
        from safetensors.torch import save_file

        cfg = self.peft.peft_config["default"].to_dict()
        cfg = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in cfg.items()}
        cfg["base_model_name_or_path"] = None  # the base is --model's; no machine's path in the bundle
        (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
        save_file(dict(sorted(state.items())), folder / "adapter_model.safetensors", metadata={"format": "pt"})
