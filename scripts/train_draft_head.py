"""Train a draft head (drafthead.py) for a checkpoint on this machine, from the target alone.

    python scripts/train_draft_head.py --checkpoint_path checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth \
        --out checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/head
    python generate.py --compile --checkpoint_path .../model.pth --draft_head .../head --chat --prompt "..."

1. Prompts: everyday requests to an assistant made from templates and topic lists (scripts/chat_requests.py:
   explanations, how things work, advice, comparisons, stories, poems, code, recipes, trips), questions about the
   Python standard library's own modules and docstrings (parsed from its sources, not imported), and paragraphs of
   --text FILE (repeatable) to summarize or continue. (Questions the target wrote itself, sampled, were mostly not
   questions at all for a model of SmolLM2's size, and the head learnt their answers' boilerplate.)
2. Self-distillation (EAGLE, HASS): the target answers them itself, `--batch_size` rows decoded together (eagerly:
   no graph to build), greedily and at temperature 0.7, in its chat template, so the head learns what the target
   says, not what a dataset says. The forwards that write an answer also give the head's inputs and labels: every
   position's features (inputs of a low, a middle and a high block, EAGLE-3) and the target's top-k next-token
   probabilities, so no second pass over the conversations is needed and the time goes to more of them.
3. Optionally (--text_chars), text-forced conversations (EAGLE trained on fixed text): passages of prose that ship
   offline (--text files, the Python documentation's topics, the standard library's docstrings) as the assistant's
   answers; the labels are still the target's own next-token probabilities at every position, from one more
   forward over each (a bf16 copy of the target). Measured on SmolLM2 within the same training time they lowered
   the held-out acceptance (fewer passes over the target's own answers), so they are off by default.
4. The draft vocabulary is the most frequent tokens of the distilled answers (FR-Spec, Zhao et al. 2025). The head's
   layer starts as the target's block at the highest feature layer (`--init block`): the head is a shallow copy of
   the target's top before it learns anything, which helps where the data is a few minutes of a CPU's distilling.
5. Training-time test (EAGLE-3, Li et al. 2025): step s at slot p feeds the head its own step s - 1 output from slot
   p - 1 and attends the real entries up to the chain's root p - s + 1 plus its own chain: the head learns to draft
   from its own predictions, as it does at depth s. Loss: cross-entropy against the target's top-k distribution;
   products in bf16 where the CPU has bf16 dot products (weights and optimizer state stay float32); batches of
   conversations of similar lengths; the learning rate's schedule ends with the epochs or --max_minutes.
Each phase's result is kept in OUT/work/ (written atomically); run the same command again to resume.
"""
import argparse
import ast
import collections
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from chat_requests import chat_questions  # noqa: E402
from errors import UserError, interruptible_imports, read_user_text, run_cli, write_atomically  # noqa: E402

interruptible_imports(__name__)  # Ctrl-C from here on: one line, exit 130

TEMPLATES = ["What does the Python function `{name}` in the `{module}` module do?",
             "Explain `{module}.{name}` to a beginner, with a short example.",
             "Here is the documentation of `{module}.{name}`:\n\n{doc}\n\nExplain it in simple words.",
             "Write a small Python program that uses `{module}.{name}`.",
             "When would I use the `{module}` module in Python? Answer briefly.",
             "{doc}\n\nSummarize this in one or two sentences."]
TEXT_TEMPLATES = ["Summarize the following text:\n\n{text}", "Continue this text:\n\n{text}",
                  "What is the main point of this passage?\n\n{text}"]


