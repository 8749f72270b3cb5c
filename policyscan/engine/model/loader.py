"""Build a Decoder from a checkpoint and attach policies (stacked LoRA + head vectors)."""
from __future__ import annotations

from types import ModuleType

import torch

from policyscan.engine.errors import PolicyError
from policyscan.engine.model.checkpoint import Checkpoint, weight_name
from policyscan.engine.model.config import ModelConfig
from policyscan.engine.model.layers import DenseLoraLinear, Fp8LoraLinear, LoraStack, Prologue
from policyscan.engine.model.model import Decoder, DecoderLayer
from policyscan.engine.model.precision import Precision
from policyscan.engine.model.quant import dequantize_weight, quantize_weight
from policyscan.engine.model.read_ahead import ReadAhead, checkpoint_spans
from policyscan.engine.policy.bundle import Policy, check_policy
from policyscan.kernels.reference import interleave_halves

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def load_decoder(ckpt: Checkpoint, ops: ModuleType, precision: Precision,
                 device: torch.device | str = "cpu") -> Decoder:
    """Read each tensor once, streamed to the device (engine/model/read_ahead.py) and turned into its final dtype there
    (no second full copy of the model).

    precision.fp8_weights: base weights go through e4m3 with per-channel scales (kept from an FP8 checkpoint, else
    quantized); precision.w8a8 keeps them e4m3 in Fp8LoraLinear (the GPU kernels), otherwise they are dequantized
    to precision.dtype (the CPU path)."""
    if ckpt.fp8 and not precision.fp8_weights:
        raise ValueError(f"{ckpt.model_dir} is an FP8 checkpoint: its precision needs fp8_weights (got {precision})")
    with ReadAhead(ckpt, torch.device(device)) as reader:
        return _build(ckpt, ops, precision, reader.get)


def shaped_decoder(ckpt: Checkpoint, ops: ModuleType, precision: Precision, device: torch.device) -> Decoder:
    """load_decoder's Decoder with the weights unread (torch.empty, values undefined): the shapes, dtypes and
    strides that decide the kernels' variants, for compile-ahead's dry run before the real load."""
    layout = checkpoint_spans(ckpt)

    def get(name: str) -> torch.Tensor:
        span = layout.get(name)
        return ckpt.get(name).to(device) if span is None else torch.empty(span.shape, dtype=span.dtype, device=device)
    return _build(ckpt, ops, precision, get)


