"""Draft heads (drafthead.py, scripts/train_draft_head.py): greedy output identical to plain decoding, sampling lossless
(chi-square against the target's exact distribution, and a broken variant the same test rejects), EAGLE-3's published
format read as its reference computes it, one-line errors, and a head trained in seconds that drafts better than an
untrained one."""
import json

import pytest
import torch
import torch.nn.functional as F

import drafthead
import generation
import speculate
from decode import Engine, Sampling, logits_to_probs
from drafthead import DraftHead, HeadArgs, HeadDrafter, load_head, save_head
from errors import UserError
from helpers import REJECT_BELOW, chi_square_pvalue, load_cli
from model import ModelArgs, Transformer


def random_head(model: Transformer, draft_vocab: int, seed: int = 0, scale: float = 0.1) -> DraftHead:
    head = DraftHead(HeadArgs.for_target(model, draft_vocab)).attach(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0))
        head.token_ids.copy_(torch.randperm(model.args.vocab_size, generator=g)[:draft_vocab].sort().values)
    return head


@pytest.fixture(scope="module")
def head_dir(random_target, tmp_path_factory):
    model = generation.load_model(random_target)
    directory = tmp_path_factory.mktemp("head")
    save_head(random_head(model, 300), directory)
    return directory


PROMPTS = ["def main(", "Hello, my name is", "import os\nimport sys\n\nclass Parser:"]


@pytest.mark.parametrize("k,nodes,mode", [(1, None, "none"), (4, None, "none"), (3, 10, "none"),
                                         pytest.param(3, None, "regional", marks=pytest.mark.slow)])  # compiles
def test_greedy_identical_to_plain(random_target, head_dir, k, nodes, mode):
    plain = generation.Generator.build(random_target)
    head = generation.Generator.build(random_target, draft_head=head_dir, speculation=generation.Speculation(k, nodes),
                                      compile=mode)
    prompts = [plain.encode(p) for p in PROMPTS]
    for prompt in prompts[:2]:  # one row
        assert head.generate(prompt, 24, Sampling(0))[0] == plain.generate(prompt, 24, Sampling(0))[0]
    rows, stats = head.generate(prompts, 24, Sampling(0))  # rows of different lengths in one batch
    expected = plain.generate(prompts, 24, Sampling(0))[0]
    assert rows == expected
    assert stats["target_forwards"] <= 24 and stats["drafted"] > 0
    plain.eos_ids = head.eos_ids = [expected[0][4]]  # the first row stops early, the others go on
    assert head.generate(prompts, 24, Sampling(0))[0] == plain.generate(prompts, 24, Sampling(0))[0]
    if mode != "none":  # prompts of new lengths compile nothing more (the prompt's features: the prefill's block)
        from torch._dynamo.utils import counters
        graphs = counters["stats"]["unique_graphs"]
        for cut in (1, 2):
            shorter = [p[:len(p) - cut] for p in prompts]  # the same rows and caches
            assert head.generate(shorter, 24, Sampling(0))[0] == plain.generate(shorter, 24, Sampling(0))[0]
        assert counters["stats"]["unique_graphs"] == graphs


def test_head_files_round_trip(random_target, head_dir):
    model = generation.load_model(random_target)
    head = load_head(head_dir, model)
    again = load_head(head_dir / "model.safetensors", model)  # the file itself works too
    for (name, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 300
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.args.target_layers)


