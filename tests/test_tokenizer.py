"""tokenizer.py: sentencepiece and tokenizer.json behind one interface, with the family's BOS/EOS."""
import json

import pytest

from tokenizer import HFJsonTokenizer, SentencePieceTokenizer, get_tokenizer


def write_llama3_style_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def main():\n    return 42\n", "hello world, hello tokens"] * 50, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}))
    return tok


def test_sentencepiece_tokenizer_round_trip(tokenizer_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    tok = get_tokenizer(tmp_path)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.bos_id == 1 and tok.eos_ids == [2]
    ids = tok.encode("parser.add_argument('--x')")
    assert ids and tok.bos_id not in ids
    assert tok.decode(ids) == "parser.add_argument('--x')"


def test_tokenizer_json_round_trip_and_special_ids(tmp_path):
    hf = write_llama3_style_tokenizer(tmp_path)
    tok = get_tokenizer(tmp_path)
    assert isinstance(tok, HFJsonTokenizer)
    assert tok.bos_id == hf.token_to_id("<|begin_of_text|>")
    assert set(tok.eos_ids) == {hf.token_to_id("<|eot_id|>"), hf.token_to_id("<|end_of_text|>")}
    text = "def main():\n    return 42\n"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.decode(ids) == text


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.model or tokenizer.json"):
        get_tokenizer(tmp_path)