def stdlib_entries(limit: int, rng: random.Random) -> list:
    """(module, name, first paragraph of its docstring) for public functions and classes of the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    out = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
                if 40 <= len(doc) <= 600:
                    out.append((path.stem, node.name, doc))
        if len(out) >= 4 * limit:
            break
    return out


FORCED_ASKS = ["Tell me about {title}.", "Explain {title}.", "Can you write a few paragraphs about {title}?",
               "What should I know about {title}?", "Describe {title} in detail."]


def statements(tree: ast.AST):
    """The statements of a module in ast.walk's order, without the expressions (most of its nodes, and none of them
    a definition)."""
    kinds = (ast.stmt, ast.excepthandler, ast.match_case)
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, kinds))
        yield node


def prose_passages(texts: list, chars: int, rng: random.Random) -> list:
    """About `chars` characters of prose that ships offline, as (title, passage of ~1500 characters) pairs: the
    user's texts first, then the Python documentation's topics (pydoc_data) and the standard library's docstrings."""
    sources = [("this text", t) for t in texts]
    try:
        from pydoc_data.topics import topics
        sources += [(name.replace("-", " "), text) for name, text in sorted(topics.items())]
    except ImportError:  # some distributions leave the documentation out
        pass
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(tree) or ""] + [ast.get_docstring(n) or "" for n in statements(tree)
                                                   if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        sources.append((f"the Python module {path.stem}", "\n\n".join(d for d in docs if len(d) >= 80)))
    passages = []
    for title, text in sources:
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        chunk = ""
        for paragraph in paragraphs:
            chunk = f"{chunk}\n\n{paragraph}" if chunk else paragraph
            if len(chunk) >= 1500:
                passages.append((title, chunk[:3000]))
                chunk = ""
        if len(chunk) >= 300:
            passages.append((title, chunk))
    user = [p for p in passages if p[0] == "this text"]
    rest = [p for p in passages if p[0] != "this text"]
    rng.shuffle(rest)
    out, total = [], 0
    for passage in user + rest:
        if total >= chars:
            break
        out.append(passage)
        total += len(passage[1])
    return out


def forced_conversations(model, tokenizer, passages: list, chat: bool, rng: random.Random, max_len: int) -> dict:
    """Each passage as the answer to a request for it: {"prompt_ids", "answers"}, at most max_len positions each."""
    data = {"prompt_ids": [], "answers": []}
    for title, text in passages:
        prompt = encode(tokenizer, model, rng.choice(FORCED_ASKS).format(title=title), chat)
        body = tokenizer.encode(text)[:max(0, max_len - len(prompt))]
        if len(body) >= 16:
            data["prompt_ids"].append(prompt)
            data["answers"].append(body)
    return data


def encode(tokenizer, model, text: str, chat: bool) -> list:
    from generation import encode_prompt
    return encode_prompt(text, tokenizer, model.args.vocab_size, 0, chat)


def make_prompts(count: int, texts: list, seed: int, chat_share: float) -> list:
    """`count` prompts: everyday requests (chat_requests.py, `chat_share` of them), then requests about the user's
    paragraphs (half of the rest, if any) and about the standard library's functions and docstrings."""
    rng = random.Random(seed)
    prompts = chat_questions(round(count * chat_share), rng)
    count -= len(prompts)
    paragraphs = [p.strip() for t in texts for p in t.split("\n\n") if 80 <= len(p.strip()) <= 1500]
    share = count // 2 if paragraphs else 0
    for _ in range(share):
        prompts.append(rng.choice(TEXT_TEMPLATES).format(text=rng.choice(paragraphs)))
    entries = stdlib_entries(count - share, rng)
    if not entries and count > share:
        raise UserError("found no standard-library sources to make prompts from: pass `--text FILE`")
    for _ in range(count - share):
        module, name, doc = rng.choice(entries)
        prompts.append(rng.choice(TEMPLATES).format(module=module, name=name, doc=doc))
    rng.shuffle(prompts)
    return prompts


# ----------------------------------------------------------------------------- phases

def decode_batch(model, prompts: list, batch_size: int, max_new_tokens: int, sampling, eos: set, keep: bool = True,
                 layers: tuple = (), top_k: int = 8) -> list:
    """The target's answers to a batch of prompts (lists of ids, right-padded into one cache), decoded eagerly with
    one [B, 1] step per token. keep: also every fed position's features (bf16, the inputs of `layers`) and top-k
    next-token ids / probabilities, taken from the forwards that generate the answer, so no second pass over the
    conversations is needed. A row ends before its end-of-turn token: the last position's labels predict it.
    Returns per row {"answer": generated ids} (+ "tokens", "features", "top_ids", "top_probs" over prompt + answer)."""
    import torch
    from decode import sample
    count = len(prompts)
    prompts = prompts + prompts[-1:] * (batch_size - count)  # the last batch padded: one cache shape throughout
    B, lens = len(prompts), [len(p) for p in prompts]
    T = max(lens)
    with torch.no_grad():
        model.setup_caches(B, T + max_new_tokens + 1)
        x = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
        h, prompt_features = model.run_layers(x, torch.arange(T).expand(B, T), None, None, None, layers)
        last = torch.tensor(lens) - 1
        logits = model.output(model.norm(h[torch.arange(B), last])).float()  # [B, V]
        answers, done, pos = [[] for _ in prompts], [False] * B, last.clone()
        labels, fed = [], []  # per step: top-k ids and probabilities [B, k]; features of the tokens fed [B, F]
        for step in range(max_new_tokens):
            if keep:
                top = torch.topk(logits, top_k, dim=-1)
                labels.append((top.indices.to(torch.int32),
                               (top.values - torch.logsumexp(logits, -1, keepdim=True)).exp().to(torch.float16)))
            token = sample(logits, sampling)[0]
            for b, t in enumerate(token.tolist()):
                if not done[b]:
                    answers[b].append(t)
                    done[b] = t in eos or step == max_new_tokens - 1
            if all(done):
                break
            pos += 1
            h, features = model.run_layers(token.view(B, 1), pos.view(B, 1), None, None, None, layers)
            logits = model.output(model.norm(h[:, 0])).float()
            if keep:
                fed.append(features[:, 0].to(torch.bfloat16))
    if not keep:
        return [{"answer": a} for a in answers[:count]]
    ids, probs = torch.stack([i for i, _ in labels], 1), torch.stack([v for _, v in labels], 1)  # [B, steps, k]
    fed = torch.stack(fed, 1) if fed else prompt_features.new_zeros(B, 0, prompt_features.shape[-1])
    out = []
    for b in range(count):
        n, steps = lens[b], len(answers[b])  # a row's steps: its answer's tokens, of which all but the last were fed
        row_ids = torch.zeros(n + steps - 1, top_k, dtype=torch.int32)
        row_probs = torch.zeros(n + steps - 1, top_k, dtype=torch.float16)  # zero before the prompt's end: no label
        row_ids[n - 1:], row_probs[n - 1:] = ids[b, :steps], probs[b, :steps]
        out.append({"answer": answers[b], "tokens": torch.tensor(prompts[b] + answers[b][:-1], dtype=torch.int32),
                    "features": torch.cat([prompt_features[b, :n].to(torch.bfloat16), fed[b, :steps - 1]]),
                    "top_ids": row_ids, "top_probs": row_probs})
    return out


def distill(model, prompts: list, work: Path, max_new_tokens: int, batch_size: int, eos: set, layers: tuple,
            top_k: int, seed: int) -> dict:
    """Self-distillation: the target's own answers to `prompts`, half of the batches greedy, half at T = 0.7, with
    their features and labels (decode_batch). Each batch is kept in work/distilled/ (resumable)."""
    import torch
    from tqdm import tqdm
    from decode import Sampling
    shards = work / "distilled"
    shards.mkdir(parents=True, exist_ok=True)
    data = {"tokens": [], "prompt_len": [], "features": [], "top_ids": [], "top_probs": []}
    for i in tqdm(range(0, len(prompts), batch_size), desc="distilling answers", unit="batch"):
        shard = shards / f"{i:06d}.pt"
        batch = prompts[i:i + batch_size]
        if shard.exists():
            rows = torch.load(shard, weights_only=True)
        else:
            torch.manual_seed(seed + i)
            # half of the batches greedy, half sampled: the head serves both
            sampling = Sampling(0.0) if (i // batch_size) % 2 == 0 else Sampling(0.7, top_k=50)
            rows = decode_batch(model, batch, batch_size, max_new_tokens, sampling, eos, True, layers, top_k)
            rows = [{k: v for k, v in row.items() if k != "answer"} for row in rows]
            write_atomically(shard, lambda tmp: torch.save(rows, tmp))
        for p, row in zip(batch, rows):
            if len(row["tokens"]) > len(p):  # an answer of one token (end of turn at once) teaches nothing
                for key in ("tokens", "features", "top_ids", "top_probs"):
                    data[key].append(row[key])
                data["prompt_len"].append(len(p))
    return data


def features(model, layers: tuple, data: dict, path: Path, top_k: int):
    """The target's features [n, F] (bf16) and top-k next-token ids / probabilities at every position of every
    conversation; one forward each, of a bf16 copy of the target (about twice as fast on CPUs with bf16 dot products;
    the labels move by bf16's rounding): what text-forced conversations need, as they are not decoded."""
    import copy
    import torch
    from tqdm import tqdm
    if path.exists():
        return torch.load(path, weights_only=True)
    seqs = [p + a for p, a in zip(data["prompt_ids"], data["answers"])]
    out = {"tokens": [None] * len(seqs), "prompt_len": [len(p) for p in data["prompt_ids"]],
           "features": [None] * len(seqs), "top_ids": [None] * len(seqs), "top_probs": [None] * len(seqs)}
    # without oneDNN's packed float32 copies (kernels.use_fast_weight_layout, where they time faster): they cannot be
    # deep-copied, and a bfloat16 copy multiplies its own weights
    packed = {id(m.packed): None for m in model.modules() if getattr(m, "packed", None) is not None}
    half = copy.deepcopy(model, packed).to(torch.bfloat16)
    group = 8  # conversations per forward, right-padded (padding comes after every position that is kept)
    half.setup_caches(group, max(map(len, seqs)) + 1)
    by_length = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # little padding within a group
    with torch.no_grad():
        for i in tqdm(range(0, len(seqs), group), desc="target features", unit="batch"):
            idx = by_length[i:i + group]
            T = max(len(seqs[j]) for j in idx)
            x = torch.tensor([seqs[j] + [0] * (T - len(seqs[j])) for j in idx])
            logits, feats = half.forward_features(x, torch.arange(T).expand(len(idx), T), layers=layers)
            top = torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1)
            for r, j in enumerate(idx):
                n = len(seqs[j])
                out["tokens"][j] = torch.tensor(seqs[j], dtype=torch.int32)
                out["features"][j] = feats[r, :n].to(torch.bfloat16)
                out["top_ids"][j] = top.indices[r, :n].to(torch.int32)
                out["top_probs"][j] = top.values[r, :n].to(torch.float16)
    del half
    write_atomically(path, lambda tmp: torch.save(out, tmp))
    return out


def draft_vocabulary(data: dict, size: int, vocab_size: int):
    """The `size` tokens the target predicts most often (its answers' tokens and top-k choices), ascending ids."""
    import torch
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for tokens, n, ids, probs in zip(data["tokens"], data["prompt_len"], data["top_ids"], data["top_probs"]):
        counts.index_add_(0, tokens[n:].long(), torch.ones(len(tokens) - n, dtype=torch.float64))
        counts.index_add_(0, ids[n - 1:].flatten().long(), probs[n - 1:].flatten().double())
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


# ----------------------------------------------------------------------------- training-time test

def ttt_loss(head, batch: dict, steps: int, decay: float = 0.8):
    """EAGLE-3's training-time test on a padded batch; returns (loss, top-1 hits per step, counted positions per
    step). Entry p (p >= 1) holds (features of p - 1, token p); its output predicts token p + 1."""
    import torch
    import torch.nn.functional as F
    from model import apply_rope
    tokens, feats, labels, label_p, live = (batch[k] for k in ("tokens", "features", "labels", "label_probs", "live"))
    B, T = tokens.shape
    attn = head.attention
    n_q, n_kv, hd = attn.n_head, attn.n_local_heads, attn.head_dim
    pos = torch.arange(T)
    rope = head.rope_table[pos].unsqueeze(0).expand(B, T, -1, -1)
    emb = head.input_norm(head.embeddings(tokens))  # [B, T, dim]
    # step 1's input at p: the target's features at p - 1 (slot 0: nothing)
    hidden = F.pad(head.fuse(feats.float())[:, :-1], (0, 0, 1, 0))  # [B, T, dim]
    keys, values = [], []
    total, hits, counted = 0.0, [], []
    for s in range(1, steps + 1):
        x = torch.cat([emb, head.hidden_norm(hidden)], -1)
        q, k, v = attn.wqkv(x).split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
        q = apply_rope(q.view(B, T, n_q, hd), rope).transpose(1, 2)  # [B, n_q, T, hd]
        keys.append(apply_rope(k.view(B, T, n_kv, hd), rope).transpose(1, 2))  # [B, n_kv, T, hd]
        values.append(v.view(B, T, n_kv, hd).transpose(1, 2))
        # query p of step s: step 1's entries 1 .. p - s + 1 (the root), then step t's entry p - s + t, t = 2 .. s
        j = pos.view(1, -1)
        blocks = [(j >= 1) & (j <= pos.view(-1, 1) - s + 1)]
        blocks += [j == pos.view(-1, 1) - s + t for t in range(2, s + 1)]
        mask = torch.cat(blocks, 1)  # [T, s * T]
        K = torch.cat(keys, 2).repeat_interleave(n_q // n_kv, 1)
        V = torch.cat(values, 2).repeat_interleave(n_q // n_kv, 1)
        rows_ok = mask.any(1)
        y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask | ~rows_ok.view(-1, 1))
        y = y.transpose(1, 2).reshape(B, T, n_q * hd)
        h = hidden + attn.wo(y)
        h = h + head.feed_forward(head.post_norm(h))
        # counted: the chain's root p - s + 1 is a generated token (>= the prompt's length) and the label exists;
        # the output layer runs on those positions only
        use = live & (pos.view(1, -1) - s + 1 >= batch["prompt_len"].view(-1, 1)) & rows_ok.view(1, -1)
        logp = torch.log_softmax(head.logits(h[use]).float(), -1)  # [counted, Vd]
        ce = -(label_p[use] * logp.gather(-1, labels[use].clamp_min(0))).sum(-1)  # label -1 (not drafted): p 0
        total = total + decay ** (s - 1) * ce.sum() / max(len(ce), 1)
        hits.append(int((logp.argmax(-1) == labels[use][:, 0]).sum()))
        counted.append(len(ce))
        hidden = F.pad(h[:, :-1], (0, 0, 1, 0))  # step s + 1 at p reads step s's output at p - 1
    return total, hits, counted


def make_batches(data: dict, to_draft, order: list, batch_size: int, max_len: int):
    """Padded training batches of the conversations in `order`: labels mapped to draft ids (-1: not drafted)."""
    import torch
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        T = min(max_len, max(len(data["tokens"][j]) for j in idx))
        B, F_ = len(idx), data["features"][0].shape[-1]
        k = data["top_ids"][0].shape[-1]
        batch = {"tokens": torch.zeros(B, T, dtype=torch.long), "features": torch.zeros(B, T, F_, dtype=torch.bfloat16),
                 "labels": torch.full((B, T, k), -1, dtype=torch.long), "label_probs": torch.zeros(B, T, k),
                 "live": torch.zeros(B, T, dtype=torch.bool), "prompt_len": torch.zeros(B, dtype=torch.long)}
        for r, j in enumerate(idx):
            n = min(T, len(data["tokens"][j]))
            batch["tokens"][r, :n] = data["tokens"][j][:n].long()
            batch["features"][r, :n] = data["features"][j][:n]
            labels = to_draft[data["top_ids"][j][:n].long()]
            probs = data["top_probs"][j][:n].float() * (labels >= 0)
            batch["labels"][r, :n] = labels
            batch["label_probs"][r, :n] = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
            batch["live"][r, 1:n] = True  # entry 0 holds no features
            batch["prompt_len"][r] = data["prompt_len"][j]
        yield batch


def epoch_batches(train_set: list, lengths: list, batch_size: int, seed: int) -> list:
    """One epoch's batches (lists of conversations): shuffled, sorted by length within runs of 16 batches so that a
    batch pads little (every position of a padded batch costs a head forward), then the batches in random order."""
    rng = random.Random(seed)
    order = train_set[:]
    rng.shuffle(order)
    batches = []
    for i in range(0, len(order), 16 * batch_size):
        run = sorted(order[i:i + 16 * batch_size], key=lengths.__getitem__)
        batches += [run[j:j + batch_size] for j in range(0, len(run), batch_size)]
    rng.shuffle(batches)
    return batches


def autocast():
    """bf16 products with float32 weights and optimizer state where the CPU multiplies bf16 natively (AVX-512):
    faster steps, so more of the data in the same minutes."""
    import torch
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=torch.ops.mkldnn._is_mkldnn_bf16_supported())


def start_from_block(head, target):
    """The head's layer starts as the target's block that reads the highest feature layer, `fc` passing that
    layer's features through: before training, the head is that block run once more on the residual stream."""
    import torch
    top = head.args.target_layers[-1]
    block, dim = target.layers[top], head.args.dim
    with torch.no_grad():
        head.fc.weight[:, (len(head.args.target_layers) - 1) * dim:] += torch.eye(dim)
        head.hidden_norm.weight.copy_(block.attention_norm.weight.float())
        head.attention.wqkv.weight[:, dim:] = block.attention.wqkv.weight.float()  # the hidden half of its input
        head.attention.wo.weight.copy_(block.attention.wo.weight.float())
        head.post_norm.weight.copy_(block.ffn_norm.weight.float())
        for name in ("w1", "w2", "w3"):
            getattr(head.feed_forward, name).weight.copy_(getattr(block.feed_forward, name).weight.float())


def train(target, data: dict, vocab, out: Path, work: Path, args) -> dict:
    """The head trained on `data` for --epochs or --max_minutes, whichever ends first (resuming from work/state.pt,
    saved every two minutes); returns it with its figures, its top-1 per depth on held-out answers among them."""
    import torch
    from tqdm import tqdm
    head = new_head(target, vocab, args)
    head.setup_caches(1, max(len(t) for t in data["tokens"]) + 1)
    to_draft = torch.full((target.args.vocab_size,), -1, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    forced = data.get("forced") or [False] * len(data["tokens"])
    conversations = [i for i in range(len(data["tokens"])) if not forced[i]]
    random.Random(args.seed).shuffle(conversations)
    held = conversations[:max(1, len(conversations) // 20)]  # held out: the target's own answers, as at run time
    train_set = conversations[len(held):] + [i for i in range(len(data["tokens"])) if forced[i]]
    lengths = [min(len(t), args.max_len) for t in data["tokens"]]
    per_epoch = len(epoch_batches(train_set, lengths, args.train_batch, args.seed))
    total_steps = max(1, int(per_epoch * args.epochs))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    state_path = work / "state.pt"
    step, seconds, losses = 0, 0.0, []
    if state_path.exists():
        saved = torch.load(state_path, weights_only=True)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        step, seconds, losses = saved["step"], saved["seconds"], saved.get("losses", [])
    warmup = min(100, total_steps // 10 + 1)
    bar = tqdm(total=total_steps, initial=step, desc="training the head", unit="batch")
    last_save, started = time.perf_counter(), time.perf_counter() - seconds
    budget = args.max_minutes * 60

    def progress() -> float:  # the schedule ends with the epochs or the time budget, whichever comes first
        return max(step / total_steps, (time.perf_counter() - started) / budget)
    batches, batches_epoch = None, -1
    while progress() < 1:
        epoch, within = divmod(step, per_epoch)
        if epoch != batches_epoch:
            batches, batches_epoch = epoch_batches(train_set, lengths, args.train_batch, args.seed + epoch), epoch
        batch = next(make_batches(data, to_draft, batches[within], args.train_batch, args.max_len))
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress()))
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast():
            loss, hits, counted = ttt_loss(head, batch, args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        bar.total = max(step, min(total_steps, round(step / progress())))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{hits[0] / max(counted[0], 1):.2f}")
        if time.perf_counter() - last_save > 120 or progress() >= 1:
            state = {"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "seconds": time.perf_counter() - started, "losses": losses}
            write_atomically(state_path, lambda tmp: torch.save(state, tmp))
            last_save = time.perf_counter()
    bar.close()
    accuracy = heldout_accuracy(head, data, to_draft, held, args)
    tenth = max(1, len(losses) // 10)
    return head, {"steps": step, "epochs": step / per_epoch, "train_seconds": time.perf_counter() - started,
                  "loss_first_tenth": sum(losses[:tenth]) / tenth, "loss_last_tenth": sum(losses[-tenth:]) / tenth,
                  "heldout_top1_per_depth": accuracy, "heldout_conversations": len(held)}


def new_head(target, vocab, args):
    """A head for `target` drafting `vocab`, before training: small random weights, the target's own output layer
    on the draft vocabulary, and (--init block) its layer started as the target's top feature block."""
    import torch
    import drafthead
    head_args = drafthead.HeadArgs.for_target(target, len(vocab))
    head = drafthead.DraftHead(head_args).attach(target)
    torch.manual_seed(args.seed)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():  # start from the target's own output layer on the draft vocabulary
        head.output.weight.copy_(target.output.weight[vocab].float())
        head.norm.weight.copy_(target.norm.weight.float())
        head.token_ids.copy_(vocab)
    if args.init == "block":
        start_from_block(head, target)
    return head


def heldout_accuracy(head, data: dict, to_draft, held: list, args) -> list:
    """The trained head's top-1 accuracy per drafting depth on the held-out conversations."""
    import torch
    head.eval()
    with torch.no_grad():
        hits, counted = [0] * args.ttt_steps, [0] * args.ttt_steps
        for batch in make_batches(data, to_draft, held, args.train_batch, args.max_len):
            with autocast():
                _, h, c = ttt_loss(head, batch, args.ttt_steps)
            hits = [a + b for a, b in zip(hits, h)]
            counted = [a + b for a, b in zip(counted, c)]
    return [h / max(c, 1) for h, c in zip(hits, counted)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_path", type=Path, required=True, help="the target checkpoint (model.pth)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the head (config.json, "
                                                                "model.safetensors) and its work files")
    parser.add_argument("--text", type=Path, action="append", default=[], help="more text to make prompts from")
    parser.add_argument("--prompts", type=int, default=2560, help="conversations to distill")
    parser.add_argument("--chat_share", type=float, default=0.75,
                        help="share of the prompts that are everyday requests (scripts/chat_requests.py); the rest "
                             "ask about --text and the standard library")
    parser.add_argument("--max_new_tokens", type=int, default=160, help="length of each distilled answer")
    parser.add_argument("--text_chars", type=int, default=0,
                        help="characters of offline prose to add as text-forced conversations (default none: within "
                             "the time budget they cost passes over the distilled answers, BENCHMARKS.md)")
    parser.add_argument("--batch_size", type=int, default=64, help="rows decoded together while distilling")
    parser.add_argument("--draft_vocab", type=int, default=4096, help="tokens the head can draft (FR-Spec)")
    parser.add_argument("--top_k", type=int, default=8, help="target probabilities kept per position")
    parser.add_argument("--ttt_steps", type=int, default=3, help="training-time-test depth")
    parser.add_argument("--epochs", type=float, default=12, help="at most; --max_minutes ends it sooner")
    parser.add_argument("--train_batch", type=int, default=8, help="conversations per training step")
    parser.add_argument("--max_len", type=int, default=512, help="positions per conversation in training")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max_minutes", type=float, default=18.0,
                        help="training time: the learning-rate schedule ends there")
    parser.add_argument("--init", choices=("block", "random"), default="block",
                        help="the head's layer starts as the target's block at the highest feature layer (learns "
                             "faster in the same minutes, BENCHMARKS.md) or from random weights")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> list:
    """The flags checked before anything loads; returns the --text files' texts."""
    for name in ("prompts", "max_new_tokens", "batch_size", "draft_vocab", "top_k", "ttt_steps", "train_batch",
                 "max_len"):
        if getattr(args, name) < 1:
            raise UserError(f"`{name}` must be >= 1")
    if args.text_chars < 0:
        raise UserError("`text_chars` must be >= 0")
    if not args.epochs > 0 or not args.max_minutes > 0:
        raise UserError("`epochs` and `max_minutes` must be > 0")
    if not 0 < args.lr < math.inf:  # AdamW would refuse it only after the distilling
        raise UserError(f"`lr` must be a positive number, got {args.lr}")
    if not 0 <= args.chat_share <= 1:
        raise UserError("`chat_share` must be between 0 and 1")
    if not args.checkpoint_path.is_file():
        raise UserError(f"no checkpoint at {args.checkpoint_path}: convert or download one first")
    check_out(args.out, args.checkpoint_path)
    return [read_user_text(path, "text", "pass a UTF-8 text file") for path in args.text]


def check_out(out: Path, checkpoint_path: Path):
    """--out takes the head's config.json and model.safetensors: a file, the checkpoint's own directory or another
    model's are refused before the training, not replaced after it."""
    if out.exists() and not out.is_dir():
        raise UserError(f"`out` {out} is a file: name a directory for the head")
    config = out / "config.json"
    if out.resolve() == checkpoint_path.resolve().parent or config.is_file() and not is_head_config(config):
        raise UserError(f"`out` {out} holds a model's config.json, which the head's would replace: name a directory "
                        f"of its own (e.g. {checkpoint_path.parent / 'head'})")


def is_head_config(path: Path) -> bool:
    """A draft head's config.json (ours or EAGLE-3's): a head trained there before may be replaced."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(cfg, dict) and ("eagle_config" in cfg or any("Eagle" in str(a) for a in
                                                                   cfg.get("architectures") or []))


def main(argv=None):
    args = parse_args(argv)
    texts = check_args(args)
    import torch
    from tokenizer import get_tokenizer
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    target = load_target(args.checkpoint_path)
    if args.top_k > target.args.vocab_size:  # torch.topk would fail at the first distilled batch
        raise UserError(f"`top_k` {args.top_k} exceeds the model's {target.args.vocab_size} tokens: lower `top_k`")
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = get_tokenizer(args.checkpoint_path.parent)
    data = distilled_answers(target, tokenizer, texts, work, args)
    distilled = time.perf_counter()
    if args.text_chars > 0:
        add_forced_text(data, target, tokenizer, texts, work, args)
    vocab = draft_vocabulary(data, args.draft_vocab, target.args.vocab_size)
    forced_done = time.perf_counter()
    head, stats = train(target, data, vocab, args.out, work, args)
    stats.update({"target": str(args.checkpoint_path), **data_figures(data), "draft_vocab": len(vocab),
                  "ttt_steps": args.ttt_steps, "distill_seconds": distilled - started,
                  "text_forced_seconds": forced_done - distilled, "total_seconds": time.perf_counter() - started})
    save(head, stats, args.out)
    return stats


def load_target(checkpoint_path: Path):
    """The float target, its weights laid out for batched products; a quantized file is refused."""
    import quantize
    from generation import load_model
    from kernels import use_fast_weight_layout
    target = load_model(checkpoint_path)
    if any(isinstance(m, (quantize.Int8Linear, quantize.Int4Linear)) for m in target.modules()):
        raise UserError(f"{checkpoint_path} is a quantized file: train the head on the float checkpoint "
                        f"(model.pth); the head drafts for the quantized files of the same model too")
    use_fast_weight_layout(target)  # products of batch_size rows on oneDNN-packed weights
    return target


def distilled_answers(target, tokenizer, texts: list, work: Path, args) -> dict:
    """The target's own answers to --prompts prompts (as in a chat where the checkpoint has a template), with its
    features and top-k probabilities at every position."""
    import drafthead
    eos = set(target.args.eos_token_ids) | set(tokenizer.eos_ids)
    chat = tokenizer.chat_template is not None  # answers as the target gives them in a chat
    prompts = make_prompts(args.prompts, texts, args.seed, args.chat_share)
    limit = target.args.block_size - args.max_new_tokens - 1
    ids = [encode(tokenizer, target, p, chat)[-limit:] for p in prompts]
    layers = drafthead.HeadArgs.for_target(target, 1).target_layers
    data = distill(target, ids, work, args.max_new_tokens, args.batch_size, eos, layers, args.top_k, args.seed)
    data["forced"] = [False] * len(data["tokens"])
    return data


def add_forced_text(data: dict, target, tokenizer, texts: list, work: Path, args):
    """--text_chars of prose as text-forced conversations, their features and probabilities added to `data`."""
    import drafthead
    chat = tokenizer.chat_template is not None
    layers = drafthead.HeadArgs.for_target(target, 1).target_layers
    passages = prose_passages(texts, args.text_chars, random.Random(args.seed + 2))
    extra = forced_conversations(target, tokenizer, passages, chat, random.Random(args.seed + 3), args.max_len)
    extra = features(target, layers, extra, work / "forced.pt", args.top_k)
    for key in ("tokens", "prompt_len", "features", "top_ids", "top_probs"):
        data[key] += extra[key]
    data["forced"] += [True] * len(extra["tokens"])


def data_figures(data: dict) -> dict:
    """How many conversations, distilled answer tokens and text-forced tokens `data` holds."""
    forced = data["forced"]
    return {"conversations": len(data["tokens"]),
            "answer_tokens": sum(len(t) - n for t, n, f in zip(data["tokens"], data["prompt_len"], forced) if not f),
            "text_forced_tokens": sum(len(t) - n for t, n, f in zip(data["tokens"], data["prompt_len"], forced) if f)}


def save(head, stats: dict, out: Path):
    """The head (recording what it was trained on) and train_stats.json in `out`."""
    import drafthead
    head.args.trained_for = {k: stats[k] for k in ("target", "conversations", "answer_tokens", "text_forced_tokens",
                                                   "steps")}
    drafthead.save_head(head, out)
    write_atomically(out / "train_stats.json", lambda tmp: tmp.write_text(json.dumps(stats, indent=1) + "\n"))
    print(f"wrote {out} in {stats['total_seconds'] / 60:.1f} min: {stats['answer_tokens']} distilled answer tokens, "
          f"{stats['text_forced_tokens']} text-forced tokens, "
          f"held-out top-1 per depth " + ", ".join(f"{a:.2f}" for a in stats["heldout_top1_per_depth"]))


if __name__ == "__main__":
    sys.exit(run_cli(main))
