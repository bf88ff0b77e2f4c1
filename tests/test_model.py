"""model.py: the KV cache, per-row positions and tree masks give the logits of a plain full forward;
ModelArgs resolves configs by name and from Hugging Face config.json."""
import copy

import pytest
import torch

from errors import UserError
from model import KNOWN_CONFIGS, ModelArgs, Transformer, rope_inverse_frequencies

SHAPES = {
    "gqa": dict(dim=64, n_head=4, n_local_heads=2),
    "mqa": dict(dim=64, n_head=4, n_local_heads=1),
    "head_dim": dict(dim=64, n_head=4, n_local_heads=2, head_dim=24, intermediate_size=97),
    "tied-llama3": dict(dim=48, n_head=3, tie_word_embeddings=True, rope_base=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}
MAX_SEQ = 48


def tiny_model(seed=0, **shape):
    torch.manual_seed(seed)
    args = ModelArgs(**{"n_layer": 2, "vocab_size": 128, "block_size": 64, "intermediate_size": 96, **shape})
    model = Transformer(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def tokens(n, batch=1, seed=0):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def full_forward(model, ids):
    """Logits of one uncached pass over ids [B, T] from position 0."""
    model.setup_caches(ids.shape[0], MAX_SEQ)
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1))


def assert_close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5 * b.abs().max().item() + 1e-6, rtol=0)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_incremental_decode_equals_full_forward(shape):
    model = tiny_model(**SHAPES[shape])
    ids = tokens(30)
    expected = full_forward(model, ids)
    fresh = tiny_model(**SHAPES[shape])
    fresh.setup_caches(1, MAX_SEQ)
    chunks, start = [11, 1, 1, 3, 1, 5, 1, 7], 0  # prefill, then single tokens and multi-token steps
    got = []
    with torch.no_grad():
        for n in chunks:
            got.append(fresh(ids[:, start:start + n], torch.arange(start, start + n).unsqueeze(0)))
            start += n
    assert start == ids.shape[1]
    assert_close(torch.cat(got, dim=1), expected)


def test_batched_rows_at_different_positions_equal_separate_runs():
    """Rows padded to one prefill length, then each row decodes from its own position: the padding
    past a row's position is hidden by the mask and overwritten, as in batched generation."""
    model = tiny_model(**SHAPES["gqa"])
    lengths, n_steps = [5, 12, 8], 6
    seqs = [tokens(length + n_steps, seed=i)[0] for i, length in enumerate(lengths)]
    batch = len(lengths)
    padded = torch.stack([torch.cat([s[:length], torch.full((max(lengths) - length,), 7)])
                          for s, length in zip(seqs, lengths)])
    model.setup_caches(batch, MAX_SEQ)
    step_logits = []
    with torch.no_grad():
        model(padded, torch.arange(max(lengths)).expand(batch, -1))
        for step in range(n_steps):
            pos = torch.tensor(lengths) + step
            x = torch.stack([s[p] for s, p in zip(seqs, pos)]).unsqueeze(1)
            step_logits.append(model(x, pos.unsqueeze(1))[:, 0])
    for b, (seq, length) in enumerate(zip(seqs, lengths)):
        alone = full_forward(tiny_model(**SHAPES["gqa"]), seq.unsqueeze(0))[0, length:length + n_steps]
        assert_close(torch.stack([s[b] for s in step_logits]), alone)


def test_forward_with_fewer_rows_than_the_cache_was_set_up_for():
    """setup_caches(max_batch_size, ...) is a maximum: a smaller batch must still run."""
    model = tiny_model(**SHAPES["gqa"])
    ids = tokens(10)
    expected = full_forward(tiny_model(**SHAPES["gqa"]), ids)
    model.setup_caches(3, MAX_SEQ)
    with torch.no_grad():
        got = model(ids, torch.arange(10).unsqueeze(0))
    assert_close(got, expected)


def test_a_larger_cache_keeps_the_rope_table_it_can_use():
    """setup_caches for more rows or positions keeps the RoPE table object while it covers the positions (a new
    object would make compiled graphs that read it compile again), and builds a longer one past block_size,
    whose logits equal those of a model that built it at once."""
    model = tiny_model(**SHAPES["gqa"])
    model.setup_caches(1, 16)
    table = model.rope_table
    model.setup_caches(3, model.args.block_size)
    assert model.rope_table is table
    ids = tokens(model.args.block_size + 8)
    model.setup_caches(1, ids.shape[1])
    assert model.rope_table is not table and model.rope_table.shape[0] >= ids.shape[1]
    torch.testing.assert_close(model.rope_table[:table.shape[0]], table)
    fresh = tiny_model(**SHAPES["gqa"])
    fresh.setup_caches(1, ids.shape[1])
    with torch.no_grad():
        assert_close(model(ids, torch.arange(ids.shape[1]).unsqueeze(0)),
                     fresh(ids, torch.arange(ids.shape[1]).unsqueeze(0)))


