"""Structured output: a grammar's token mask applied to each row's logits before sampling (xgrammar).

    grammars = Grammars(tokenizer, vocab_size, eos_ids)      # one per tokenizer: xgrammar's TokenizerInfo, a compiler
    compiled = grammars.json_schema({"type": "object", ...})  # checked, compiled once per schema (cached)
    constraint = Constraint(compiled, vocab_size)           # one per row: the grammar's state after its tokens
    constraint.mask(logits)                                 # forbidden tokens' logits set to -inf, in place
    constraint.accept(token)                                # advance; constraint.ended once the grammar is done

The distribution a constrained row samples from is the model's with the mask applied to the logits first, then
temperature, top-k and top-p: with none of those, the model's distribution renormalised over the allowed tokens.
A grammar ends its answer by allowing only the end-of-sequence tokens once it is complete (the row then stops as
at any EOS); a state that allows no token at all (a dead end) ends the answer too, with `note` saying so.

Speculation (speculate.py) asks two things of a constraint: prune(tree), the drafted tree without the nodes the
grammar forbids (their proposals renormalised over what the grammar allows, which keeps verification exact), and
the bitmask of every kept node, which masks the target's logits at that node. docs/serve.md, "Structured output".
"""
import json
import re
import threading
from typing import Optional

import torch

from errors import UserError

# JSON Schema keywords the grammar enforces (xgrammar's JSON schema converter); annotations pass as they are
ENFORCED = {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "properties", "required",
            "additionalProperties", "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
            "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
# keywords that constrain a value and that the grammar would silently ignore: refused, since an answer that ignored
# them would not validate (unknown keywords are annotations in JSON Schema and pass)
UNSUPPORTED = {"multipleOf", "not", "if", "then", "else", "oneOf", "allOf", "patternProperties", "dependentRequired",
               "dependentSchemas", "dependencies", "propertyNames", "uniqueItems", "contains", "minContains",
               "maxContains", "unevaluatedProperties", "unevaluatedItems", "additionalItems", "$dynamicRef",
               "$recursiveRef"}
TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
FORMATS = {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
           "uuid"}
SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
# schemas inside schemas: deeper nesting is refused before the recursive passes over it (here, length_patterns,
# xgrammar's converter) run out of stack; real schemas nest a few levels (OpenAI's strict mode allows 10)
MAX_DEPTH = 64


class SchemaError(UserError):
    """A schema the grammar cannot enforce; `field` names where (a dotted path from the caller's `where`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_schema(schema, where: str, depth: int = 0):
    """Refuse (SchemaError naming the field) a schema that is not JSON Schema, that uses a keyword the grammar
    does not enforce, or that nests schemas more than MAX_DEPTH deep, before anything is compiled."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaError(f"`{where}` must be a JSON Schema object, got {json.dumps(schema)[:80]}", where)
    if depth > MAX_DEPTH:
        raise SchemaError(f"`{where}`: schemas nested more than {MAX_DEPTH} deep are not supported", where)
    for key, value in schema.items():
        at = f"{where}.{key}"
        if key in UNSUPPORTED and not (key == "uniqueItems" and value is False):
            raise SchemaError(f"`{at}`: the schema keyword {key!r} is not supported by constrained decoding "
                              f"(supported: {', '.join(sorted(ENFORCED))})", at)
        if key == "type":
            kinds = value if isinstance(value, list) else [value]
            if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
                raise SchemaError(f"`{at}` must be one of {', '.join(sorted(TYPES))} (or a list of them), got "
                                  f"{json.dumps(value)[:80]}", at)
        elif key in SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise SchemaError(f"`{at}` must be an object of schemas", at)
            for name, sub in value.items():
                check_schema(sub, f"{at}.{name}", depth + 1)
        elif key in ("items", "additionalProperties"):
            check_schema(value, at, depth + 1)
        elif key in ("anyOf", "prefixItems"):
            if not isinstance(value, list) or not value:
                raise SchemaError(f"`{at}` must be a non-empty list of schemas", at)
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}[{i}]", depth + 1)
        elif key == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise SchemaError(f"`{at}` must be a list of property names", at)
        elif key == "enum" and not (isinstance(value, list) and value):
            raise SchemaError(f"`{at}` must be a non-empty list", at)
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") and \
                (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SchemaError(f"`{at}` must be a number, got {json.dumps(value)[:80]}", at)
        elif key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties") and \
                (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SchemaError(f"`{at}` must be an integer >= 0, got {json.dumps(value)[:80]}", at)
        elif key == "pattern" and not isinstance(value, str):
            raise SchemaError(f"`{at}` must be a regular expression string", at)
        elif key in ("minLength", "maxLength") and "pattern" in schema:
            raise SchemaError(f"`{at}` beside `pattern` is not supported by constrained decoding: give the length in "
                              f"the pattern", at)
        elif key == "format" and value not in FORMATS:
            raise SchemaError(f"`{at}`: the format {json.dumps(value)[:40]} is not supported (supported: "
                              f"{', '.join(sorted(FORMATS))})", at)


