"""A checkpoint's tokenizer and chat template, giving the ids transformers 5's `AutoTokenizer` gives.

    tok = get_tokenizer(checkpoint_dir)
    tok.encode(text) -> ids          no special tokens added (special-token text in `text` is parsed)
    tok.encode_prompt(text) -> ids   BOS/EOS added as `AutoTokenizer.from_pretrained(dir)(text)` adds them
    tok.decode(ids) -> text
    tok.bos_id, tok.eos_ids          eos_ids: the EOS token and the end-of-turn tokens the tokenizer has
    tok.vocab_size, tok.processor    processor: the `tokenizers.Tokenizer` doing the work
    tok.chat_template                the checkpoint's Jinja chat template, or None
    tok.render_chat(messages) -> text, tok.chat_ids(messages) -> ids   as `apply_chat_template` renders them

`tokenizer.json` is used as it is; `tokenizer.model` (sentencepiece) is converted as transformers 5 converts it for
LlamaTokenizer. The rules that make the ids match transformers' are in docs/tokenizers-and-chat.md.
"""
import contextlib
import inspect
import json
import re
import string
import sys
import threading
import time
from datetime import datetime
from functools import cached_property, lru_cache, update_wrapper
from pathlib import Path

from errors import UserError

# tokens ending an assistant turn (or the text) in the formats we know: those the tokenizer has as added tokens
# (never plain text) stop generation, beside its EOS token
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>", "</s>")

# for checkpoints without a chat template: Llama 3's header format (renders as Meta's Llama 3 Instruct template)
# and the template Llama-2-chat ships (its [INST] format; each user turn opens with BOS, each answer ends with EOS)
LLAMA3_CHAT = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")


# byte-level BPE (GPT-2, Llama 3, SmolLM2) writes byte b as the character BYTE_LEVEL_CHARS[b]: printable bytes as
# themselves, the others shifted past U+0100 (so a space is "Ġ", a newline "Ċ")
BYTE_LEVEL_CHARS = [chr(b) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255 else None for b in range(256)]
BYTE_LEVEL_CHARS = [c or chr(256 + sum(1 for x in BYTE_LEVEL_CHARS[:b] if x is None)) for b, c in
                    enumerate(BYTE_LEVEL_CHARS)]