# ----------------------------------------------------------------------------- EAGLE-3's format, as published

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def eagle3_reference(t: dict, cfg: dict, embed: torch.Tensor, features, tokens, positions):
    """EAGLE-3's draft layer written from its published description, in Hugging Face's conventions (separate q/k/v,
    rotate-half RoPE): logits over the draft vocabulary for entries attending causally to each other."""
    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = d // nh, cfg["rms_norm_eps"]

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = features @ t["fc.weight"].T  # [T, d]
    x = torch.cat([norm(embed[tokens], t["midlayer.input_layernorm.weight"]),
                   norm(h, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, hd).transpose(0, 1)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(-1, nkv, hd).transpose(0, 1)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(-1, nkv, hd).transpose(0, 1)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(positions.float(), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(len(tokens), -1)
    h = h + y @ t["midlayer.self_attn.o_proj.weight"].T
    m = norm(h, t["midlayer.post_attention_layernorm.weight"])
    h = h + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    return norm(h, t["norm.weight"]) @ t["lm_head.weight"].T


def write_eagle3_head(directory, model: Transformer, draft_vocab: int, seed: int = 0):
    """An EAGLE-3 head as its published checkpoints hold it: bf16 tensors, d2t offsets, t2d, config.json."""
    from safetensors.torch import save_file
    a = model.args
    d, nh, nkv, hd, inter = a.dim, a.n_head, a.n_local_heads, a.head_dim, a.intermediate_size
    layers = [0, a.n_layer - 1]
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return (base + 0.2 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    ids = torch.randperm(a.vocab_size, generator=g)[:draft_vocab].sort().values
    t = {"fc.weight": r(d, len(layers) * d), "midlayer.input_layernorm.weight": r(d, base=1.0),
         "midlayer.hidden_norm.weight": r(d, base=1.0), "midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * d),
         "midlayer.self_attn.k_proj.weight": r(nkv * hd, 2 * d), "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * d),
         "midlayer.self_attn.o_proj.weight": r(d, nh * hd), "midlayer.post_attention_layernorm.weight": r(d, base=1.0),
         "midlayer.mlp.gate_proj.weight": r(inter, d), "midlayer.mlp.up_proj.weight": r(inter, d),
         "midlayer.mlp.down_proj.weight": r(d, inter), "norm.weight": r(d, base=1.0),
         "lm_head.weight": r(draft_vocab, d), "d2t": ids - torch.arange(draft_vocab),
         "t2d": torch.zeros(a.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": d, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "intermediate_size": inter, "vocab_size": a.vocab_size,
           "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}, "torch_dtype": "bfloat16"}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))
    return {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in t.items()}, cfg, ids


def test_reads_eagle3_heads_as_published(random_target, tmp_path):
    model = generation.load_model(random_target)
    tensors, cfg, ids = write_eagle3_head(tmp_path / "eagle3", model, 128)
    head = load_head(tmp_path / "eagle3", model, int8=False)
    assert head.args.target_layers == (0, model.args.n_layer - 1) and torch.equal(head.token_ids, ids)
    T = 9
    g = torch.Generator().manual_seed(1)
    features = torch.randn(T, 2 * model.args.dim, generator=g)
    tokens = torch.randint(0, model.args.vocab_size, (T,), generator=g)
    expected = eagle3_reference(tensors, cfg, model.tok_embeddings.weight.detach(), features, tokens,
                                torch.arange(T))
    head.setup_caches(1, 32)
    slots = torch.arange(1, T + 1).view(1, -1)  # entries start at slot 1; RoPE is relative, so the offset is free
    got = head.logits(head(head.fuse(features).unsqueeze(0), tokens.view(1, -1), slots))[0]
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    # the default on the CPU: int8 linear layers (weight-only, per output row), logits within int8's rounding
    import kernels
    import quantize
    small = load_head(tmp_path / "eagle3", model)
    if kernels.a8_kernels():
        assert all(isinstance(m, quantize.Int8Linear) for m in (small.fc, small.attention.wqkv, small.output))
    small.setup_caches(1, 32)
    approx = small.logits(small(small.fuse(features).unsqueeze(0), tokens.view(1, -1), slots))[0]
    assert (approx - expected).abs().max() <= 0.05 * expected.abs().max()
    # and it drafts: greedy output identical with it, as with any drafter
    plain = generation.Generator.build(random_target)
    with_head = generation.Generator.build(random_target, draft_head=tmp_path / "eagle3")
    prompt = plain.encode(PROMPTS[0])
    assert with_head.generate(prompt, 20, Sampling(0))[0] == plain.generate(prompt, 20, Sampling(0))[0]


@pytest.mark.parametrize("change,needle", [
    (lambda t, c: c.update(hidden_size=c["hidden_size"] * 2), "hidden_size"),
    (lambda t, c: c.update(vocab_size=7), "vocab_size"),
    (lambda t, c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 99]}), "layer"),
    (lambda t, c: t.pop("midlayer.mlp.up_proj.weight"), "midlayer.mlp.up_proj.weight"),
    (lambda t, c: t.update({"fc.weight": t["fc.weight"][:, :3]}), "fc.weight"),
    (lambda t, c: t.update(d2t=t["d2t"] + 10**6), "d2t"),
    (lambda t, c: t.update(d2t=-torch.arange(len(t["d2t"]))), "twice"),  # every draft id -> target id 0
    (lambda t, c: "broken json", "config.json"),
])
def test_bad_heads_are_one_line(random_target, tmp_path, change, needle):
    from safetensors.torch import save_file
    model = generation.load_model(random_target)
    tensors, cfg, _ = write_eagle3_head(tmp_path / "h", model, 64)
    broken_json = change(tensors, cfg) == "broken json"
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "h" / "model.safetensors"))
    (tmp_path / "h" / "config.json").write_text("{" if broken_json else json.dumps(cfg))
    with pytest.raises(UserError, match=needle):
        load_head(tmp_path / "h", model)


def test_cli_flags(random_target, head_dir, tmp_path):
    cli = load_cli()
    stats = tmp_path / "stats.json"
    cli.main(["--checkpoint_path", str(random_target), "--draft_head", str(head_dir), "--prompt", "def f(",
              "--max_new_tokens", "12", "--num_samples", "1", "--temperature", "0", "--speculate_k", "3",
              "--stats_json", str(stats)])
    written = json.loads(stats.read_text())
    assert written["speculative"] == "head" and written["speculate_k"] == 3
    for extra, needle in ((["--draft_head", str(tmp_path)], "--draft_head"),
                          (["--draft_head", str(head_dir), "--draft_ngram", "3"], "--draft_ngram"),
                          (["--draft_head", str(head_dir), "--draft_checkpoint_path", str(random_target)],
                           "--draft_checkpoint_path")):
        with pytest.raises(UserError, match=needle):
            cli.main(["--checkpoint_path", str(random_target), "--prompt", "x", "--max_new_tokens", "3",
                      "--num_samples", "1", *extra])


# ----------------------------------------------------------------------------- sampling stays lossless

VOCAB, PROMPT, DRAWS, ROWS = 24, [1, 5, 9, 3, 7], 3000, 500  # the broken variant scores < 1e-100 at this size


def tiny_target():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=16, n_layer=3, n_head=2, n_local_heads=1, intermediate_size=32,
                                  vocab_size=VOCAB, block_size=64)).requires_grad_(False)
    model.output.weight.mul_(3.0)
    return model


