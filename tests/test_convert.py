"""scripts/convert_hf_checkpoint.py against transformers' own LlamaForCausalLM: same logits, same greedy ids.

Every case builds a tiny random Llama with transformers, saves it the way the hub stores checkpoints,
converts it, and runs our model.Transformer on the result. Nothing is downloaded.
"""
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

import model as model_module
from errors import UserError
from model import ModelArgs, Transformer
import convert_hf_checkpoint as convert
from helpers import cli

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 48  # past original_max_position_embeddings=32 below, so rope scaling changes the logits
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

CASES = {
    # name: (config overrides, how the weights are saved)
    "gqa": (dict(num_attention_heads=4, num_key_value_heads=2), "safetensors"),
    "mqa-sharded": (dict(num_attention_heads=4, num_key_value_heads=1), "sharded"),
    "llama3-tied": (dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                         rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True), "safetensors"),
    "linear-bin": (dict(num_attention_heads=4, num_key_value_heads=4,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}), "bin"),
    "head_dim-odd-ffn": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, intermediate_size=97,
                              rope_theta=1e6), "safetensors"),
    "mha-tied-wide": (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6,
                           tie_word_embeddings=True), "sharded"),
}


def hf_config(**overrides):
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def make_hf_model(config, seed=0):
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so swapping the two norms cannot go unnoticed
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.generation_config.eos_token_id = None  # greedy comparisons run the full length
    hf.generation_config.pad_token_id = 0
    return hf


def save_hf(hf, directory, how):
    """Save as the hub does: one safetensors file, small safetensors shards + index, or .bin shards + index."""
    directory.mkdir(parents=True, exist_ok=True)
    if how == "safetensors":
        hf.save_pretrained(directory)
    elif how == "sharded":
        hf.save_pretrained(directory, max_shard_size="60KB")
        assert (directory / "model.safetensors.index.json").is_file()
    elif how == "bin":  # transformers 5 only writes safetensors: write the legacy format by hand
        hf.config.save_pretrained(directory)
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        names = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                  "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
        for file, keys in shards.items():
            torch.save({k: state[k] for k in keys}, directory / file)
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        raise ValueError(how)
    return directory


def load_ours(directory, max_seq_length=PROMPT_LEN + 16):
    args = ModelArgs.from_checkpoint_dir(directory)
    ours = Transformer(args)
    ours.load_state_dict(torch.load(directory / "model.pth", weights_only=True, mmap=True))
    ours.setup_caches(1, max_seq_length)
    return ours.eval()


def assert_logits_close(ours, ref):
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale + 1e-5, f"max |ours - transformers| = {err:.3g} at logit scale {scale:.3g}"


def prompt_ids(vocab=256, n=PROMPT_LEN, seed=1):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case name, transformers model, converted dir) for each case, converted once per module."""
    overrides, how = CASES[request.param]
    hf = make_hf_model(hf_config(**overrides))
    directory = save_hf(hf, tmp_path_factory.mktemp(request.param), how)
    convert.main(["--checkpoint_dir", str(directory)])
    return request.param, hf, directory


def test_logits_match_transformers(converted):
    name, hf, directory = converted
    ours = load_ours(directory)
    ids = prompt_ids()
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, torch.arange(ids.shape[1]).unsqueeze(0))
    assert_logits_close(got, ref)

    if ours.args.rope_scaling:  # the prompt is long enough that dropping the scaling would be caught
        unscaled = Transformer(ModelArgs(**{**vars(ours.args), "rope_scaling": None}))
        unscaled.load_state_dict(ours.state_dict())
        unscaled.setup_caches(1, ids.shape[1])
        with torch.no_grad():
            wrong = unscaled(ids, torch.arange(ids.shape[1]).unsqueeze(0))
        assert (wrong - ref).abs().max() > 100 * (1e-4 * ref.abs().max() + 1e-5)


def test_greedy_ids_match_transformers_generate(converted):
    """Prefill, then one token at a time through the KV cache, against hf.generate(do_sample=False)."""
    name, hf, directory = converted
    n_new = 12
    ours = load_ours(directory)
    ids = prompt_ids(n=20, seed=2)
    with torch.no_grad():
        expected = hf.generate(ids, do_sample=False, max_new_tokens=n_new)[0, ids.shape[1]:].tolist()
        logits = ours(ids, torch.arange(ids.shape[1]).unsqueeze(0))
        got = [int(logits[0, -1].argmax())]
        for pos in range(ids.shape[1], ids.shape[1] + n_new - 1):
            logits = ours(torch.tensor([[got[-1]]]), torch.tensor([[pos]]))
            got.append(int(logits[0, -1].argmax()))
    assert got == expected


def test_converted_dtype_and_keys(converted):
    name, hf, directory = converted
    sd = torch.load(directory / "model.pth", weights_only=True, mmap=True)
    assert set(sd) == set(Transformer(ModelArgs.from_checkpoint_dir(directory)).state_dict())
    assert "output.weight" in sd  # written for tied models too
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def write_word_tokenizer(directory, vocab_size):
    """A tokenizer.json of `vocab_size` word tokens: generate.py needs a tokenizer beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def test_generate_main_greedy_matches_transformers(tmp_path):
    """The user path: convert, then generate.py --temperature 0, token for token against transformers."""
    overrides, how = CASES["llama3-tied"]
    hf = make_hf_model(hf_config(**overrides), seed=3)
    directory = save_hf(hf, tmp_path / "ckpt", how)
    convert.main(["--checkpoint_dir", str(directory)])
    write_word_tokenizer(directory, hf.config.vocab_size)
    n_new = 10
    stats = cli.main(["--checkpoint_path", str(directory / "model.pth"), "--prompt", "40",
                      "--max_new_tokens", str(n_new), "--temperature", "0", "--num_samples", "1",
                      "--ignore_eos", "--device", "cpu", "--precision", "fp32",
                      "--stats_json", str(tmp_path / "stats.json")])
    ids = torch.tensor([stats["prompt_tokens"]])
    assert ids.shape[1] == 40  # this tokenizer.json adds no BOS, so neither does generate.py
    with torch.no_grad():
        expected = hf.generate(ids, do_sample=False, max_new_tokens=n_new)[0, ids.shape[1]:].tolist()
    assert stats["samples"][0]["tokens"] == expected
    assert json.loads((tmp_path / "stats.json").read_text())["samples"][0]["tokens"] == expected