class Tokenizer:
    """The interface both tokenizer files share; subclasses only build `processor` and the config they read."""

    def __init__(self, processor, directory: Path, config: dict, tokens: dict):
        self.processor = processor
        self.processor.no_padding()
        self.processor.no_truncation()
        self.directory = directory
        vocab = processor.get_vocab()
        added = {token.content: i for i, token in processor.get_added_tokens_decoder().items()}
        if tokens.get("bos_token") is None:  # no tokenizer_config.json: Llama 3's or Llama 2's if it has one
            tokens["bos_token"] = next((t for t in ("<|begin_of_text|>", "<s>") if t in added), None)
        # bos_token, eos_token, unk_token, pad_token: strings the chat template sees
        self.special_tokens = {name: token for name, token in tokens.items() if token is not None}
        self.bos_id = vocab.get(tokens.get("bos_token"))
        eos = {vocab.get(tokens.get("eos_token"))} | {added.get(t) for t in END_OF_TURN}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.vocab_size = processor.get_vocab_size()
        self.chat_template, self.chat_template_source = None, None
        jinja_file = directory / "chat_template.jinja"  # transformers prefers it to the config's entry
        if jinja_file.exists() and not jinja_file.is_file():
            raise UserError(f"{jinja_file} is not a file: the chat template goes in it (or remove it)")
        if jinja_file.is_file():
            self.chat_template, self.chat_template_source = read_text(jinja_file), str(jinja_file)
        else:
            template = config.get("chat_template")
            if isinstance(template, list):
                template = next((t.get("template") for t in template
                                 if isinstance(t, dict) and t.get("name") == "default"), None)
            if isinstance(template, str):
                self.chat_template = template
                self.chat_template_source = str(directory / "tokenizer_config.json")
            elif template is not None:  # a number, an object, a list without a "default" template: not a template
                raise UserError(f"{directory / 'tokenizer_config.json'}: 'chat_template' is neither a template string "
                                f"nor a list of named templates with a 'default': re-download the tokenizer files")

    def encode(self, text: str) -> list:
        return self.processor.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list:
        return self.processor.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self.processor.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list:
        """Each id's exact bytes in decoded text where it follows other tokens: sentencepiece's "▁hi" is b" hi" and
        "<0xE6>" b"\\xe6", byte-level BPE's "Ġhi" b" hi" (a piece may hold part of a UTF-8 character), an added
        token that is not special its text; None for special tokens. A draft of another tokenizer is mapped onto
        the target by these (crossdraft.py)."""
        spec = json.loads(self.processor.to_str())
        decoder = json.dumps(spec.get("decoder"), ensure_ascii=False)
        byte_level, metaspace = '"ByteLevel"' in decoder, "▁" in decoder or '"Metaspace"' in decoder
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        unicode_to_byte = {c: b for b, c in enumerate(BYTE_LEVEL_CHARS)}
        added = self.processor.get_added_tokens_decoder()
        out = [None] * self.vocab_size
        for i, token in added.items():  # an added token that is not special is its text (sentencepiece's "\n")
            if not token.special and i < len(out) and token.content:
                out[i] = token.content.encode("utf-8")
        for piece, i in self.processor.get_vocab(with_added_tokens=False).items():
            if i in added or i >= len(out) or not piece:
                continue
            if byte_level:
                if all(c in unicode_to_byte for c in piece):
                    out[i] = bytes(unicode_to_byte[c] for c in piece)
            elif byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out[i] = bytes.fromhex(piece[3:5])
            else:
                out[i] = (piece.replace("▁", " ") if metaspace else piece).encode("utf-8")
        return out

    def encode_continuation(self, text: str) -> list:
        """Ids of `text` where it continues a stream: no prefix space prepended (sentencepiece's dummy "▁", a
        byte-level add_prefix_space) and special-token text read as plain text, so that the ids' token_bytes()
        join to exactly text's UTF-8 bytes."""
        return self.continuation_processor.encode(text, add_special_tokens=False).ids

    @cached_property
    def continuation_processor(self):
        from tokenizers import Tokenizer as Backend

        def mid_stream(node):
            """The normalizer or pre-tokenizer `node` without what it adds at the start of the input."""
            if not isinstance(node, dict) or node.get("type") == "Prepend":
                return None
            if node.get("type") == "Metaspace":
                node["prepend_scheme"] = "never"
            if node.get("type") == "ByteLevel" and "add_prefix_space" in node:
                node["add_prefix_space"] = False
            for key in ("normalizers", "pretokenizers"):
                if isinstance(node.get(key), list):
                    node[key] = [n for n in map(mid_stream, node[key]) if n is not None]
            return node

        spec = json.loads(self.processor.to_str())
        spec["normalizer"] = mid_stream(spec.get("normalizer"))
        spec["pre_tokenizer"] = mid_stream(spec.get("pre_tokenizer"))
        processor = Backend.from_str(json.dumps(spec))
        processor.encode_special_tokens = True
        return processor

    def render_chat(self, messages: list, add_generation_prompt: bool = True, tools: list = None) -> str:
        """`messages` ([{"role": ..., "content": ...}]) as the chat template writes them (with `tools`, OpenAI's
        tool list, where the template reads it: uses_tools); a template that fails, rejects the conversation or tries
        to leave the sandbox raises UserError naming the template's file."""
        import jinja2
        template, source = self.chat_template, self.chat_template_source
        if template is None:
            llama3 = self.processor.token_to_id("<|start_header_id|>") is not None
            template = LLAMA3_CHAT if llama3 else LLAMA2_CHAT
            source = f"the built-in Llama {3 if llama3 else 2} format ({self.directory} has no chat template)"
        # keys set to None are dropped, as apply_chat_template drops them
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            compiled = compile_template(template)
            budget = compiled.environment.start_budget()
            chunks = []
            with watching(budget):
                for chunk in compiled.generate(messages=messages, tools=tools, documents=None,
                                               add_generation_prompt=add_generation_prompt, **self.special_tokens):
                    budget.spend(0, len(chunk))
                    chunks.append(chunk)
            text = "".join(chunks)
        except TemplateLimit as e:
            raise UserError(f"chat template in {source} {e}: fix or replace the template (a template renders one "
                            f"conversation in well under a second)") from None
        except jinja2.exceptions.SecurityError as e:
            raise UserError(f"chat template in {source} tried an unsafe operation: {e}") from None
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise UserError(f"chat template in {source} has a syntax error at line {e.lineno}: {e.message}") from None
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...) in the template, an undefined name
            raise UserError(f"chat template in {source} rejected the conversation: {e}") from None
        except Exception as e:
            raise UserError(f"chat template in {source} failed: {type(e).__name__}: {e}") from None
        if not text:  # said here: later it would read "the prompt is empty", though the user gave one
            raise UserError(f"chat template in {source} renders the conversation as nothing: fix or replace the "
                            f"template")
        return text

    def chat_ids(self, messages: list, add_generation_prompt: bool = True, tools: list = None) -> list:
        """The rendered chat encoded as apply_chat_template(tokenize=True) encodes it: without added special
        tokens, since the template writes its own BOS."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    @cached_property
    def uses_tools(self) -> bool:
        """Whether the chat template reads a `tools` list (it then renders tool definitions its own way)."""
        if self.chat_template is None:
            return False
        import jinja2.ext
        import jinja2.meta
        try:
            parsed = jinja2.Environment(extensions=[generation_tag(), jinja2.ext.loopcontrols]).parse(
                self.chat_template)
        except jinja2.exceptions.TemplateError:  # render_chat names the template's error
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(parsed)


class HFJsonTokenizer(Tokenizer):
    """tokenizer.json (+ tokenizer_config.json for the special token names and the chat template)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Backend
        text = read_text(path)
        try:
            processor = Backend.from_str(text)
        except BaseException as e:  # a Rust panic is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise UserError(f"cannot read tokenizer: {path}: {e}: re-download it") from None
        config = read_config(path.parent)
        tokens = special_tokens(config)
        if config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast") and '"ByteLevel"' not in text:
            llama_pre_tokenization(processor, config, add_prefix_space=True)
        super().__init__(processor, path.parent, config, tokens)