def exact(model, sampling):
    """p(x1) and p(x1, x2) after PROMPT, by enumeration."""
    seqs = torch.cat([torch.tensor(PROMPT).expand(VOCAB, -1), torch.arange(VOCAB).view(-1, 1)], 1)
    model.setup_caches(VOCAB, seqs.shape[1])
    logits = model(seqs, torch.arange(seqs.shape[1]).expand_as(seqs))
    p1 = logits_to_probs(logits[0, -2], sampling).double()
    p2 = logits_to_probs(logits[:, -1], sampling).double()
    return p1, p1[:, None] * p2


def head_draws(model, head, sampling, draws=DRAWS, tree_nodes=None):
    speculator = speculate.Speculator(HeadDrafter(head, 2, tree_nodes))
    engine = Engine(model, features=head.args.target_layers)
    got = []
    torch.manual_seed(0)
    for _ in range(draws // ROWS):
        rows, _ = generation.generate(engine, [PROMPT] * ROWS, 3, sampling, [], False, speculator=speculator)
        got += [r[:2] for r in rows]
    return torch.tensor(got)


def pvalues(model, head, sampling, draws=DRAWS, tree_nodes=None):
    p1, joint = exact(model, sampling)
    got = head_draws(model, head, sampling, draws, tree_nodes)
    return {"first": chi_square_pvalue(torch.bincount(got[:, 0], minlength=VOCAB), p1),
            "pair": chi_square_pvalue(torch.bincount(got[:, 0] * VOCAB + got[:, 1], minlength=VOCAB ** 2),
                                      joint.flatten())}


@pytest.mark.parametrize("sampling,tree_nodes", [
    (Sampling(1.0), None), pytest.param(Sampling(0.7, top_k=6, top_p=0.9), 6, marks=pytest.mark.slow)],
    ids=["T1-chain", "T0.7-topk-topp-tree"])
def test_sampling_is_lossless(sampling, tree_nodes):
    model = tiny_target()
    head = random_head(model, 16, seed=3, scale=0.5)  # a draft vocabulary without a third of the target's tokens
    values = pvalues(model, head, sampling, tree_nodes=tree_nodes)
    assert min(values.values()) > REJECT_BELOW, values


def test_chi_square_rejects_a_head_whose_proposal_is_misreported(monkeypatch):
    """The same check on a broken drafter: it draws from q but reports q sharpened, so the rejection rule divides
    by the wrong probabilities."""
    real = drafthead.draft_distribution

    def misreported(logits, ids, vocab_size, sampling):
        token, q = real(logits, ids, vocab_size, sampling)
        if q is not None:
            q = q.pow(3)
            q = q / q.sum(-1, keepdim=True)
        return token, q
    monkeypatch.setattr(drafthead, "draft_distribution", misreported)
    model = tiny_target()
    values = pvalues(model, random_head(model, 16, seed=3, scale=0.5), Sampling(1.0))
    assert min(values.values()) < REJECT_BELOW, values


# ----------------------------------------------------------------------------- training

def test_prose_passages_put_the_users_text_first_and_stop_near_the_budget(tmp_path):
    import random
    import train_draft_head
    mine = "\n\n".join(f"Paragraph {i} of my own text, long enough to count. " * 8 for i in range(40))
    passages = train_draft_head.prose_passages([mine], 30_000, random.Random(0))
    assert passages[0][0] == "this text" and passages[0][1].startswith("Paragraph 0")
    total = sum(len(text) for _, text in passages)
    assert 30_000 <= total <= 33_000 and len({title for title, _ in passages}) > 1  # the user's, then the stdlib's
    assert all(300 <= len(text) <= 3000 for _, text in passages)


def test_chat_requests_are_varied_unseen_and_reproducible():
    """The prompts the head is distilled on: as many different requests as asked, every kind of request among them,
    the same for a seed, and none about the topics of the benchmark's held-out questions."""
    import random
    import bench_speculative
    import chat_requests
    import train_draft_head
    questions = chat_requests.chat_questions(2000, random.Random(3))
    assert len(questions) == len(set(questions)) == 2000
    assert questions == chat_requests.chat_questions(2000, random.Random(3))
    assert questions != chat_requests.chat_questions(2000, random.Random(4))
    for templates, values, _ in chat_requests.CHAT:  # every kind of request comes up
        stems = [t.split("{")[0] for t in templates]
        assert any(q.startswith(stem) for q in questions for stem in stems), templates
    held_out = ["season", "refrigerator", "climate", "weather", "email", "law", "paint"]
    assert all(word in " ".join(bench_speculative.HELD_OUT).lower() for word in held_out)
    assert not [q for q in questions if any(word in q.lower() for word in held_out)]
    mix = train_draft_head.make_prompts(100, [], 0, 0.75)
    assert len(mix) == 100 and sum(q in set(chat_requests.chat_questions(75, random.Random(0))) for q in mix) == 75


def test_an_epochs_batches_hold_every_conversation_once_and_pad_little():
    """Training batches: each conversation once per epoch, in batches of similar lengths (a padded position costs a
    head forward as a real one does), a different order each epoch, the same for a seed (resuming continues it)."""
    import random
    import train_draft_head
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(20, 60), rng.randint(150, 400)]) for _ in range(1000)]
    train_set = list(range(3, 1000))
    batches = train_draft_head.epoch_batches(train_set, lengths, 8, seed=1)
    assert sorted(i for b in batches for i in b) == train_set and all(1 <= len(b) <= 8 for b in batches)
    assert batches == train_draft_head.epoch_batches(train_set, lengths, 8, seed=1)
    assert batches != train_draft_head.epoch_batches(train_set, lengths, 8, seed=2)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)
    shuffled = train_set[:]
    random.Random(1).shuffle(shuffled)
    assert padded(batches) < 0.8 * padded([shuffled[i:i + 8] for i in range(0, len(shuffled), 8)])
    long_first = [max(lengths[i] for i in b) for b in batches[:20]]
    assert long_first != sorted(long_first, reverse=True)  # the batches themselves come in random order


