"""The checkpoint stream (engine/model/read_ahead.py): every tensor bitwise what safetensors reads, whatever the dtype,
size or order asked in, across shards and staging-slot reuse; names outside the stream read as before; a file cut
short after it was opened is an error naming it; closing midway leaves no thread behind."""
from __future__ import annotations

import json
import random
import threading

import pytest
import torch
from hf_fixtures import make_model
from safetensors.torch import save_file

from policyscan.engine.errors import CheckpointError
from policyscan.engine.model import read_ahead
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.read_ahead import ReadAhead, stream_order


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.fixture(params=[None, "60KB"], ids=["one-file", "sharded"])
def ckpt(request, tmp_path) -> Checkpoint:
    make_model(tmp_path, "llama", shard=request.param)
    return Checkpoint.open(tmp_path)


def test_every_tensor_in_any_order_is_what_safetensors_reads(ckpt, monkeypatch):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    monkeypatch.setattr(read_ahead, "SLOT_BYTES", 4096)  # many chunks a tensor, each slot reused many times
    names = list(ckpt.files)
    random.Random(seed).shuffle(names)
    with ReadAhead(ckpt, torch.device("cpu")) as reader:
        assert len(reader.chunks) > 4 * read_ahead.THREADS
        for name in names:
            got, want = reader.get(name), ckpt.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want)), name


def test_short_reads_are_read_on_and_a_name_asked_twice_is_refused_at_once(ckpt, monkeypatch):
    real = read_ahead.os.preadv
    monkeypatch.setattr(read_ahead.os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:100]], off))
    with ReadAhead(ckpt, torch.device("cpu")) as reader:
        first = reader.order[0].name
        for span in reader.order:
            assert torch.equal(_bits(reader.get(span.name)), _bits(ckpt.get(span.name))), span.name
    with ReadAhead(ckpt, torch.device("cpu")) as reader:
        reader.get(first)
        with pytest.raises(CheckpointError, match="was read once already"):
            reader.get(first)
        assert reader.next < len(reader.chunks)  # the rest of the stream was not read to find out


def test_dtypes_sizes_and_names_outside_the_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(read_ahead, "SLOT_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.a": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "model.layers.1.c": torch.randint(-9, 9, (3, 3), generator=g),
        "model.layers.1.d": torch.zeros(0, 4),
        "model.layers.10.e": torch.tensor(2.5, dtype=torch.float16),
        "model.layers.2.f": torch.rand(33, generator=g) > 0.5,
        "model.norm.weight": torch.randn(11, generator=g),
        "model.embed_tokens.weight": torch.randn(17, 3, generator=g),
        "lm_head.weight": torch.randn(17, 3, generator=g),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    ckpt = Checkpoint(tmp_path, None, {n: tmp_path / "model.safetensors" for n in tensors}, False)
    with ReadAhead(ckpt, torch.device("cpu")) as reader:
        assert [s.name for s in reader.order] == stream_order(list(tensors))
        assert [s.name for s in reader.order][:6] == ["model.layers.0.a", "model.layers.0.b", "model.layers.1.c",
                                                      "model.layers.1.d", "model.layers.2.f", "model.layers.10.e"]
        assert "lm_head.weight" not in reader.index  # the loader reads two rows of it, never the whole
        for name in ["lm_head.weight", *reversed([n for n in tensors if n != "lm_head.weight"])]:
            assert torch.equal(_bits(reader.get(name)), _bits(tensors[name])), name


def test_a_file_cut_short_before_the_stream_is_refused_by_its_header(tmp_path):
    make_model(tmp_path, "llama")
    ckpt = Checkpoint.open(tmp_path)
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="model.safetensors: its tensors need .* truncated"):
        ReadAhead(ckpt, torch.device("cpu"))


def test_a_file_cut_short_after_its_header_was_read_is_an_error_naming_it(tmp_path, monkeypatch):
    make_model(tmp_path, "llama")
    ckpt = Checkpoint.open(tmp_path)
    layout = read_ahead.checkpoint_spans(ckpt)  # the header as read before the file was cut
    monkeypatch.setattr(read_ahead, "checkpoint_spans", lambda _: layout)
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with ReadAhead(ckpt, torch.device("cpu")) as reader:
        with pytest.raises(CheckpointError, match="model.safetensors: ended .* early inside tensor"):
            for span in list(reader.order):
                reader.get(span.name)