class SentencePieceTokenizer(Tokenizer):
    """tokenizer.model, converted to a `tokenizers` BPE as transformers 5 converts it for LlamaTokenizer."""

    def __init__(self, path: Path):
        from tokenizers import AddedToken, Tokenizer as Backend, models, processors
        pieces, ids, add_dummy_prefix = read_sentencepiece(path)
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        processor = Backend(models.BPE(vocab=vocab, merges=bpe_merges(vocab), fuse_unk=True, byte_fallback=True))
        # unknown (2) and control (3) pieces are special tokens, user-defined ones (4) plain added tokens
        processor.add_tokens([AddedToken(piece, special=kind in (2, 3), normalized=False)
                              for piece, kind in pieces if kind in (2, 3, 4)])
        config = read_config(path.parent)
        defaults = {f"{name}_token": pieces[i][0] if 0 <= i < len(pieces) else None for name, i in ids.items()}
        tokens = {**defaults, **{k: v for k, v in special_tokens(config).items() if v is not None}}
        # transformers prepends "▁" for LlamaTokenizer; for anything else, do as the model says (as sentencepiece)
        llama = config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast")
        llama_pre_tokenization(processor, config, add_prefix_space=llama or add_dummy_prefix)
        bos, eos = tokens["bos_token"], tokens["eos_token"]
        add_bos = bool(config.get("add_bos_token", True)) and bos in vocab
        add_eos = bool(config.get("add_eos_token", False)) and eos in vocab
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        added = [(t, vocab[t]) for t, add in ((bos, add_bos), (eos, add_eos)) if add]
        processor.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=added)
        super().__init__(processor, path.parent, config, tokens)


def get_tokenizer(checkpoint_dir) -> Tokenizer:
    """The tokenizer stored beside a checkpoint: tokenizer.json first (as transformers), then tokenizer.model."""
    directory = Path(checkpoint_dir)
    if (directory / "tokenizer.json").is_file():
        return HFJsonTokenizer(directory / "tokenizer.json")
    if (directory / "tokenizer.model").is_file():
        return SentencePieceTokenizer(directory / "tokenizer.model")
    raise UserError(f"no tokenizer.model or tokenizer.json in {directory}: copy the model's tokenizer there "
                    f"(scripts/download.py fetches it)")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read tokenizer: {path}: {e}: re-download it") from None