@pytest.mark.parametrize("shape", ["gqa", "tied-llama3"])
def test_tree_mask_gives_each_node_the_logits_of_its_branch(shape):
    """Token-tree verification: nodes at positions prefix + depth, each seeing the prefix and its ancestors."""
    model = tiny_model(**SHAPES[shape])
    prefix = tokens(9)
    P = prefix.shape[1]
    #            node: 0  1  2  3  4  5   (parent -1 is the prefix)
    parents = [-1, -1, 0, 2, 1, 0]
    node_tokens = tokens(len(parents), seed=5)[0]
    depth, branch = [], []
    for i, parent in enumerate(parents):
        depth.append(1 if parent < 0 else depth[parent] + 1)
        branch.append(([] if parent < 0 else branch[parent]) + [i])
    n = len(parents)
    slots = torch.arange(P, P + n).unsqueeze(0)
    positions = (P - 1 + torch.tensor(depth)).unsqueeze(0)
    mask = torch.zeros(1, 1, n, MAX_SEQ, dtype=torch.bool)
    mask[..., :P] = True
    for i in range(n):
        mask[0, 0, i, [P + j for j in branch[i]]] = True
    model.setup_caches(1, MAX_SEQ)
    with torch.no_grad():
        model(prefix, torch.arange(P).unsqueeze(0))
        tree_logits = model(node_tokens.unsqueeze(0), positions, slots=slots, mask=mask)[0]
    for i in range(n):
        ids = torch.cat([prefix[0], node_tokens[branch[i]]]).unsqueeze(0)
        assert_close(tree_logits[i], full_forward(model, ids)[0, -1])


# ----------------------------------------------------------------------------- ModelArgs

# published parameter counts (embedding + output counted separately unless tied)
PARAMS = {"TinyLlama-1.1B": 1_100_048_384, "Llama-2-7b": 6_738_415_616, "Llama-2-13b": 13_015_864_320,
          "Llama-2-70b": 68_976_648_192, "CodeLlama-7b": 6_738_546_688, "CodeLlama-34b": 33_743_970_304,
          "Mistral-7B": 7_241_732_096, "Meta-Llama-3-8B": 8_030_261_248, "Meta-Llama-3-70B": 70_553_706_496,
          "Llama-3.1-8B": 8_030_261_248, "Llama-3.1-70B": 70_553_706_496, "Llama-3.1-405B": 405_853_388_800,
          "Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824}


def parameter_count(a: ModelArgs) -> int:
    q, kv = a.n_head * a.head_dim, a.n_local_heads * a.head_dim
    layer = a.dim * (2 * q + 2 * kv) + 3 * a.dim * a.intermediate_size + 2 * a.dim
    return a.vocab_size * a.dim * (1 if a.tie_word_embeddings else 2) + a.n_layer * layer + a.dim


@pytest.mark.parametrize("name", list(KNOWN_CONFIGS))
def test_from_name_builds_every_table_entry(name):
    args = ModelArgs.from_name(name)
    assert args.dim % args.n_head == 0 and args.n_head % args.n_local_heads == 0
    if name in PARAMS:
        assert parameter_count(args) == PARAMS[name]
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(args)


@pytest.mark.parametrize("repo, key", [
    ("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7b"),
    ("codellama/CodeLlama-7b-Python-hf", "CodeLlama-7b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
    ("meta-llama/meta-llama-3-8b-instruct", "Meta-Llama-3-8B"),
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "TinyLlama-1.1B"),
])
def test_from_name_matches_repo_names(repo, key):
    assert ModelArgs.from_name(repo) == ModelArgs(**KNOWN_CONFIGS[key])


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="unknown model 'gpt-neo-x'.*config.json"):
        ModelArgs.from_name("gpt-neo-x")
    with pytest.raises(UserError, match="config.json"):
        ModelArgs.from_checkpoint_dir(tmp_path / "some-unknown-model")


@pytest.mark.parametrize("name", ["Llama-2-7b", "Mistral-7B", "Llama-3.1-8B", "Llama-3.2-3B"])
def test_hf_config_round_trip(name):
    args = ModelArgs.from_name(name)
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args


@pytest.mark.parametrize("name", ["Llama-2-7b", "Llama-3.1-8B", "Llama-3.2-1B"])
def test_reads_config_json_as_transformers_writes_it(name):
    """transformers >= 5 writes rope_theta and the scaling as one `rope_parameters` dict."""
    transformers = pytest.importorskip("transformers")
    args = ModelArgs.from_name(name)
    written = transformers.LlamaConfig(**copy.deepcopy(args.to_hf_config())).to_dict()
    back = ModelArgs.from_hf_config(written)
    assert back.rope_base == args.rope_base
    assert torch.equal(rope_inverse_frequencies(back), rope_inverse_frequencies(args))
    assert dict(vars(back), rope_scaling=None) == dict(vars(args), rope_scaling=None)


def test_unsupported_rope_type_is_a_clear_error():
    model = tiny_model(dim=32, n_head=2, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UserError, match="rope_scaling type 'yarn' is not supported"):
        model.setup_caches(1, 8)


def test_forward_before_setup_caches_is_a_clear_error():
    with pytest.raises(RuntimeError, match="setup_caches"):
        tiny_model(**SHAPES["gqa"])(tokens(3), torch.arange(3).unsqueeze(0))


def test_tied_embeddings_share_one_tensor():
    model = tiny_model(**SHAPES["tied-llama3"])
    assert model.output.weight is model.tok_embeddings.weight