def test_closing_midway_ends_every_thread(ckpt, monkeypatch):
    monkeypatch.setattr(read_ahead, "SLOT_BYTES", 1024)
    before = threading.active_count()
    reader = ReadAhead(ckpt, torch.device("cpu"))
    reader.get(reader.order[0].name)
    reader.close()
    assert threading.active_count() == before and not reader.ready


def test_a_header_whose_sizes_disagree_is_refused(tmp_path):
    save_file({"model.layers.0.w": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.layers.0.w"]["shape"] = [4, 5]
    body = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    (tmp_path / "model.safetensors").write_bytes(raw[:8] + body + raw[8 + n:])
    with pytest.raises(CheckpointError, match="do not hold its shape"):
        read_ahead.spans(tmp_path / "model.safetensors")


def _tensors(obj, path: str = "decoder", seen=None) -> dict[str, torch.Tensor]:
    """Every tensor reachable through the decoder's attributes, lists and dataclasses, by path."""
    seen = seen if seen is not None else set()
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    if id(obj) in seen or not (hasattr(obj, "__dict__") or isinstance(obj, (list, tuple))):
        return {}
    seen.add(id(obj))
    items = enumerate(obj) if isinstance(obj, (list, tuple)) else vars(obj).items()
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{path}.{k}", seen))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_the_shaped_decoder_has_the_loaded_ones_shapes_dtypes_and_strides(tmp_path, precision):
    """compile-ahead's dry run runs on shaped_decoder: its kernels' variants are those of the real load's."""
    from policyscan.engine.model.loader import load_decoder, shaped_decoder
    from policyscan.engine.model.precision import decide_precision
    from policyscan.kernels import reference

    make_model(tmp_path, "qwen3", shard="60KB")
    ck = Checkpoint.open(tmp_path)
    prec, _ = decide_precision(precision, False, False, [], 0.01)
    real = _tensors(load_decoder(ck, reference, prec, "cpu"))
    shaped = _tensors(shaped_decoder(ck, reference, prec, torch.device("cpu")))
    assert real.keys() == shaped.keys() and len(real) > 20
    for k in real:
        assert (real[k].shape, real[k].dtype, real[k].stride()) == (shaped[k].shape, shaped[k].dtype,
                                                                    shaped[k].stride()), k


@pytest.mark.parametrize("specs", ["mixed", "wide"])
def test_the_shaped_decoders_lora_stacks_decide_the_same_variants(tmp_path, specs):
    """The dry run's decoder gets its LoRA stacks from factors of 1 (factors_on(values=False)): every stack's
    shape, dtype and stride and every rank span (which picks the GEMM's expand width) are the real ones'."""
    from hf_fixtures import WIDE_SPECS, make_bundle

    from policyscan.engine.model.loader import attach_policies, factors_on, load_decoder, shaped_decoder
    from policyscan.engine.model.precision import Precision
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.kernels import reference

    # q, k and v 256, 128 and 128 wide: their rank blocks fall in separate 128-column blocks of the qkv stack
    dirs = make_bundle(tmp_path, "llama", specs=WIDE_SPECS if specs == "wide" else None, hidden_size=256,
                       intermediate_size=300, num_attention_heads=16, num_key_value_heads=8)
    ck, pols, prec = Checkpoint.open(tmp_path / "model"), load_policies(dirs), Precision(torch.float32)
    labels = [(3, 7)] * len(pols)
    real = load_decoder(ck, reference, prec, "cpu")
    attach_policies(real, pols, labels)
    shaped = shaped_decoder(ck, reference, prec, torch.device("cpu"))
    attach_policies(shaped, pols, labels, factors_on(pols, torch.device("cpu"), values=False))
    spans = 0
    for lr, ls in zip(real.layers, shaped.layers):
        for group in ("qkv", "o", "gate_up", "down"):
            a, b = getattr(lr, group), getattr(ls, group)
            assert (a.lora is None) == (b.lora is None), group
            if a.lora is not None:
                for x, y in ((a.lora.A, b.lora.A), (a.lora.B, b.lora.B)):
                    assert (x.shape, x.dtype, x.stride()) == (y.shape, y.dtype, y.stride()), group
            assert (a.spans is None) == (b.spans is None), group
            if a.spans is not None:
                assert torch.equal(a.spans.start, b.spans.start) and (a.spans.width, a.spans.cols) == (
                    b.spans.width, b.spans.cols), group
                spans += 1
    assert spans > 0  # block-diagonal stacks narrow some expands here: the spans were compared, not only None