# ----------------------------------------------------------------------------- the mapping itself

@pytest.mark.parametrize("name", ["gqa", "mqa-sharded", "head_dim-odd-ffn", "llama3-tied"])
def test_ours_to_hf_inverts_hf_to_ours_exactly(name):
    overrides, _ = CASES[name]
    hf = make_hf_model(hf_config(**overrides))
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    state = dict(hf.state_dict())
    if args.tie_word_embeddings:
        state.pop("lm_head.weight")  # as save_pretrained stores a tied model
    back = convert.ours_to_hf(convert.hf_to_ours(state, args), args)
    assert set(back) == set(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k


def test_qk_permutation_turns_rotate_half_into_interleaved_pairs():
    """Row j*head_dim/2 + i of a Hugging Face head (rotated with row i + head_dim/2) lands at row 2i + j."""
    n_heads, head_dim, dim = 2, 8, 3
    w = torch.arange(n_heads * head_dim).repeat_interleave(dim).view(-1, dim)
    rows = model_module.halves_to_pairs(w, n_heads, head_dim)[:, 0].tolist()
    assert rows == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(model_module.pairs_to_halves(model_module.halves_to_pairs(w, n_heads, head_dim), n_heads, head_dim), w)


def test_bf16_stays_bf16_unless_dtype_given(tmp_path):
    hf = make_hf_model(hf_config()).to(torch.bfloat16)
    directory = save_hf(hf, tmp_path / "bf16", "safetensors")
    convert.main(["--checkpoint_dir", str(directory)])
    sd = torch.load(directory / "model.pth", weights_only=True)
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}
    convert.main(["--checkpoint_dir", str(directory), "--dtype", "fp32"])
    sd = torch.load(directory / "model.pth", weights_only=True)
    assert {v.dtype for v in sd.values()} == {torch.float32}


def test_export_hf_round_trip_runs_in_transformers(tmp_path):
    """export_hf writes a dir transformers loads back to the same logits (benchmarks rely on it)."""
    overrides, _ = CASES["llama3-tied"]
    hf = make_hf_model(hf_config(**overrides))
    src = save_hf(hf, tmp_path / "src", "safetensors")
    convert.main(["--checkpoint_dir", str(src)])
    write_word_tokenizer(src, hf.config.vocab_size)
    out = convert.export_hf(src, tmp_path / "exported")
    assert (out / "tokenizer.json").is_file()
    again = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = prompt_ids()
    with torch.no_grad():
        assert_logits_close(again(ids).logits, hf(ids).logits)


def test_no_config_uses_known_config_table_and_writes_config(tmp_path, monkeypatch):
    monkeypatch.setitem(model_module.KNOWN_CONFIGS, "Tiny-Test-Llama",
                        dict(n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=160,
                             vocab_size=256, block_size=128))
    hf = make_hf_model(hf_config())
    directory = save_hf(hf, tmp_path / "tiny-test-llama-chat", "safetensors")
    (directory / "config.json").unlink()
    convert.main(["--checkpoint_dir", str(directory)])
    assert json.loads((directory / "config.json").read_text())["num_key_value_heads"] == 2
    ids = prompt_ids()
    with torch.no_grad():
        assert_logits_close(load_ours(directory)(ids, torch.arange(ids.shape[1]).unsqueeze(0)), hf(ids).logits)


def test_consolidated_copy_of_the_weights_is_ignored(tmp_path):
    """Mistral repos ship consolidated.safetensors (their own key names) beside the HF shards."""
    from safetensors.torch import save_file
    hf = make_hf_model(hf_config())
    directory = save_hf(hf, tmp_path / "m", "safetensors")
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, directory / "consolidated.safetensors")
    convert.main(["--checkpoint_dir", str(directory)])
    ids = prompt_ids()
    with torch.no_grad():
        assert_logits_close(load_ours(directory)(ids, torch.arange(ids.shape[1]).unsqueeze(0)), hf(ids).logits)