def read_config(directory: Path) -> dict:
    """tokenizer_config.json, with special_tokens_map.json's entries where the config has none ({} if absent)."""
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if path.is_file():
            try:
                data = json.loads(read_text(path))
            except (ValueError, RecursionError) as e:
                raise UserError(f"cannot read tokenizer: {path}: {e}: re-download it") from None
            if not isinstance(data, dict):
                raise UserError(f"cannot read tokenizer: {path}: not a JSON object: re-download it")
            config.update(data)
    return config


def special_tokens(config: dict) -> dict:
    """The token strings a config names ({"content": ...} dicts are AddedTokens written out)."""
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = config.get(name)
        tokens[name] = token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None
    return tokens


def llama_pre_tokenization(processor, config: dict, add_prefix_space: bool):
    """transformers 5 LlamaTokenizer's pipeline: no normalizer, spaces as "▁", one "▁" prepended at the start
    ("first"), at the start of every text between special tokens ("always", legacy) or nowhere ("never")."""
    from tokenizers import decoders, pre_tokenizers
    add_prefix_space = config.get("add_prefix_space", add_prefix_space) is not False
    scheme = ("always" if config.get("legacy") else "first") if add_prefix_space else "never"
    processor.normalizer = None
    processor.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    processor.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix_space else []))


def bpe_merges(vocab: dict) -> list:
    """transformers' generate_merges: every split of a piece into two pieces, ranked by the piece's id."""
    merges = []
    for piece, rank in vocab.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(rank, *m) for m in sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))]
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])))
    return [(left, right) for _, left, right in merges]


def read_sentencepiece(path: Path):
    """From a sentencepiece ModelProto: [(piece, type)], {"bos"/"eos"/"unk": id}, add_dummy_prefix.
    Types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
    try:
        data = path.read_bytes()
        pieces, ids, add_dummy_prefix, specs = [], {"unk": 0, "bos": 1, "eos": 2}, True, set()
        for field, value in proto_fields(data):
            specs.add(field)
            if field == 1:  # SentencePiece {piece = 1, score = 2, type = 3}
                piece = dict(proto_fields(value))
                pieces.append((piece.get(1, b"").decode("utf-8"), piece.get(3, 1)))
            elif field == 2:  # TrainerSpec {unk_id = 40, bos_id = 41, eos_id = 42}
                for key, number in proto_fields(value):
                    if key in (40, 41, 42) and isinstance(number, int):
                        ids[("unk", "bos", "eos")[key - 40]] = number - (1 << 64) if number >> 63 else number
            elif field == 3:  # NormalizerSpec {add_dummy_prefix = 3}
                add_dummy_prefix = dict(proto_fields(value)).get(3, 1) != 0
        if not pieces or any(not piece for piece, _ in pieces):
            raise ValueError("no vocabulary in it")
        if not {2, 3} <= specs:  # sentencepiece writes its trainer and normalizer specs after the pieces
            raise ValueError("truncated (no trainer or normalizer spec after the pieces)")
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"cannot read tokenizer: {path}: {e}: re-download it") from None
    return pieces, ids, add_dummy_prefix


def proto_fields(data: bytes):
    """(field number, value) for each field of a protobuf message: int for a varint, bytes otherwise."""
    def varint(i):
        value, shift = 0, 0
        while True:
            if i >= len(data) or shift > 63:
                raise ValueError("not a sentencepiece model (truncated)")
            value, shift, i = value | (data[i] & 0x7F) << shift, shift + 7, i + 1
            if data[i - 1] < 0x80:
                return value, i

    i = 0
    while i < len(data):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            value, i = varint(i)
        elif wire in (1, 2, 5):
            size, i = (8, i) if wire == 1 else (4, i) if wire == 5 else varint(i)
            if i + size > len(data):
                raise ValueError("not a sentencepiece model (truncated)")
            value, i = data[i:i + size], i + size
        else:
            raise ValueError(f"not a sentencepiece model (wire type {wire} at byte {i})")
        yield key >> 3, value


# what one rendering of a chat template may spend (a real template renders a conversation in milliseconds)
TEMPLATE_SECONDS = 5.0
TEMPLATE_STEPS = 10**6  # range() items, summed over the rendering
TEMPLATE_CHARS = 1 << 24  # characters written (16 Mi: more than any model's context), and the largest value built
TEMPLATE_INDENT = 1024  # tojson's widest indent (its nesting repeats it on every line)
TEMPLATE_INT_BITS = 1 << 16  # the largest integer `*` and `**` build (~20,000 digits; str() stops at 4,300)


class TemplateLimit(Exception):
    """A chat template ran past its TemplateBudget (the message says which limit)."""


class TemplateBudget:
    """What one rendering has spent: range() items, characters written, time."""

    def __init__(self):
        self.steps, self.chars, self.deadline = 0, 0, time.monotonic() + TEMPLATE_SECONDS

    def spend(self, steps: int = 0, chars: int = 0):
        self.steps += steps
        self.chars += chars
        if self.steps > TEMPLATE_STEPS:
            raise TemplateLimit(f"loops more than {TEMPLATE_STEPS} times (range)")
        if self.chars > TEMPLATE_CHARS:
            raise TemplateLimit(f"writes more than {TEMPLATE_CHARS} characters")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"runs longer than {TEMPLATE_SECONDS:g} s")

    def build(self, size: int, what: str):
        """Refuse a value of `size` characters or items before `what` builds it (and spend a step: the clock)."""
        self.spend()
        if size > TEMPLATE_CHARS:
            raise TemplateLimit(f"builds a value of more than {TEMPLATE_CHARS} characters or items ({what})")


@contextlib.contextmanager
def watching(budget: TemplateBudget, every: int = 1024):
    """The template's own lines traced while it renders, the clock read every `every` of them: a loop whose body
    calls nothing (`{% for x in s %}{% for y in s %}{% endfor %}{% endfor %}`) spends from no other hook and would
    run for hours. Only the template's frames are traced (jinja compiles it to code named "<template>")."""
    lines = [0]

    def line(frame, event, arg):
        if event == "line":
            lines[0] += 1
            if lines[0] % every == 0:
                budget.spend()
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None
    before = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(before)