def test_a_head_started_from_a_block_is_that_block_before_training(random_target):
    """--init block: with its embedding half silent, the untrained head computes the target's block at the highest
    feature layer on the hidden states it is given (same mask, same positions)."""
    import train_draft_head
    target = generation.load_model(random_target)
    head = random_head(target, 300, scale=0.02)
    train_draft_head.start_from_block(head, target)
    dim, top = target.args.dim, head.args.target_layers[-1]
    with torch.no_grad():
        head.attention.wqkv.weight[:, :dim] = 0
        T = 9
        target.setup_caches(1, 16)
        head.setup_caches(1, 16)
        hidden = torch.randn(1, T, dim)
        pos = torch.arange(T).view(1, T)
        mask = (torch.arange(16).view(1, 1, 1, -1) <= pos.view(1, 1, T, 1))
        ours = head(hidden, torch.randint(0, 512, (1, T)), pos, mask=mask)
        block = target.layers[top](hidden, target.rope_table[pos], mask, pos)
    torch.testing.assert_close(ours, block, rtol=1e-4, atol=1e-4)
    features = torch.randn(2, 3, len(head.args.target_layers) * dim)
    passed = head.fuse(features) - features[..., -dim:]  # the top layer's features pass through, plus the noise
    assert passed.abs().max() < 1.0 and passed.abs().mean() < 0.2