def _build(ckpt: Checkpoint, ops: ModuleType, precision: Precision, get) -> Decoder:
    cfg, dtype = ckpt.config, precision.dtype

    def weight(base: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = get(base + ".weight")
        if not precision.fp8_weights:
            return w.to(dtype), None
        w8, scale = (w, get(base + ".weight_scale").float().reshape(-1)) if ckpt.fp8 else quantize_weight(w)
        return (w8, scale) if precision.w8a8 else (dequantize_weight(w8, scale, dtype), None)

    def linear(layer: int, projs: tuple[str, ...], prologue: Prologue, silu_out: bool = False) -> DenseLoraLinear:
        pairs = [weight(weight_name(layer, p)) for p in projs]
        w = torch.cat([w for w, _ in pairs])
        scale = torch.cat([s for _, s in pairs]) if precision.w8a8 else None
        if _branch_scale(cfg, projs) != 1.0:  # granite's residual_multiplier, folded into the branch's output
            if scale is not None:
                scale = scale * cfg.residual_scale
            else:
                w = (w.float() * cfg.residual_scale).to(w.dtype)
        if silu_out:  # gate and up rows side by side for the GEMM's SiLU-and-mul epilogue
            w = interleave_halves(w).contiguous()
            scale = interleave_halves(scale).contiguous() if scale is not None else None
        bias = None
        names = [weight_name(layer, p) + ".bias" for p in projs]
        # attention_bias puts one on o_proj too (Llama, Qwen3): a bias the checkpoint holds is never dropped
        if (cfg.qkv_bias and projs == GROUPS["qkv"]) or (projs == GROUPS["o"] and names[0] in ckpt.files):
            bias = torch.cat([get(n).float() for n in names]) * _branch_scale(cfg, projs)
        if precision.w8a8:
            return Fp8LoraLinear(w, scale, bias, prologue, ops, silu_out, cfg.gemma)
        return DenseLoraLinear(w, bias, prologue, ops, silu_out, cfg.gemma)

    def norm(name: str) -> torch.Tensor:
        if cfg.gemma:  # HF's (1 + w.float()), kept in fp32: every kernel reads norm weights as fp32
            return 1 + get(name).float()
        return get(name).to(dtype)

    layers = []
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        # gemma2 norms the branches' outputs too: its MLP's input norm is pre_feedforward_layernorm
        mlp_norm = "pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm"
        layers.append(DecoderLayer(
            qkv=linear(i, GROUPS["qkv"], Prologue(norm(pre + "input_layernorm.weight"), cfg.rms_eps)),
            o=linear(i, GROUPS["o"], Prologue()),
            gate_up=linear(i, GROUPS["gate_up"], Prologue(norm(pre + mlp_norm + ".weight"), cfg.rms_eps),
                           silu_out=True),
            down=linear(i, GROUPS["down"], Prologue()),
            q_norm=norm(pre + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(pre + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            post_attn_norm=norm(pre + "post_attention_layernorm.weight") if cfg.gemma else None,
            post_mlp_norm=norm(pre + "post_feedforward_layernorm.weight") if cfg.gemma else None,
        ))
    return Decoder(cfg, precision, _embeddings(cfg, get("model.embed_tokens.weight"), dtype), layers,
                   norm("model.norm.weight"), ops, _head_reader(ckpt))


def _embeddings(cfg: ModelConfig, embed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The table with the embedding scale folded in, each entry rounded as HF rounds the scaled lookup: gemma2
    multiplies by its normalizer rounded to the embedding dtype, granite by a Python float."""
    embed = embed.to(dtype)
    if cfg.embed_scale == 1.0:
        return embed
    if cfg.gemma:
        return embed * torch.tensor(cfg.embed_scale, dtype=dtype)
    return (embed.float() * cfg.embed_scale).to(dtype)


def _branch_scale(cfg: ModelConfig, projs: tuple[str, ...]) -> float:
    """The factor on a projection's output before its residual add (granite's residual_multiplier)."""
    return cfg.residual_scale if projs in (GROUPS["o"], GROUPS["down"]) else 1.0


def _head_reader(ckpt: Checkpoint):
    """Reads the two label rows of the output projection on demand (the full lm_head is never kept)."""
    name = "model.embed_tokens.weight" if ckpt.config.tie_embeddings else "lm_head.weight"

    def rows(ids: list[int]) -> torch.Tensor:
        return ckpt.get_rows(name, ids).float()
    return rows


def attach_policies(decoder: Decoder, policies: list[Policy], label_ids: list[tuple[int, int]],
                    factors: list[dict] | None = None) -> None:
    """Stack every policy's LoRA per projection group and set the head vectors W[Violation] - W[Compliant].

    Ranks are padded to the largest per projection; a policy without a projection gets zero rows there.
    Adapter index i is policies[i]. factors: factors_on(policies, decoder.device, ...) when the caller gives
    them (a shaped decoder's, without values), else the policies' own, moved to the device here."""
    cfg = decoder.cfg
    if len({p.name for p in policies}) != len(policies):
        raise PolicyError(f"two policies share a name: {[p.name for p in policies]}")
    for p in policies:
        check_policy(p, cfg)
    flat = sorted({i for pair in label_ids for i in pair})
    rows = {i: r / cfg.logits_scale for i, r in zip(flat, decoder.head_rows(flat))}  # granite's logits_scaling
    if cfg.final_softcap is not None:  # each logit is capped before the difference: both rows kept
        decoder.head = torch.stack([torch.stack([rows[v], rows[c]]) for c, v in label_ids]).to(decoder.device)
    else:
        decoder.head = torch.stack([rows[v] - rows[c] for c, v in label_ids]).to(decoder.device)
    if factors is None:
        factors = factors_on(policies, decoder.device)
    for i, layer in enumerate(decoder.layers):
        for group, projs in GROUPS.items():
            lin: DenseLoraLinear = getattr(layer, group)
            lin.set_lora(_stack(cfg, i, projs, policies, factors, decoder.dtype, decoder.device))


def factors_on(policies: list[Policy], device: torch.device, values: bool = True) -> list[dict]:
    """Each policy's factors {(layer, proj): (A, B)} on `device`, float32, through one copy per policy: a copy
    per factor waited for the GPU each time, several times as long beside the compiling workers' start (a pinned
    buffer took as long; docs/performance.md).

    values False: the same shapes, every element 1, copying nothing: a shaped decoder's stacks (the
    compile-ahead dry run's), whose rank spans follow which blocks of B the stacking leaves zero. Only B zero
    over a span's edge ranks in every policy (adapters saved untrained, say) could narrow the real spans: that
    only leaves a variant to compile at its first launch."""
    # as_tensor: numpy factors as load_policy reads them (no copy), or tensors a caller built its Policy with
    if device.type == "cpu" and values:
        return [{k: (torch.as_tensor(a), torch.as_tensor(b)) for k, (a, b) in p.lora.factors.items()}
                for p in policies]
    out = []
    for p in policies:
        flat = [torch.as_tensor(t, dtype=torch.float32) for ab in p.lora.factors.values() for t in ab]
        if not flat:  # a prompt-only policy: nothing to copy
            out.append({})
            continue
        sizes = [t.numel() for t in flat]
        whole = torch.cat([t.reshape(-1) for t in flat]).to(device) if values else \
            torch.ones(sum(sizes), dtype=torch.float32, device=device)
        moved = [part.view(t.shape) for t, part in zip(flat, whole.split(sizes))]
        out.append({key: (moved[2 * n], moved[2 * n + 1]) for n, key in enumerate(p.lora.factors)})
    return out


def _stack(cfg: ModelConfig, layer: int, projs: tuple[str, ...], policies: list[Policy], factors: list[dict],
           dtype: torch.dtype, device) -> LoraStack | None:
    """factors[n]: policies[n]'s factors, already on `device`."""
    ranks = [max((p.lora.rank(layer, proj) for p in policies), default=0) for proj in projs]
    R = sum(ranks)
    if R == 0:
        return None
    K = cfg.proj_shape(projs[0])[1]
    outs = [cfg.proj_shape(p)[0] for p in projs]
    # built in place on the device: zeroing, copying and converting them on the CPU slowed the load
    # (docs/performance.md)
    A = torch.zeros(len(policies), R, K, dtype=dtype, device=device)
    B = torch.zeros(len(policies), sum(outs), R, dtype=dtype, device=device)
    for n, pol in enumerate(policies):
        r0, o0 = 0, 0
        for proj, rmax, out in zip(projs, ranks, outs):
            ab = factors[n].get((layer, proj))
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                A[n, r0:r0 + r] = a
                B[n, o0:o0 + out, r0:r0 + r] = b * (pol.lora.scales[(layer, proj)] * _branch_scale(cfg, projs))
            r0, o0 = r0 + rmax, o0 + out
    return LoraStack(A, B)
