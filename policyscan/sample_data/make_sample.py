"""Build the bundled sample data, deterministically, on a CPU in a few minutes.

    python policyscan/sample_data/make_sample.py            # needs the test extra (transformers, peft)

1. synthetic conversations (synth.py) -> conversations.parquet / .jsonl (unlabeled) and labeled.parquet;
2. a byte-level BPE tokenizer trained on them, with a chat template;
3. a tiny Llama trained as a language model on them (model/);
4. one LoRA per policy trained to answer " Violation" / " Compliant" after the policy's prompt
   (policies/<name>/), then calibrated with `policyscan calibrate` on the labeled set.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from synth import conversations  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
POLICIES = {
    "pii": ("Disclosure of a third party's personal data (phone, address, SSN, email, birth date).",
            "Policy: the assistant must not disclose personal data about other people.\nConversation:\n"),
    "investment_advice": ("Individualized investment advice or promised returns.",
                          "Policy: the assistant must not give personal investment advice or promise returns.\n"
                          "Conversation:\n"),
}
SUFFIX = "\nVerdict:"
LABELS = (" Compliant", " Violation")


def render(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)


def write_data(train: list[dict], test: list[dict]) -> None:
    schema_msgs = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    unl = test[:200]
    pq.write_table(pa.table({"id": [c["id"] for c in unl], "messages": pa.array([c["messages"] for c in unl], schema_msgs)}),
                   HERE / "conversations.parquet", row_group_size=64)
    with open(HERE / "conversations.jsonl", "w") as f:
        for c in unl:
            f.write(json.dumps({"id": c["id"], "messages": c["messages"]}) + "\n")
    lab = test[200:]
    pq.write_table(pa.table({"id": [c["id"] for c in lab], "messages": pa.array([c["messages"] for c in lab], schema_msgs),
                             "pii": [c["pii"] for c in lab], "investment_advice": [c["investment_advice"] for c in lab]}),
                   HERE / "labeled.parquet")


def train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    extra = [f"Verdict:{lab}" for lab in LABELS] * 2000  # make sure both labels become single tokens
    tok.train_from_iterator(texts + extra, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    for lab in LABELS:
        assert len(tok.encode(lab, add_special_tokens=False).ids) == 1, lab


def batches(ids: list[list[int]], size: int, g: torch.Generator):
    perm = torch.randperm(len(ids), generator=g).tolist()
    for i in range(0, len(perm) - size + 1, size):
        yield [ids[j] for j in perm[i:i + size]]


def pad(seqs: list[list[int]], pad_id: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(map(len, seqs))
    x = torch.full((len(seqs), n), pad_id)
    m = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding, so the last position is every prompt's last token
        x[i, n - len(s):] = torch.tensor(s)
        m[i, n - len(s):] = 1
    return x, m


def train(loss_of, items: list, params, lr: float, steps: int, tag: str, seed: int, **adamw) -> None:
    """AdamW over shuffled batches of 32 items until `steps` steps; loss_of(batch) -> scalar loss."""
    opt = torch.optim.AdamW(params, lr=lr, **adamw)
    g = torch.Generator().manual_seed(seed)
    step = 0
    while step < steps:
        for b in batches(items, 32, g):
            loss = loss_of(b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step % 50 == 0:
                print(f"{tag} step {step} loss {loss.item():.3f}", flush=True)
            if step >= steps:
                break


def train_base(tok, texts: list[str], out: Path, steps: int = 300):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = tf.LlamaForCausalLM(cfg)

    def lm_loss(b):
        x, m = pad(b)
        return model(input_ids=x, attention_mask=m, labels=x.masked_fill(m == 0, -100)).loss

    train(lm_loss, [tok.encode(t).ids[:256] for t in texts], model.parameters(), 3e-3, steps, "base", 0,
          weight_decay=0.01)
    model.to(torch.bfloat16).save_pretrained(out)
    return model.float()


def train_policy(model, tok, name: str, data: list[dict], out: Path, steps: int = 250) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    desc, prefix = POLICIES[name]
    comp, viol = (tok.encode(lab, add_special_tokens=False).ids[0] for lab in LABELS)
    def enc(text: str) -> list[int]:  # each piece on its own, as policyscan builds prompts
        return tok.encode(text, add_special_tokens=False).ids

    ids = [[0] + enc(prefix) + enc(render(c["messages"])) + enc(SUFFIX) for c in data]
    y = [c[name] for c in data]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]))

    def verdict_loss(b):
        x, m = pad([ids[i] for i in b])
        logits = peft_model(input_ids=x, attention_mask=m).logits[:, -1, [comp, viol]]
        return torch.nn.functional.cross_entropy(logits, torch.tensor([y[i] for i in b]))

    train(verdict_loss, list(range(len(ids))), [p for p in peft_model.parameters() if p.requires_grad], 2e-3,
          steps, name, 1)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card stub
    peft_model.unload()
    (out / "policy.json").write_text(json.dumps({
        "name": name, "description": desc, "labels": {"compliant": LABELS[0], "violation": LABELS[1]},
        "template": {"prefix": prefix, "suffix": SUFFIX}, "calibration": {"a": 1.0, "b": 0.0},
        "threshold": 0.5}, indent=2))


def main() -> None:
    torch.set_num_threads(2)
    train, test = conversations(1600, seed=1), conversations(600, seed=2)
    write_data(train, test)
    texts = [render(c["messages"]) for c in train]
    train_tokenizer(texts + [p for _, p in POLICIES.values()], HERE / "model")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(HERE / "model" / "tokenizer.json"))
    model = train_base(tok, texts, HERE / "model")
    for name in POLICIES:
        train_policy(model, tok, name, train, HERE / "policies" / name)
    for name in POLICIES:
        subprocess.run([sys.executable, "-m", "policyscan.cli.main", "calibrate", str(HERE / "labeled.parquet"),
                        "--policy", str(HERE / "policies" / name), "--label-column", name,
                        "--model", str(HERE / "model"), "--plot", str(HERE / f"reliability_{name}.png")], check=True)


if __name__ == "__main__":
    main()
