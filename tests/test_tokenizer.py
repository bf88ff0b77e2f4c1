"""tokenizer.py gives the ids transformers' AutoTokenizer gives, for small tokenizers of each kind built here:
a ChatML byte-level BPE (SmolLM2-like), a Llama 3-style tokenizer.json, a Llama 2-like sentencepiece model
(tokenizer.model alone, and as a legacy tokenizer.json)."""
import json

import pytest

import tokenizer
from helpers import (TEXT, STRINGS, LLAMA2_CONFIG, write_chatml_tokenizer, write_llama3_tokenizer,
                     write_sentencepiece_model, write_llama2_json_tokenizer, auto_tokenizer)
from errors import UserError


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    sp = write_sentencepiece_model(root / "sentencepiece")
    return {"chatml": write_chatml_tokenizer(root / "chatml"), "llama3": write_llama3_tokenizer(root / "llama3"),
            "sentencepiece": sp,
            "llama2_json": write_llama2_json_tokenizer(root / "llama2_json", sp / "tokenizer.model")}


@pytest.mark.parametrize("kind", ["chatml", "llama3", "sentencepiece", "llama2_json"])
def test_ids_equal_auto_tokenizer(dirs, kind):
    hf, tok = auto_tokenizer(dirs[kind]), tokenizer.get_tokenizer(dirs[kind])
    for s in STRINGS:
        assert tok.encode_prompt(s) == hf(s)["input_ids"], s
        assert tok.encode(s) == hf(s, add_special_tokens=False)["input_ids"], s
        ids = tok.encode(s)
        if hf.decode(ids) == s:
            assert tok.decode(ids) == s
    assert tok.bos_id == hf.bos_token_id and tok.vocab_size == len(hf)


def test_special_tokens_per_kind(dirs):
    chatml, llama3 = tokenizer.get_tokenizer(dirs["chatml"]), tokenizer.get_tokenizer(dirs["llama3"])
    sp = tokenizer.get_tokenizer(dirs["sentencepiece"])
    assert isinstance(llama3, tokenizer.HFJsonTokenizer) and isinstance(sp, tokenizer.SentencePieceTokenizer)
    vocab = chatml.processor.get_vocab()
    assert chatml.encode_prompt("hi") == chatml.encode("hi")  # SmolLM2 adds nothing
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} == set(chatml.eos_ids)
    vocab = llama3.processor.get_vocab()
    assert llama3.encode_prompt("hi") == [vocab["<|begin_of_text|>"]] + llama3.encode("hi")
    assert {vocab["<|eot_id|>"], vocab["<|end_of_text|>"]} == set(llama3.eos_ids)
    assert sp.encode_prompt("hi") == [1] + sp.encode("hi") and sp.bos_id == 1 and sp.eos_ids == [2]


@pytest.mark.parametrize("change", [{"add_bos_token": False}, {"add_eos_token": True}, {"legacy": True},
                                    {"add_prefix_space": False}])
def test_sentencepiece_config_honoured(dirs, tmp_path, change):
    (tmp_path / "tokenizer.model").write_bytes((dirs["sentencepiece"] / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(LLAMA2_CONFIG, **change)))
    hf, tok = auto_tokenizer(tmp_path), tokenizer.get_tokenizer(tmp_path)
    for s in STRINGS:
        assert tok.encode_prompt(s) == hf(s)["input_ids"], s


def test_tokenizer_json_ignores_add_bos_token_like_transformers(dirs, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((dirs["chatml"] / name).read_bytes())
    config = json.loads((dirs["chatml"] / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, add_bos_token=True, add_eos_token=True)))
    hf, tok = auto_tokenizer(tmp_path), tokenizer.get_tokenizer(tmp_path)
    assert tok.encode_prompt("hi there") == hf("hi there")["input_ids"] == tok.encode("hi there")


def test_sentencepiece_without_config_encodes_as_sentencepiece_with_bos(dirs, tmp_path):
    """Our tiny pair ships tokenizer.model alone: text encodes as sentencepiece does, after a BOS (but for text
    starting with a space, where no dummy "▁" is added, and special-token text, parsed: as in LlamaTokenizer)."""
    import sentencepiece as spm
    (tmp_path / "tokenizer.model").write_bytes((dirs["sentencepiece"] / "tokenizer.model").read_bytes())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = tokenizer.get_tokenizer(tmp_path)
    for s in [line.lstrip() for line in TEXT[:80]] + ["café 日本語 🙂 12345"]:
        assert tok.encode_prompt(s) == [1] + sp.encode(s), s
        assert tok.decode(tok.encode(s)) == sp.decode(sp.encode(s))


def test_unreadable_or_missing_tokenizer_is_a_user_error(dirs, tmp_path):
    with pytest.raises(UserError, match="no tokenizer.model or tokenizer.json"):
        tokenizer.get_tokenizer(tmp_path)
    model = (dirs["sentencepiece"] / "tokenizer.model").read_bytes()
    lfs_pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 499723\n"
    for name, data in [("tokenizer.model", model[:len(model) // 2]), ("tokenizer.model", lfs_pointer),
                       ("tokenizer.model", b""), ("tokenizer.model", b"<!DOCTYPE html><html>"),
                       ("tokenizer.json", b'{"version": "1.0", "truncated'), ("tokenizer.json", lfs_pointer)]:
        broken = tmp_path / f"{name}-{len(data)}"
        broken.mkdir()
        (broken / name).write_bytes(data)
        with pytest.raises(UserError, match=f"cannot read tokenizer: {broken / name}: .*re-download it"):
            tokenizer.get_tokenizer(broken)
    (tmp_path / "tokenizer.model").write_bytes(model)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read tokenizer: .*tokenizer_config.json"):
        tokenizer.get_tokenizer(tmp_path)


def test_proto_reader_sees_the_trainer_spec(tmp_path):
    """bos/eos ids other than 1/2 (and a pad id of -1, a ten-byte varint) come from the model itself."""
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, unk_id=2, bos_id=0, eos_id=1,
                                   pad_id=-1, add_dummy_prefix=False, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = tokenizer.get_tokenizer(tmp_path)
    assert tok.bos_id == 0 and tok.eos_ids == [1]
    assert tok.encode_prompt("return x") == [0] + sp.encode("return x")
    assert tok.vocab_size == sp.vocab_size()