def size_of(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else len(str(value))


def format_size(fields: int, widths: list, fmt, args) -> int:
    """The most a format string (printf's `%` or str.format) writes: its own text, each field at most the largest
    argument, and every width or precision in full (`*` and nested `{}` widths come from the arguments)."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    taken = sum(numbers) if any(w in ("*", "{") for w in widths) else 0
    return len(fmt) + fields * max(map(size_of, values), default=0) + taken + \
        sum(int(w) for w in widths if w.isdigit())


def printf_size(fmt: str, args) -> int:
    fields = PRINTF_FIELD.findall(fmt)
    return format_size(len(fields), [w for field in fields for w in field if w], fmt, args)


def str_format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    fields = [(name, spec or "") for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    widths = [w for _, spec in fields for w in re.findall(r"\d+|\{", spec)]
    return format_size(len(fields), widths, fmt, (*args, *kwargs.values()))


def total_size(items) -> int:
    return len(items) if isinstance(items, (str, bytes)) else sum(map(size_of, items))


def lines(text) -> int:
    return str(text).count("\n") + 1


# An upper bound on what a filter or a str / bytes / int method builds, for those whose size an argument sets rather
# than the value (`'x' | center(10**9)`, `'%*d' | format(10**9, 1)`, `'ab'.replace('', s)`): checked before the call.
# Each gets the value and the call's arguments by parameter name (defaults filled in).
BUILDS = {
    "center": lambda v, a: max(size_of(v), a["width"]),
    "ljust": lambda v, a: max(size_of(v), a["width"]),
    "rjust": lambda v, a: max(size_of(v), a["width"]),
    "zfill": lambda v, a: max(size_of(v), a["width"]),
    "indent": lambda v, a: size_of(v) + lines(v) * (a["width"] if isinstance(a["width"], int) else len(a["width"])),
    "expandtabs": lambda v, a: size_of(v) + str(v).count("\t") * a["tabsize"],
    "replace": lambda v, a: size_of(v) + len(a["new"]) * (v.count(a["old"]) if a["old"] else len(v) + 1),
    "join": lambda v, a: total_size(a.get("iterable", v)) + len(a.get("d", v)) * len(a.get("iterable", v)),
    "translate": lambda v, a: size_of(v) * max([size_of(t) for t in a["table"].values() if t is not None] or [1])
    if isinstance(a["table"], dict) else size_of(v),
    "to_bytes": lambda v, a: a["length"],
    "format": lambda v, a: printf_size(str(v), a["args"] or a["kwargs"]),
    "batch": lambda v, a: a["linecount"] if a["fill_with"] is not None else 0,
    "slice": lambda v, a: a["slices"],
    "wordwrap": lambda v, a: size_of(v) * (1 + len(a["wrapstring"] or "\n")),
    "sum": lambda v, a: 0 if isinstance(a["start"], (int, float)) else len(v) * total_size(v),  # copies: n^2
}
PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")


def bounded(budget, name: str, function, value, args: tuple, kwargs: dict):
    """function(*args, **kwargs), a filter (value None: it is among the arguments) or a method of `value`, with what
    it builds bounded: BUILDS' estimate before the call (a generator `join`s or `sum`s is read into a list first),
    the size of the result after it."""
    estimate = BUILDS.get(name)
    if estimate is not None:
        # jinja's async-capable filters take an eval context their (wrapped) signature does not name
        target = inspect.unwrap(function)
        extra = args[:1] if hasattr(function, "jinja_pass_arg") and not hasattr(target, "jinja_pass_arg") else ()
        try:
            bound = inspect.signature(target).bind(*args[len(extra):], **kwargs)
            bound.apply_defaults()
        except (TypeError, ValueError):  # wrong arguments: the call itself says so
            bound = None
        if bound is not None:
            a = bound.arguments
            for key in ("value", "iterable"):  # a filter's value, join's argument: len() must work, and reading
                if name in ("join", "sum") and key in a and not hasattr(a[key], "__len__"):  # it must not use it up
                    a[key] = list(a[key])
            if value is None:  # a filter's value: its first parameter after any context or environment
                value = next((a[k] for k in ("value", "s", "iterable") if k in a), None)
            try:
                size = estimate(value, a)
            except (TypeError, ValueError, AttributeError, KeyError):  # arguments of the wrong type: the call fails
                size = 0
            budget.build(size, name)
            args, kwargs = (*extra, *bound.args), bound.kwargs
    result = function(*args, **kwargs)
    if isinstance(result, (str, bytes, list, tuple, dict)):
        budget.build(len(result), name)
    return result


@lru_cache(maxsize=8)
def compile_template(template: str):
    """A chat template compiled as transformers compiles it: jinja2's immutable sandbox, trim_blocks and
    lstrip_blocks, loop controls, raise_exception / strftime_now / a JSON `tojson`, `{% generation %}` blocks; each
    rendering bounded in loops, output and time (TemplateBudget)."""
    import jinja2.ext
    env = sandbox_type()(trim_blocks=True, lstrip_blocks=True, extensions=[generation_tag(), jinja2.ext.loopcontrols])
    env.local = threading.local()  # one budget per rendering thread (the server renders on several)
    bound_names(env)
    return env.from_string(template)


@lru_cache(maxsize=None)
def generation_tag():
    """The `{% generation %}` extension (jinja2 is imported on first use)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendered as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()
    return Generation


@lru_cache(maxsize=None)
def sandbox_type():
    """The sandbox environment's class, every call, filter, range() item and operator spending from the rendering's
    TemplateBudget (jinja2 is imported on first use)."""
    import jinja2.compiler
    import jinja2.sandbox

    class Concat(jinja2.compiler.CodeGenerator):
        """`a ~ b` as environment.concat(...), so that its size is checked like the other operators'."""
        def visit_Concat(self, node, frame):
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """The sandbox, every call, filter, range() item and operator spending from the rendering's TemplateBudget,
        and every value built bounded in size (before it is built where an argument sets the size): a template is
        code from the checkpoint's directory; nested loops would otherwise run for hours, `'x' | center(10**9)`
        take a gigabyte."""
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = Concat

        def start_budget(self) -> "TemplateBudget":
            self.local.budget = TemplateBudget()
            return self.local.budget

        def budget(self) -> "TemplateBudget":
            return getattr(self.local, "budget", None) or TemplateBudget()  # outside render_chat: per call

        def call(*args, **kwargs):  # (self, context, obj, ...): the template's keyword arguments may use any name
            args[0].budget().spend()
            return jinja2.sandbox.ImmutableSandboxedEnvironment.call(*args, **kwargs)

        def concat(self, values):
            parts = [str(v) for v in values]
            self.budget().build(sum(map(len, parts)), "~")
            return "".join(parts)

        def call_binop(self, context, operator, left, right):
            check_binop(self.budget(), operator, left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            """A method the template reaches (`'x'.center`, `s.format`) as one that bounds what it builds."""
            owner, name = getattr(value, "__self__", None), getattr(value, "__name__", None)
            if not isinstance(owner, (str, bytes, int)) or isinstance(owner, bool) or \
                    name not in (*BUILDS, "format", "format_map"):
                return None
            method = super().wrap_str_format(value) or value  # format, format_map: jinja's sandboxed formatter

            def run(*args, **kwargs):
                if name in ("format", "format_map"):
                    mapping = args[0] if name == "format_map" and args and isinstance(args[0], dict) else {}
                    self.budget().build(str_format_size(owner, args if name == "format" else (), {**kwargs, **mapping}),
                                        name)
                    return bounded(self.budget(), "", method, owner, args, kwargs)
                return bounded(self.budget(), name, value, owner, args, kwargs)
            return run
    return Sandbox


def check_binop(budget: TemplateBudget, operator: str, left, right):
    """A step spent on `left operator right`, and the operation refused before it builds a value past the limits."""
    budget.spend()
    for sequence, n in ((left, right), (right, left)):
        if operator == "*" and isinstance(sequence, (str, list, tuple)) and isinstance(n, int) \
                and len(sequence) * n > TEMPLATE_CHARS:
            raise TemplateLimit(f"builds a sequence of more than {TEMPLATE_CHARS} items")
    if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        budget.build(len(left) + len(right), "+")
    if operator == "%" and isinstance(left, str):
        budget.build(printf_size(left, right), "%")
    if operator == "*" and isinstance(left, int) and isinstance(right, int) and \
            left.bit_length() + right.bit_length() > TEMPLATE_INT_BITS:
        raise TemplateLimit(f"multiplies integers of more than {TEMPLATE_INT_BITS} bits")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
            and right > 0 and left.bit_length() * right > TEMPLATE_INT_BITS:  # millions of digits: minutes
        raise TemplateLimit(f"raises {left if left.bit_length() <= 64 else 'a huge integer'} to the power "
                            f"{right}")


def bound_names(env):
    """The names a template reaches, bounded by env's budget: every filter, range() per item, tojson piece by
    piece; transformers' extra globals (raise_exception, strftime_now, a safe namespace and dict); no lipsum."""
    import jinja2.exceptions
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """json.dumps, written piece by piece within the budget (an indent of 10**9 spaces is refused first)."""
        if (indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0) > TEMPLATE_INDENT:
            raise TemplateLimit(f"indents JSON by more than {TEMPLATE_INDENT} characters")
        chunks, size = [], 0
        for chunk in json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                      sort_keys=sort_keys).iterencode(x):
            size += len(chunk)
            env.budget().build(size, "tojson")
            chunks.append(chunk)
        return "".join(chunks)

    def budget_range(*args):
        env.budget().spend(len(range(*args)))
        return jinja2.sandbox.safe_range(*args)

    def bounded_filter(name, function):
        def run(*args, **kwargs):
            return bounded(env.budget(), name, function, None, args, kwargs)
        return update_wrapper(run, function)  # keeps jinja's pass_context / pass_environment mark

    env.filters["tojson"] = tojson
    env.filters.update({name: bounded_filter(name, f) for name, f in env.filters.items()})
    del env.globals["lipsum"]  # lipsum(n=10**9) writes for hours; no chat template uses it
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=namespace_type(), dict=TemplateDict(), range=budget_range)


class TemplateDict:
    """`dict` for templates: dict(...) and dict.fromkeys(...), no handle on the type itself."""
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=None)
def namespace_type():
    """namespace() refusing underscore names, as transformers' (no reaching for CPython internals)."""
    import jinja2.exceptions
    import jinja2.utils

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"underscore attribute {name!r} on a namespace")
    return Namespace
