"""Tokenizers behind one small interface: encode(text) -> ids, decode(ids) -> text, bos_id, eos_ids.

`tokenizer.model` is a sentencepiece model (Llama 2, Mistral, CodeLlama, TinyLlama, our tiny pair);
`tokenizer.json` is a Hugging Face fast tokenizer (Llama 3), read with the `tokenizers` package.
"""
import json
from pathlib import Path


class SentencePieceTokenizer:
    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError as e:
            raise SystemExit("reading tokenizer.model needs the sentencepiece package: pip install sentencepiece") from e
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.bos_id = self.processor.bos_id()
        self.eos_ids = [self.processor.eos_id()]
        self.vocab_size = self.processor.vocab_size()

    def encode(self, text: str) -> list:
        return self.processor.encode(text)

    def decode(self, ids) -> str:
        return self.processor.decode(list(ids))


class HFJsonTokenizer:
    """tokenizer.json (+ tokenizer_config.json for the BOS/EOS names), without transformers."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise SystemExit("reading tokenizer.json needs the tokenizers package: pip install tokenizers") from e
        self.processor = Tokenizer.from_file(str(path))
        self.processor.no_padding()
        config_path = path.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}

        def token_id(name):
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return self.processor.token_to_id(token) if token else None

        self.bos_id = token_id("bos_token")
        if self.bos_id is None:
            self.bos_id = self.processor.token_to_id("<|begin_of_text|>")
        eos = [token_id("eos_token")] + [self.processor.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
        self.eos_ids = sorted({i for i in eos if i is not None})
        self.vocab_size = self.processor.get_vocab_size()

    def encode(self, text: str) -> list:
        return self.processor.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.processor.decode(list(ids), skip_special_tokens=False)


def get_tokenizer(checkpoint_dir):
    """The tokenizer stored beside a checkpoint: tokenizer.model first, then tokenizer.json."""
    directory = Path(checkpoint_dir)
    if (directory / "tokenizer.model").is_file():
        return SentencePieceTokenizer(directory / "tokenizer.model")
    if (directory / "tokenizer.json").is_file():
        return HFJsonTokenizer(directory / "tokenizer.json")
    raise FileNotFoundError(
        f"no tokenizer.model or tokenizer.json in {directory}: copy the model's tokenizer there "
        f"(scripts/download.py fetches it)")