def test_a_head_trains_on_the_float_file_and_drafts_for_its_quantized_ones(random_target, head_dir, tmp_path):
    """A quantized --checkpoint_path is one line before any work (its layers hold no float weights to start from);
    the float file's head drafts for the int8 file with the int8 file's greedy output."""
    import shutil
    import quantize
    import train_draft_head
    target = tmp_path / "target" / "model.pth"
    shutil.copytree(random_target.parent, target.parent)
    int8 = quantize.quantize_checkpoint(target, "int8")
    with pytest.raises(UserError, match="quantized file: train the head on the float checkpoint"):
        train_draft_head.main(["--checkpoint_path", str(int8), "--out", str(tmp_path / "head")])
    assert not (tmp_path / "head" / "work").exists()
    plain = generation.Generator.build(int8)
    drafted = generation.Generator.build(int8, draft_head=head_dir, speculation=generation.Speculation(3, None))
    prompts = [plain.encode(text) for text in PROMPTS]
    assert drafted.generate(prompts, 24, Sampling(0))[0] == plain.generate(prompts, 24, Sampling(0))[0]


@pytest.mark.slow  # trains a head
def test_training_ends_with_its_time_budget(random_target, tmp_path):
    """--max_minutes ends training (and its learning-rate schedule) however many epochs were asked for."""
    import train_draft_head
    budget = 0.04  # minutes
    stats = train_draft_head.main(["--checkpoint_path", str(random_target), "--out", str(tmp_path),
                                   "--prompts", "8", "--max_new_tokens", "6", "--batch_size", "8", "--epochs", "1e6",
                                   "--train_batch", "2", "--draft_vocab", "64", "--max_minutes", str(budget)])
    assert budget * 60 <= stats["train_seconds"] < budget * 60 + 20, stats
    assert 1 <= stats["steps"] and stats["epochs"] < 1e5, stats