def length_patterns(schema):
    """The schema with each string's minLength / maxLength written as a pattern of that many plain characters (no
    control character, quote or backslash): xgrammar's length-bounded strings let control characters through, which
    no JSON parser reads. A subset of the strings the lengths allow, so every answer still validates."""
    if not isinstance(schema, dict):
        return schema
    # only where check_schema looks for schemas (and bounds their depth): an annotation's value is left as it is
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: length_patterns(sub) for name, sub in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if key in schema:
            out[key] = length_patterns(schema[key])
    for key in ("anyOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            out[key] = [length_patterns(sub) for sub in schema[key]]
    low, high = schema.get("minLength"), schema.get("maxLength")
    if "pattern" not in schema and any(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        low = low if isinstance(low, int) else 0
        out["pattern"] = '^[^\\u0000-\\u001f"\\\\]{%d,%s}$' % (low, high if isinstance(high, int) else "")
        out.pop("minLength", None)
        out.pop("maxLength", None)
    return out


def whole_utf8(piece: bytes) -> bool:
    """Whether a token's bytes are whole UTF-8 characters. A token holding part of a character (a byte-fallback
    <0xNN>, a byte-level piece) is left out of a grammar's vocabulary: xgrammar takes a lead byte's continuation bytes
    without checking them, so such tokens could join into bytes that are no text (a JSON string of replacement
    characters, longer than its maxLength). Every character stays reachable: JSON strings have \\u escapes."""
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Grammars:
    """One tokenizer's vocabulary as xgrammar sees it (each id's bytes where it follows other tokens, whole characters
    only: whole_utf8; special tokens never allowed, the end-of-sequence ids allowed where the grammar is complete),
    its compiler, and the grammars
    compiled so far (one per schema: a server sees the same few schemas again and again)."""
    CACHED = 64  # compiled grammars kept (their token-mask caches are the memory)

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list):
        import xgrammar
        self.xgr = xgrammar
        vocab = [piece if piece and whole_utf8(piece) else b"" for piece in tokenizer.token_bytes()]
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                           stop_token_ids=list(eos_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.compiled = {}  # key -> CompiledGrammar, least recently used first
        self.lock = threading.Lock()

    def json_schema(self, schema=None, where: str = "json_schema"):
        """The grammar of JSON values valid under `schema` (a dict or its JSON text), in one line with ", " and ": "
        (no free whitespace: a model cannot wander off into spaces); None: any JSON object (OpenAI's json_object).
        SchemaError naming `where` for a schema that cannot be enforced."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SchemaError(f"`{where}` is not valid JSON: {e}", where) from None
        if schema is not None:
            check_schema(schema, where)
        text = json.dumps(length_patterns(schema)) if schema is not None else '{"type": "object"}'
        return self.cached(("json", text), lambda: self.compiler.compile_json_schema(
            text, any_whitespace=False, strict_mode=schema is not None), where)

    def tool_call(self, tools: list, required: bool):
        """A tool call, {"name": NAME, "arguments": {...}} for one of `tools` ([(name, parameters schema)]), its
        arguments valid under that tool's schema; unless `required`, either that or text whose first character is
        not "{" (the model chooses by its first token whether it calls a tool)."""
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": length_patterns(parameters)},
                  "required": ["name", "arguments"]} for name, parameters in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        key = json.dumps([schema, required], sort_keys=True)

        def build():
            call = self.xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
            if not required:
                call = self.xgr.Grammar.union(call, self.xgr.Grammar.from_ebnf('root ::= [^{] [^\\0]*'))
            return self.compiler.compile_grammar(call)
        return self.cached(("tools", key), build, "tools")

    def cached(self, key, build, where: str):
        """The grammar compiled for `key`, built (outside the lock: the server compiles in several threads) if new."""
        with self.lock:
            compiled = self.compiled.pop(key, None)
        if compiled is None:
            try:
                compiled = build()
            except (RuntimeError, ValueError) as e:  # xgrammar's word on a schema it cannot convert
                message = re.sub(r"^\[[^\]]*\] \S+: ", "", str(e).strip().splitlines()[0])
                raise SchemaError(f"`{where}`: the schema cannot be compiled: {message}", where) from None
        with self.lock:
            self.compiled[key] = compiled
            while len(self.compiled) > self.CACHED:
                self.compiled.pop(next(iter(self.compiled)))
        return compiled


DEAD_END = "the grammar allows no token here (a dead end): the answer ends before it is complete"


class Constraint:
    """One row's grammar state: which tokens may come next, advanced by each token the row takes."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar
        self.xgr = xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self.note = None  # why the answer ended where the grammar left no token (a dead end)

    @property
    def ended(self) -> bool:
        """The grammar is done (it took an end-of-sequence token) or allows nothing more."""
        return self.matcher.is_terminated() or self.note is not None

    def allowed(self) -> torch.Tensor:
        """The bitmask of the tokens allowed next ([1, words] int32, bit t of word t // 32 for token t); at a dead end
        (no token allowed) `note` says so and ended turns true."""
        if self.matcher.is_terminated():  # done: nothing comes after its end-of-sequence token
            self.bitmask.zero_()
            return self.bitmask
        self.matcher.fill_next_token_bitmask(self.bitmask)
        if not bool(self.bitmask.any()):
            self.note = DEAD_END
        return self.bitmask

    def mask(self, logits: torch.Tensor) -> bool:
        """logits [V] (float32): the tokens the grammar forbids next set to -inf, in place; False at a dead end."""
        bitmask = self.allowed()
        if self.note is not None:
            return False
        apply_bitmask(logits.view(1, -1), bitmask, self.vocab_size)
        return True

    def accept(self, token: int) -> bool:
        """The row took `token`. False where the grammar allows no token at all (a dead end: the token was drawn
        from a row with every logit masked; `note` says so): the row ends without it."""
        if self.matcher.accept_token(token):
            return True
        if self.allowed().any():  # a token the mask forbade: a bug, not the grammar's dead end
            raise RuntimeError(f"token {token} was taken where the grammar forbids it")
        return False

    def prune(self, tree) -> tuple:
        """(tree without the drafted nodes the grammar forbids, [n, words] bitmask at each kept node). Each kept
        sampled node's proposal is masked by what the grammar allows at its parent and renormalised.
        Why verification stays exact: the drafter drew a node's siblings without replacement from q; the draws the
        grammar allows, in order, are then draws without replacement from q restricted to the allowed tokens and
        renormalised (q_A). Keeping those, with q_A as their proposal, is a draft of a drafter that proposes q_A, and
        verify() is exact for any drafter. A node's subtree was drafted after its token: it goes with it."""
        kids, keep, masks, note = tree.children(), [], {}, self.note

        def visit(node):
            masks[node] = self.allowed()[0].clone()
            if self.matcher.is_terminated():  # after an end-of-sequence token: nothing is allowed below it
                return
            for child in kids[node]:
                if self.matcher.accept_token(tree.tokens[child]):
                    keep.append(child)
                    visit(child)
                    self.matcher.rollback(1)
        visit(0)
        self.note = note  # a node's dead end is verification's business (its mask allows nothing to sample there)
        pruned = tree.subtree(keep)
        for new, old in enumerate([0] + keep):
            q = pruned.proposals[new]
            if q is not None:
                allowed = unpack(masks[tree.parents[old]], q.shape[-1]).to(q.device)
                pruned.proposals[new] = mask_proposal(q, allowed)
        return pruned, torch.stack([masks[old] for old in [0] + keep])


def mask_proposal(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q restricted to the allowed tokens and renormalised: the proposal of the drafts the grammar keeps."""
    rest = q * allowed
    return rest / rest.sum()


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., words] int32 bitmask -> [..., vocab_size] bool (token t allowed)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: Optional[int] = None):
    """logits [n, V] (float32, contiguous) with each row's forbidden tokens set to -inf, in place, by bitmask
    [n, words]: xgrammar's CPU kernel on the CPU, the bits unpacked on the device elsewhere."""
    vocab_size = vocab_size or logits.shape[-1]
    if logits.device.type == "cpu":
        import xgrammar
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
    else:
        allowed = unpack(bitmask.to(logits.device), vocab_size)
        logits[..., :vocab_size].masked_fill_(~allowed, -float("inf"))
        logits[..., vocab_size:] = -float("inf")