# ----------------------------------------------------------------------------- failures

def test_conversion_is_atomic(tmp_path, monkeypatch):
    """A crash mid-write leaves neither a partial model.pth nor temp files, and keeps an old model.pth."""
    directory = save_hf(make_hf_model(hf_config()), tmp_path / "m", "safetensors")
    (directory / "model.pth").write_bytes(b"previous")
    before = sorted(os.listdir(directory))

    def crash(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        convert.main(["--checkpoint_dir", str(directory)])
    assert sorted(os.listdir(directory)) == before
    assert (directory / "model.pth").read_bytes() == b"previous"

    (directory / "model.pth").unlink()
    with pytest.raises(OSError):
        convert.main(["--checkpoint_dir", str(directory)])
    assert not (directory / "model.pth").exists()
    assert sorted(os.listdir(directory)) == sorted(set(before) - {"model.pth"})


def test_empty_dir_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no weights found.*download.py"):
        convert.main(["--checkpoint_dir", str(tmp_path)])


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="does not exist.*download.py"):
        convert.main(["--checkpoint_dir", str(tmp_path / "nope")])


def test_missing_keys_are_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file
    directory = save_hf(make_hf_model(hf_config()), tmp_path / "m", "safetensors")
    state = load_file(directory / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, directory / "model.safetensors")
    with pytest.raises(UserError, match="missing 1 weight.*model.layers.1.mlp.up_proj.weight"):
        convert.main(["--checkpoint_dir", str(directory)])
    assert not (directory / "model.pth").exists()


def test_unknown_name_without_config_is_a_clear_error(tmp_path):
    directory = save_hf(make_hf_model(hf_config()), tmp_path / "mystery-model", "safetensors")
    (directory / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json.*unknown model"):
        convert.main(["--checkpoint_dir", str(directory)])


# ----------------------------------------------------------------------------- download.py errors

@pytest.mark.parametrize("error, message", [
    ("gated", "gated: accept the license on https://huggingface.co/org/name and set HF_TOKEN"),
    ("forbidden", "denied \\(HTTP 401\\): accept the license.*HF_TOKEN.*huggingface-cli login"),
    ("missing", "not found on the Hugging Face hub"),
    ("offline", "hub is unreachable.*convert_hf_checkpoint.py"),
])
def test_download_errors_are_one_clear_line(tmp_path, monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import errors
    from scripts import download

    def http_error(cls, status):  # without a live HTTP response object, which these constructors read
        e = cls.__new__(cls)
        Exception.__init__(e, f"{status} Client Error")
        e.response = SimpleNamespace(status_code=status, headers={})
        return e

    def fail(*args, **kwargs):
        if error == "gated":
            raise http_error(errors.GatedRepoError, 403)
        if error == "forbidden":
            raise http_error(errors.HfHubHTTPError, 401)
        if error == "missing":
            raise http_error(errors.RepositoryNotFoundError, 404)
        raise errors.LocalEntryNotFoundError("Got: ConnectError: Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(UserError, match=message) as info:
        download.main(["--repo_id", "org/name", "--checkpoint_dir", str(tmp_path)])
    assert "\n" not in str(info.value)


def test_download_asks_for_config_tokenizer_and_safetensors_only(tmp_path, monkeypatch):
    import huggingface_hub
    from scripts import download
    seen = {}

    def fake(repo_id, local_dir, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        (local_dir / "model.safetensors").parent.mkdir(parents=True)
        (local_dir / "model.safetensors").write_bytes(b"")
        return str(local_dir)

    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert download.main(["--repo_id", "org/name", "--checkpoint_dir", str(tmp_path)]) == tmp_path / "org" / "name"
    assert seen["token"] == "hf_from_env"
    assert {"config.json", "tokenizer.model", "tokenizer.json", "*.safetensors"} <= set(seen["allow_patterns"])
    assert not any(p.endswith(".bin") or p.endswith(".pth") for p in seen["allow_patterns"])


@pytest.mark.parametrize("change, expect", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "mistral", "sliding_window": 4, "max_position_embeddings": 256}, "slides over 4 tokens"),
], ids=["gemma", "gelu", "sliding_window"])
def test_configs_of_models_this_llama_does_not_compute_are_refused(change, expect):
    """These converted and loaded into Llama's shapes, and gave wrong logits."""
    config = dict(ModelArgs(dim=64, n_layer=2, n_head=4, vocab_size=512, block_size=256).to_hf_config(), **change)
    with pytest.raises(UserError, match=re.escape(expect)):
        ModelArgs.from_hf_config(config)


@pytest.mark.parametrize("change", [
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "mistral", "sliding_window": 256, "max_position_embeddings": 256},  # the window holds it all
    {"model_type": "mistral", "sliding_window": 4, "use_sliding_window": False},
    {"hidden_act": "silu"},
])
def test_llama_family_configs_still_load(change):
    config = dict(ModelArgs(dim=64, n_layer=2, n_head=4, vocab_size=512, block_size=256).to_hf_config(), **change)
    assert ModelArgs.from_hf_config(config).dim == 64