@pytest.mark.slow
def test_training_makes_a_better_drafter(trained_pair, tmp_path):
    """scripts/train_draft_head.py on the tiny trained target, in seconds: the loss falls, the trained head drafts
    more accepted tokens than an untrained one, output stays identical; a second run resumes from its work files."""
    import train_draft_head
    target = trained_pair / "target" / "model.pth"
    argv = ["--checkpoint_path", str(target), "--out", str(tmp_path / "head"), "--prompts", "48",
            "--max_new_tokens", "40", "--batch_size", "8", "--epochs", "8", "--train_batch", "4",
            "--draft_vocab", "256", "--lr", "3e-3", "--text_chars", "20000"]
    stats = train_draft_head.main(argv)
    assert stats["loss_last_tenth"] < 0.7 * stats["loss_first_tenth"], stats
    assert stats["text_forced_tokens"] > 2000 and stats["answer_tokens"] > 0, stats
    again = train_draft_head.main(argv)  # everything kept: nothing distilled or trained again
    assert again["steps"] == stats["steps"] and again["distill_seconds"] < 5
    plain = generation.Generator.build(target)
    trained = generation.Generator.build(target, draft_head=tmp_path / "head")
    untrained_dir = tmp_path / "untrained"
    save_head(random_head(plain.model, 256, seed=5, scale=0.02), untrained_dir)
    untrained = generation.Generator.build(target, draft_head=untrained_dir)
    prompts = [plain.encode(text) for text in ("def parse_args(", "import sys\n", "class Config:\n    ")]
    expected = plain.generate(prompts, 40, Sampling(0))[0]
    rows, good = trained.generate(prompts, 40, Sampling(0))
    assert rows == expected
    rows, bad = untrained.generate(prompts, 40, Sampling(0))
    assert rows == expected
    assert good["tokens_per_target_forward"] > bad["tokens_per_target_forward"] + 0.3, (good, bad)


def test_target_features_with_onednn_packed_weights_equal_those_without(random_target, tmp_path):
    """Where oneDNN's packed products time faster (kernels.onednn_is_faster, decided by timing on the machine),
    load_target packs the target's linears; its features were then taken from a deep copy, which cannot copy a packed
    tensor (a crash on such machines, or on a busy moment of any)."""
    import train_draft_head
    target = generation.load_model(random_target)
    data = {"prompt_ids": [[1, 5, 9], [1, 7]], "answers": [[11, 12, 13, 14], [20, 21]]}
    layers = HeadArgs.for_target(target, 1).target_layers
    plain = train_draft_head.features(target, layers, data, tmp_path / "plain.pt", 4)
    linears = [m for m in target.modules() if hasattr(m, "pack") and m.weight is not None]
    for m in linears:
        m.pack()
    packed = train_draft_head.features(target, layers, data, tmp_path / "packed.pt", 4)
    assert all(m.packed is not None for m in linears)  # the target keeps its packed copies
    for key in ("tokens", "features", "top_ids", "top_probs"):
        for a, b in zip(plain[key], packed[key]):
            assert torch.equal(a, b), key
