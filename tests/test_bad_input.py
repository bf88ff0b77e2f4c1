"""Bad input to every CLI, run as a subprocess: a clear one-line error, never a traceback, never a hang, and
nothing written or changed.

Each row of the table names a CLI, the files it gets (a copy of a tiny checkpoint, broken on purpose by the
row's setup) and its flags. Every row asserts: a non-zero exit (1 for the project's `error: ...` line, 2 for an
argparse usage error), no "Traceback" on stderr, the message naming the offending file or flag, no new file
(not even a hidden `.NAME.partial-*` temp file) in the checkpoint or output directories, the existing files
byte for byte as they were, and the run finished within a time bound. The rows run concurrently (the machine
is small and each run is mostly interpreter and torch start-up); torchrun rows launch 2 ranks each.

Rows marked here(...) check another file or flag on a path the subprocess rows already take to its one line:
they call the CLI's main() in this process (the same UserError, the same file checks), since a new interpreter
costs ~3 CPU seconds of torch import. Without a GPU, on 2 cores, the module takes about 100 s.
"""
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

import errors
import model
from bench_serve import free_port
from helpers import ROOT, cli, copy_checkpoint, write_chatml_tokenizer, write_checkpoint

TIME_BOUND = 60  # seconds a failing run may take (a few on an idle machine); torchrun rows get TORCHRUN_BOUND
TORCHRUN_BOUND = 120
HANG = 180  # a run still going after this is killed and reported as a hang
WORKERS = 3
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "FASTGEN_DIST_TIMEOUT")


# ----------------------------------------------------------------------------- the workspace of one row

@dataclasses.dataclass
class Workspace:
    """root/ckpt: a copy of the tiny checkpoint (config.json, tokenizer.model, model.pth); root/out: an output
    directory holding one earlier result (previous.json). Rows that need them get root/draft (a draft
    checkpoint), root/hf (a Hugging Face export of the checkpoint), root/m.gguf (a tiny GGUF)."""
    root: Path
    bases: dict

    def __post_init__(self):
        self.ckpt, self.out, self.draft, self.hf, self.gguf = (self.root / name for name in
                                                               ("ckpt", "out", "draft", "hf", "m.gguf"))

    def names(self):
        return {"ckpt": self.ckpt, "out": self.out, "draft": self.draft, "hf": self.hf, "gguf": self.gguf,
                "w": self.root}

    def config(self, **changes):
        """Rewrite ckpt/config.json with keys changed (None deletes a key)."""
        path = self.ckpt / "config.json"
        cfg = json.loads(path.read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        path.write_text(json.dumps(cfg))

    def hf_config(self, **changes):
        path = self.hf / "config.json"
        cfg = json.loads(path.read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        path.write_text(json.dumps(cfg))

    def state(self, change):
        """Rewrite ckpt/model.pth as change(state dict) (a state dict, or anything torch.save takes)."""
        path = self.ckpt / "model.pth"
        torch.save(change(torch.load(path, weights_only=True)), path)


def copy_dir(source: Path, target: Path):
    shutil.copytree(source, target)


def truncate(path: Path, fraction=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


def random_bytes(path: Path, n=4096, seed=0):
    path.write_bytes(random.Random(seed).randbytes(n))


def snapshot(*directories) -> dict:
    """{path: sha256 or "dir"} of everything under the directories, hidden files included."""
    files = {}
    for directory in directories:
        if not directory.exists():
            continue
        for path in sorted(directory.rglob("*")):
            files[str(path)] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return files


# ----------------------------------------------------------------------------- the table

GENERATE = ["generate.py", "--checkpoint_path", "{ckpt}/model.pth", "--prompt", "def main(", "--max_new_tokens", "2",
            "--num_samples", "1", "--device", "cpu", "--stats_json", "{out}/stats.json"]
QUANTIZE = ["quantize.py", "--checkpoint_path", "{ckpt}/model.pth"]
CONVERT_HF = ["scripts/convert_hf_checkpoint.py", "--checkpoint_dir", "{hf}"]
CONVERT_GGUF = ["scripts/convert_gguf_checkpoint.py", "--gguf", "{gguf}", "--out_dir", "{out}/converted"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@dataclasses.dataclass
class Case:
    id: str
    argv: list  # after `python`; "{ckpt}"-style names are filled from the workspace
    expect: list  # substrings of the error line (formatted like argv)
    setup: Optional[Callable] = None  # setup(workspace) breaks something
    env: dict = dataclasses.field(default_factory=dict)
    status: int = 1  # 1: "error: ..." (one line); 2: argparse usage error; 0: a clean exit; -1: torchrun, any != 0
    needs: tuple = ("ckpt",)  # which base copies the workspace gets
    skip: Optional[str] = None
    popen: dict = dataclasses.field(default_factory=dict)  # extra subprocess.run arguments
    bound: int = TIME_BOUND
    inprocess: bool = False  # run by calling the CLI's main() here: the same checks, without a new interpreter

    def __repr__(self):
        return self.id


def gen(id, *extra, expect, setup=None, env=None, status=1, needs=("ckpt",), stats=True, **kw):
    argv = GENERATE + list(extra) if stats else GENERATE[:-2] + list(extra)
    return Case(id, argv, expect, setup, env or {}, status, needs, **kw)


def quant(id, *extra, expect, setup=None, status=1, **kw):
    return Case(id, QUANTIZE + list(extra or ["--mode", "int8"]), expect, setup, {}, status, ("ckpt",), **kw)


def hf(id, *extra, expect, setup=None, status=1, **kw):
    return Case(id, CONVERT_HF + list(extra), expect, setup, {}, status, ("hf",), **kw)


def gguf(id, *extra, expect, setup=None, status=1, **kw):
    return Case(id, CONVERT_GGUF + list(extra), expect, setup, {}, status, ("gguf",), **kw)


def torchrun(id, *extra, expect, setup=None, needs=("ckpt",), script=GENERATE, **kw):
    argv = TORCHRUN + script + list(extra)
    return Case(id, argv, expect, setup, {}, -1, needs, bound=TORCHRUN_BOUND, **kw)


def here(case: Case) -> Case:
    """A row whose error path the subprocess rows already show end as one line: its check runs in this process
    (an interpreter with torch takes ~3 CPU seconds to start, and the machine has 2 cores)."""
    return dataclasses.replace(case, inprocess=True)


def small_vocab(w):  # a model of 256 tokens beside the 512-token tokenizer
    shutil.rmtree(w.ckpt)
    copy_dir(w.bases["small_vocab"], w.ckpt)


def heads_of_three(w):
    shutil.rmtree(w.ckpt)
    copy_dir(w.bases["three_heads"], w.ckpt)


def nan_weights(w):
    w.state(lambda sd: {k: torch.full_like(v, float("nan")) if k == "output.weight" else v for k, v in sd.items()})


def odd_head_width(w):  # weights that fit the config, heads 15 wide: RoPE turns pairs of dimensions
    write_checkpoint(w.ckpt, w.ckpt / "tokenizer.model", dim=60, n_layer=1, n_head=4, head_dim=15, vocab_size=512,
                     block_size=64)


def quantized_file(w):  # model.pth replaced by an int8 file as quantize.py writes it
    (w.ckpt / "model.pth").write_bytes(w.bases["int8"].read_bytes())


def other_tokenizer_draft(w):
    """The draft gets a byte-level BPE tokenizer.json (preferred to its tokenizer.model), and keeps its config."""
    config = (w.draft / "config.json").read_bytes()
    write_chatml_tokenizer(w.draft)
    (w.draft / "config.json").write_bytes(config)


def not_utf8(path):
    path.write_bytes(b'{"hidden_size": \xff\xfe}')


def index_naming_absent_shard(w):
    (w.hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))


def bin_instead_of_safetensors(w):
    (w.hf / "model.safetensors").unlink()
    random_bytes(w.hf / "pytorch_model.bin")


def readonly(path):
    path.mkdir(exist_ok=True)
    path.chmod(0o555)


def injected_rank_failure(w):
    """A worker that runs generate.py's CLI on both ranks, rank 1 failing right after loading while rank 0
    goes on into the first collective, where its peer is gone."""
    (w.root / "worker.py").write_text(
        f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nimport errors, generate, generation\n"
        "if os.environ['RANK'] == '1':\n"
        "    load = generation.load_model\n"
        "    def failing(*args, **kwargs):\n"
        "        load(*args, **kwargs)\n"
        "        raise errors.UserError('rank 1 could not load its shard (injected failure)')\n"
        "    generation.load_model = failing\n"
        "sys.exit(generate.cli(sys.argv[1:]))\n")


ROOT_IS_ROOT = os.geteuid() == 0
CASES = [
    # --- generate.py: the checkpoint file
    gen("pth_truncated", expect=["{ckpt}/model.pth"], setup=lambda w: truncate(w.ckpt / "model.pth")),
    here(gen("pth_empty", expect=["{ckpt}/model.pth"], setup=lambda w: (w.ckpt / "model.pth").write_bytes(b""))),
    here(gen("pth_random_bytes", expect=["{ckpt}/model.pth"], setup=lambda w: random_bytes(w.ckpt / "model.pth"))),
    here(gen("pth_pickle_of_objects", expect=["{ckpt}/model.pth"],
             setup=lambda w: torch.save({"path": Path("x"), "w": torch.zeros(2)}, w.ckpt / "model.pth"))),
    here(gen("pth_list_of_tensors", expect=["{ckpt}/model.pth", "state dict"],
             setup=lambda w: w.state(lambda sd: list(sd.values())))),
    here(gen("pth_integer_weights", expect=["{ckpt}/model.pth"],
             setup=lambda w: w.state(lambda sd: {k: v.long() for k, v in sd.items()}))),
    here(gen("pth_non_tensor_value", expect=["{ckpt}/model.pth"],
             setup=lambda w: w.state(lambda sd: dict(sd, **{"norm.weight": 3})))),
    gen("pth_nan_weights", expect=["{ckpt}/model.pth", "NaN"], setup=nan_weights),
    here(gen("pth_nan_weights_top_p", "--temperature", "0.7", "--top_p", "0.9", expect=["{ckpt}/model.pth", "NaN"],
             setup=nan_weights)),
    here(gen("pth_unknown_quantization", expect=["{ckpt}/model.pth", "int3"],
             setup=lambda w: torch.save({"quantization": {"mode": "int3"}, "model": {}}, w.ckpt / "model.pth"))),
    here(gen("pth_is_a_directory", "--checkpoint_path", "{ckpt}", expect=["{ckpt}", "model.pth"])),
    here(gen("pth_missing", expect=["{ckpt}/model.pth"], setup=lambda w: (w.ckpt / "model.pth").unlink())),
    # --- generate.py: config.json
    gen("config_hidden_size_disagrees", expect=["{ckpt}/config.json"], setup=lambda w: w.config(hidden_size=128)),
    here(gen("config_layers_disagree", expect=["{ckpt}/config.json"], setup=lambda w: w.config(num_hidden_layers=3))),
    here(gen("config_vocab_disagrees", expect=["{ckpt}/config.json"], setup=lambda w: w.config(vocab_size=1024))),
    gen("config_zero_size", expect=["{ckpt}/config.json", "hidden_size"], setup=lambda w: w.config(hidden_size=0)),
    here(gen("config_negative_heads", expect=["{ckpt}/config.json", "num_attention_heads"],
             setup=lambda w: w.config(num_attention_heads=-4))),
    gen("config_missing_key", expect=["{ckpt}/config.json", "intermediate_size"],
        setup=lambda w: w.config(intermediate_size=None)),
    here(gen("config_string_for_number", expect=["{ckpt}/config.json", "hidden_size"],
             setup=lambda w: w.config(hidden_size="64"))),
    gen("config_100M_layers", expect=["{ckpt}/config.json", "num_hidden_layers"],
        setup=lambda w: w.config(num_hidden_layers=100_000_000), bound=20),
    here(gen("config_kv_heads_do_not_divide", expect=["{ckpt}/config.json", "num_key_value_heads"],
             setup=lambda w: w.config(num_key_value_heads=3))),
    gen("config_invalid_json", expect=["{ckpt}/config.json"],
        setup=lambda w: (w.ckpt / "config.json").write_text("{\"hidden_size\": 64,")),
    here(gen("config_not_an_object", expect=["{ckpt}/config.json"],
             setup=lambda w: (w.ckpt / "config.json").write_text("[64, 2]"))),
    here(gen("config_not_utf8", expect=["{ckpt}/config.json"], setup=lambda w: not_utf8(w.ckpt / "config.json"))),
    here(gen("config_rope_theta_text", expect=["{ckpt}/config.json", "rope_theta"],
             setup=lambda w: w.config(rope_theta="fast"))),
    here(gen("config_rms_norm_eps_text", expect=["{ckpt}/config.json", "rms_norm_eps"],
             setup=lambda w: w.config(rms_norm_eps="tiny"))),
    here(gen("config_eos_text", expect=["{ckpt}/config.json", "eos_token_id"],
             setup=lambda w: w.config(eos_token_id="</s>"))),
    here(gen("config_rope_scaling_unknown", expect=["{ckpt}/config.json", "rope_scaling"],
             setup=lambda w: w.config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))),
    here(gen("config_rope_scaling_incomplete", expect=["{ckpt}/config.json", "rope_scaling"],
             setup=lambda w: w.config(rope_scaling={"rope_type": "llama3", "factor": 8.0}))),
    here(gen("config_rope_type_a_list", expect=["{ckpt}/config.json", "rope_scaling"],
             setup=lambda w: w.config(rope_scaling={"rope_type": ["llama3"], "factor": 8.0}))),
    here(gen("config_tie_word_embeddings_text", expect=["{ckpt}/config.json", "tie_word_embeddings"],
             setup=lambda w: w.config(tie_word_embeddings="false"))),
    here(gen("config_eos_beyond_any_vocabulary", expect=["{ckpt}/config.json", "eos_token_id"],
             setup=lambda w: w.config(eos_token_id=10**30))),
    here(gen("config_odd_head_width", expect=["{ckpt}/config.json", "head_dim"], setup=odd_head_width)),
    # --- generate.py: the tokenizer
    gen("tokenizer_model_corrupt", expect=["{ckpt}/tokenizer.model"],
        setup=lambda w: random_bytes(w.ckpt / "tokenizer.model")),
    gen("tokenizer_json_corrupt", expect=["{ckpt}/tokenizer.json"],
        setup=lambda w: (w.ckpt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [')),
    here(gen("tokenizer_config_invalid", expect=["{ckpt}/tokenizer_config.json"],
             setup=lambda w: (w.ckpt / "tokenizer_config.json").write_text("{bos_token: <s>}"))),
    gen("tokenizer_larger_than_model", expect=["{ckpt}", "tokenizer", "256"], setup=small_vocab),
    gen("tokenizer_missing", expect=["{ckpt}", "tokenizer"], setup=lambda w: (w.ckpt / "tokenizer.model").unlink()),
    here(gen("chat_template_broken", "--chat", expect=["{ckpt}/tokenizer_config.json", "chat template"],
             setup=lambda w: (w.ckpt / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}'))),
    here(gen("chat_template_a_number", "--chat", expect=["{ckpt}/tokenizer_config.json", "chat_template"],
             setup=lambda w: (w.ckpt / "tokenizer_config.json").write_text('{"chat_template": 5}'))),
    # --- generate.py: flags
    gen("prompt_99999999999_tokens", "--prompt", "99999999999", expect=["--prompt"]),
    here(gen("prompt_longer_than_context", "--prompt", "300", expect=["--max_new_tokens", "256"])),
    here(gen("prompt_file_without_a_name", "--prompt", "@", expect=["--prompt @FILE"])),
    # a device that never ends is refused after a bound, not read until memory runs out
    here(gen("prompts_file_endless", "--prompt", "@/dev/zero", expect=["--prompts_file", "/dev/zero", "more than"])),
    here(gen("json_schema_endless", "--json_schema", "/dev/zero", expect=["--json_schema", "/dev/zero", "more than"])),
    here(Case("chat_conversation_in_a_batch", ["generate.py", "--checkpoint_path", "{ckpt}/model.pth", "--chat",
                                               "--batch_size", "2", "--max_new_tokens", "2"], ["--batch_size"])),
    gen("prompt_not_utf8", "--prompt", os.fsdecode(b"caf\xe9 \xff"), expect=["--prompt"]),
    gen("seed_1e23", "--seed", "1e23", expect=["--seed"], status=2),
    here(gen("seed_negative", "--seed", "-1", expect=["--seed"])),
    gen("temperature_nan", "--temperature", "nan", expect=["--temperature"]),
    here(gen("temperature_inf", "--temperature", "inf", expect=["--temperature"])),
    here(gen("temperature_negative", "--temperature", "-1", expect=["--temperature"])),
    here(gen("top_p_nan", "--top_p", "nan", expect=["--top_p"])),
    gen("top_p_1.5", "--top_p", "1.5", expect=["--top_p"]),
    here(gen("top_k_0", "--top_k", "0", expect=["--top_k"])),
    gen("max_new_tokens_0", "--max_new_tokens", "0", expect=["--max_new_tokens"]),
    here(gen("max_new_tokens_beyond_context", "--max_new_tokens", "1000000", expect=["--max_new_tokens"])),
    here(gen("batch_size_0", "--batch_size", "0", expect=["--batch_size"])),
    gen("device_tpu", "--device", "tpu", expect=["--device"]),
    here(gen("device_cuda_without_cuda", "--device", "cuda", expect=["--device"],
             skip="this machine has CUDA" if torch.cuda.is_available() else None)),
    here(gen("precision_unknown", "--precision", "int3", expect=["--precision"], status=2)),
    here(gen("compile_unknown_mode", "--compile", "fastest", expect=["--compile", "fastest"], status=2)),
    gen("speculate_k_1000", "--draft_checkpoint_path", "{draft}/model.pth", "--speculate_k", "1000",
        expect=["--speculate_k", "256"], needs=("ckpt", "draft"), bound=30),
    here(gen("speculate_k_text", "--draft_ngram", "3", "--speculate_k", "many", expect=["--speculate_k"])),
    gen("tree_nodes_100000", "--draft_checkpoint_path", "{draft}/model.pth", "--tree_nodes", "100000",
        expect=["--tree_nodes"], needs=("ckpt", "draft"), bound=30),
    here(gen("tree_nodes_without_draft", "--tree_nodes", "8", expect=["--tree_nodes"])),
    gen("draft_ngram_1", "--draft_ngram", "1", expect=["--draft_ngram"]),
    here(gen("draft_ngram_100", "--draft_ngram", "100", expect=["--draft_ngram"])),
    here(gen("draft_missing", "--draft_checkpoint_path", "{w}/no_draft/model.pth", expect=["{w}/no_draft/model.pth"])),
    gen("draft_other_tokenizer_tree", "--draft_checkpoint_path", "{draft}/model.pth", "--tree_nodes", "8",
        expect=["another tokenizer", "--tree_nodes"], needs=("ckpt", "draft"), setup=other_tokenizer_draft),
    here(gen("draft_other_tokenizer_batch", "--draft_checkpoint_path", "{draft}/model.pth", "--batch_size", "2",
             expect=["another tokenizer", "--batch_size"], needs=("ckpt", "draft"), setup=other_tokenizer_draft)),
    # --- generate.py: output files
    gen("stats_json_is_the_checkpoint", "--stats_json", "{ckpt}/model.pth",
        expect=["--stats_json", "{ckpt}/model.pth"]),
    here(gen("stats_json_is_a_directory", "--stats_json", "{out}", expect=["--stats_json", "{out}"])),
    gen("stats_json_under_a_file", "--stats_json", "{out}/file.txt/x.json", expect=["--stats_json", "file.txt"],
        setup=lambda w: (w.out / "file.txt").write_text("notes\n")),
    here(gen("stats_json_dir_missing", "--stats_json", "{out}/missing/x.json",
             expect=["--stats_json", "{out}/missing"])),
    here(gen("profile_is_the_stats_json", "--profile", "{out}/stats.json", expect=["--profile", "--stats_json"])),
    gen("stats_json_in_sys", "--stats_json", "/sys/x.json", expect=["--stats_json", "/sys"]),
    here(gen("stats_json_in_proc", "--stats_json", "/proc/x.json", expect=["--stats_json", "/proc"])),
    gen("stats_json_read_only_dir", "--stats_json", "{out}/ro/x.json", expect=["--stats_json", "{out}/ro"],
        setup=lambda w: readonly(w.out / "ro"), skip="root writes to read-only directories" if ROOT_IS_ROOT else None),
    here(gen("profile_is_a_directory", "--profile", "{out}", expect=["--profile", "{out}"])),
    here(gen("profile_is_the_checkpoint", "--profile", "{ckpt}/model.pth", expect=["--profile", "{ckpt}/model.pth"])),
    # --- generate.py: the environment
    gen("world_size_abc", expect=["WORLD_SIZE"], env={"WORLD_SIZE": "abc"}),
    here(gen("world_size_0", expect=["WORLD_SIZE"], env={"WORLD_SIZE": "0"})),
    here(gen("world_size_2_without_rank", expect=["RANK"], env={"WORLD_SIZE": "2"})),
    gen("world_size_2_no_peer", expect=["FASTGEN_DIST_TIMEOUT"], bound=40,
        env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}",
             "FASTGEN_DIST_TIMEOUT": "3"}),
    here(gen("dist_timeout_abc", expect=["FASTGEN_DIST_TIMEOUT"],
             env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}",
                  "FASTGEN_DIST_TIMEOUT": "abc"})),
    # --interactive with nothing to read: a clean end (status 0), as at the end of any input
    here(gen("interactive_stdin_empty", "--interactive", expect=[], status=0, stats=False,
             popen={"stdin": subprocess.DEVNULL})),
    gen("interactive_stdin_closed", "--interactive", expect=[], status=0, stats=False, popen={"close_stdin": True}),

    # --- quantize.py
    here(quant("quantize_missing_file", expect=["{ckpt}/model.pth"], setup=lambda w: (w.ckpt / "model.pth").unlink())),
    quant("quantize_truncated", expect=["{ckpt}/model.pth"], setup=lambda w: truncate(w.ckpt / "model.pth")),
    here(quant("quantize_empty", expect=["{ckpt}/model.pth"], setup=lambda w: (w.ckpt / "model.pth").write_bytes(b""))),
    here(quant("quantize_list_of_tensors", expect=["{ckpt}/model.pth"],
               setup=lambda w: w.state(lambda sd: list(sd.values())))),
    here(quant("quantize_hidden_size_disagrees", expect=["{ckpt}/config.json"],
               setup=lambda w: w.config(hidden_size=128))),
    here(quant("quantize_fewer_layers", expect=["{ckpt}/config.json"], setup=lambda w: w.config(num_hidden_layers=1))),
    here(quant("quantize_more_layers", expect=["{ckpt}/config.json"], setup=lambda w: w.config(num_hidden_layers=3))),
    here(quant("quantize_config_invalid_json", expect=["{ckpt}/config.json"],
               setup=lambda w: (w.ckpt / "config.json").write_text("{"))),
    quant("quantize_already_quantized", expect=["{ckpt}/model.pth", "already quantized"], setup=quantized_file),
    here(quant("quantize_nan_weights", expect=["{ckpt}/model.pth", "output.weight"], setup=nan_weights)),
    quant("quantize_groupsize_does_not_divide", "--mode", "int4", "--groupsize", "128", expect=["--groupsize"]),
    here(quant("quantize_groupsize_unsupported", "--mode", "int4", "--groupsize", "100", expect=["--groupsize"],
               status=2)),
    here(quant("quantize_groupsize_with_int8", "--mode", "int8", "--groupsize", "32", expect=["--groupsize"])),
    here(quant("quantize_output_is_a_directory", expect=["{ckpt}/model_int8.pth", "not a file"],
               setup=lambda w: (w.ckpt / "model_int8.pth").mkdir())),
    quant("quantize_keeps_previous_output", expect=["{ckpt}/config.json"],  # an earlier model_int8.pth survives
          setup=lambda w: (w.config(hidden_size=128), (w.ckpt / "model_int8.pth").write_bytes(b"earlier result"))),

    # --- scripts/convert_hf_checkpoint.py
    hf("convert_empty_dir", expect=["{hf}", "no weights"], setup=lambda w: [p.unlink() for p in w.hf.iterdir()]),
    here(hf("convert_missing_dir", "--checkpoint_dir", "{w}/absent", expect=["{w}/absent"])),
    here(hf("convert_config_missing_key", expect=["{hf}/config.json", "hidden_size"],
            setup=lambda w: w.hf_config(hidden_size=None))),
    hf("convert_config_disagrees", expect=["{hf}"], setup=lambda w: w.hf_config(hidden_size=128)),
    here(hf("convert_config_fewer_layers", expect=["{hf}"], setup=lambda w: w.hf_config(num_hidden_layers=1))),
    hf("convert_safetensors_truncated", expect=["{hf}/model.safetensors"],
       setup=lambda w: (truncate(w.hf / "model.safetensors"), (w.hf / "model.pth").write_bytes(b"earlier"))),
    here(hf("convert_safetensors_random", expect=["{hf}/model.safetensors"],
            setup=lambda w: random_bytes(w.hf / "model.safetensors"))),
    here(hf("convert_index_invalid_json", expect=["{hf}/model.safetensors.index.json"],
            setup=lambda w: (w.hf / "model.safetensors.index.json").write_text("{"))),
    here(hf("convert_index_names_absent_shard", expect=["{hf}/model.safetensors.index.json"],
            setup=index_naming_absent_shard)),
    here(hf("convert_bin_corrupt", expect=["{hf}/pytorch_model.bin"], setup=bin_instead_of_safetensors)),
    here(hf("convert_dtype_unknown", "--dtype", "fp8", expect=["--dtype"], status=2)),

    # --- scripts/convert_gguf_checkpoint.py
    here(gguf("gguf_missing_file", expect=["{gguf}"], setup=lambda w: w.gguf.unlink())),
    gguf("gguf_text_file", expect=["{gguf}"], setup=lambda w: w.gguf.write_text("not a model\n")),
    here(gguf("gguf_random_bytes", expect=["{gguf}"], setup=lambda w: random_bytes(w.gguf))),
    here(gguf("gguf_empty", expect=["{gguf}"], setup=lambda w: w.gguf.write_bytes(b""))),
    gguf("gguf_truncated", expect=["{gguf}"], setup=lambda w: truncate(w.gguf)),
    here(gguf("gguf_header_only", expect=["{gguf}"], setup=lambda w: truncate(w.gguf, 0.02))),
    here(gguf("gguf_out_dir_is_a_file", "--out_dir", "{out}/file.txt", expect=["--out_dir", "{out}/file.txt"],
              setup=lambda w: (w.out / "file.txt").write_text("notes\n"))),

    # --- torchrun, 2 ranks
    torchrun("torchrun_heads_do_not_divide", expect=["tensor parallelism over 2 ranks", "n_kv_heads=3"],
             setup=heads_of_three),
    torchrun("torchrun_one_rank_fails", expect=["injected failure"], setup=injected_rank_failure,
             script=["{w}/worker.py"] + GENERATE[1:]),
]


def fill(text: str, w: Workspace, port: int) -> str:
    return text.format(port=port, **w.names())


# ----------------------------------------------------------------------------- running the table

@pytest.fixture(scope="module")
def bases(tmp_path_factory, random_target, tokenizer_model):
    """The tiny checkpoints the rows copy, each built once."""
    root = tmp_path_factory.mktemp("bases")
    out = {"ckpt": root / "ckpt"}
    out["ckpt"].mkdir()
    for name in ("config.json", "tokenizer.model", "model.pth"):
        shutil.copy(random_target.parent / name, out["ckpt"])
    out["draft"] = copy_checkpoint(random_target, root / "draft", noise=0.3, seed=1).parent
    out["small_vocab"] = write_checkpoint(root / "small_vocab", tokenizer_model, dim=64, n_layer=1, n_head=4,
                                          vocab_size=256, block_size=256).parent
    out["three_heads"] = write_checkpoint(root / "three_heads", tokenizer_model, dim=48, n_layer=1, n_head=6,
                                          n_local_heads=3, intermediate_size=96, vocab_size=512, block_size=64).parent
    import quantize
    out["int8"] = root / "model_int8.pth"
    args = model.ModelArgs.from_checkpoint_dir(random_target.parent)
    quantized = quantize.quantize_state_dict(torch.load(random_target, weights_only=True), args, {"mode": "int8"})
    torch.save({"quantization": {"mode": "int8"}, "model": quantized}, out["int8"])
    from convert_hf_checkpoint import export_hf
    out["hf"] = export_hf(random_target.parent, root / "hf")
    from test_gguf import train_bpe, write_gguf
    out["gguf"] = write_gguf(root / "m.gguf", train_bpe())
    return out


def make_workspace(case: Case, root: Path, bases: dict) -> Workspace:
    w = Workspace(root, bases)
    root.mkdir(parents=True)
    w.out.mkdir()
    (w.out / "previous.json").write_text('{"earlier": "result"}\n')
    for name in case.needs:
        if name == "gguf":
            shutil.copy(bases["gguf"], w.gguf)
        else:
            copy_dir(bases[name], getattr(w, name))
    if case.setup:
        case.setup(w)
    return w


def run_case(case: Case, w: Workspace) -> dict:
    port = free_port()
    argv = [sys.executable] + [fill(a, w, port) for a in case.argv]
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: fill(v, w, port) for k, v in case.env.items()})
    popen = dict(case.popen)
    if popen.pop("close_stdin", False):
        popen["preexec_fn"] = lambda: os.close(0)
    popen.setdefault("stdin", subprocess.DEVNULL)
    before = snapshot(w.root)
    t0 = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=HANG, **popen)
        status, stdout, stderr = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as e:
        status, stdout, stderr = "hang", e.stdout or b"", e.stderr or b""
    seconds = time.monotonic() - t0
    return {"status": status, "stdout": stdout.decode(errors="replace"), "stderr": stderr.decode(errors="replace"),
            "seconds": seconds, "before": before, "after": snapshot(w.root),
            "expect": [fill(e, w, port) for e in case.expect]}


@pytest.fixture(scope="module")
def results(request, bases, tmp_path_factory):
    """Every selected subprocess row, run WORKERS at a time: {case id: what happened}."""
    module = sys.modules[__name__]
    wanted = {item.callspec.params["case"].id for item in request.session.items
              if item.module is module and hasattr(item, "callspec") and "case" in item.callspec.params}
    cases = [c for c in CASES if c.id in wanted and not c.skip and not c.inprocess]
    root = tmp_path_factory.mktemp("rows")
    # directories named by number: a case's name in its paths could satisfy the expected words by itself
    workspaces = {c.id: make_workspace(c, root / f"r{i:03d}", bases) for i, c in enumerate(cases)}
    cases.sort(key=lambda c: c.status != -1)  # the torchrun rows first: the longest, 3 processes each
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {c.id: pool.submit(run_case, c, workspaces[c.id]) for c in cases}
        out = {name: future.result() for name, future in futures.items()}
    for w in workspaces.values():  # read-only directories, for the clean-up of tmp_path
        for path in w.root.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
    return out


def assert_untouched(before: dict, after: dict, report: str):
    new = sorted(set(after) - set(before))
    gone = sorted(set(before) - set(after))
    changed = sorted(p for p in before if p in after and before[p] != after[p])
    assert not new and not gone and not changed, f"new {new}, removed {gone}, changed {changed}\n{report}"


SUBPROCESS = [c for c in CASES if not c.inprocess]
IN_PROCESS = [c for c in CASES if c.inprocess]
MAINS = {"generate.py": "generate", "quantize.py": "quantize",
         "scripts/convert_hf_checkpoint.py": "convert_hf_checkpoint",
         "scripts/convert_gguf_checkpoint.py": "convert_gguf_checkpoint"}


def test_table_is_big_enough():
    assert len(SUBPROCESS) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert {"generate.py", "quantize.py", "scripts/convert_hf_checkpoint.py",
            "scripts/convert_gguf_checkpoint.py", "-m"} <= {c.argv[0] for c in SUBPROCESS}


@pytest.mark.slow
@pytest.mark.parametrize("case", SUBPROCESS, ids=[c.id for c in SUBPROCESS])
def test_bad_input(case, results):
    if case.skip:
        pytest.skip(case.skip)
    r = results[case.id]
    stderr, expect = r["stderr"], r["expect"]
    report = (f"status {r['status']} after {r['seconds']:.1f} s\n--- stdout\n{r['stdout'][-2000:]}\n"
              f"--- stderr\n{stderr[-4000:]}")
    assert r["status"] != "hang", report
    assert r["seconds"] < case.bound, report
    if case.status == -1:  # torchrun: both ranks end, the launcher reports the failure
        assert r["status"] != 0, report
        # the failing rank's line (from both ranks when both fail); a rank whose peer went away mid-collective
        # says so (torchrun may also stop a rank before it prints anything)
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert 1 <= len(errors) <= 2 and any(all(e in line for e in expect) for line in errors), report
        assert all(all(e in line for e in expect) or "lost the other ranks" in line for line in errors), report
        # torchrun's own ChildFailedError report may carry a traceback; our ranks' code never does (torch prefixes a
        # rank's uncaught traceback with "[rankN]:"; a rank stopped inside a collective may also print torch's own
        # "[rankN]:[W...] unwaited collective" shutdown warning, which is not ours)
        assert not re.search(r"^\[rank\d+\]:\s*(Traceback|File \")", stderr, re.M), report
        assert "UserError" not in stderr and 'generate.py", line' not in stderr, report
    else:
        assert r["status"] == case.status, report
        assert "Traceback" not in stderr, report
        lines = stderr.strip().splitlines()
        if case.status == 1:
            assert len(lines) == 1 and lines[0].startswith("error: "), report
            assert all(e in lines[0] for e in expect), report
        elif case.status == 2:  # argparse: usage, then one error line
            assert "usage:" in stderr and lines[-1].count("error:") == 1, report
            assert all(e in lines[-1] for e in expect), report
        else:
            assert stderr.strip() == "", report
    assert_untouched(r["before"], r["after"], report)


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.id for c in IN_PROCESS])
def test_bad_input_in_process(case, bases, tmp_path_factory, monkeypatch, capsys):
    """The rows whose check raises (UserError, or argparse's SystemExit) as the subprocess rows' do; each
    CLI's __main__ turns that into its one line, as the subprocess rows show."""
    if case.skip:
        pytest.skip(case.skip)
    import importlib
    import io
    w = make_workspace(case, tmp_path_factory.mktemp("w") / "w", bases)  # no case name in the paths
    port = free_port()
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, fill(value, w, port))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # --interactive: the end of the input at once
    main = cli.main if case.argv[0] == "generate.py" else importlib.import_module(MAINS[case.argv[0]]).main
    argv = [fill(a, w, port) for a in case.argv[1:]]
    expect = [fill(e, w, port) for e in case.expect]
    before = snapshot(w.root)
    t0 = time.monotonic()
    if case.status == 1:
        with pytest.raises(errors.UserError) as caught:
            main(argv)
        message = str(caught.value)
        assert "\n" not in message and all(e in message for e in expect), message
    elif case.status == 2:
        with pytest.raises(SystemExit) as caught:
            main(argv)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert caught.value.code == 2 and all(e in last for e in expect), last
    else:
        main(argv)
    assert time.monotonic() - t0 < case.bound
    assert_untouched(before, snapshot(w.root), case.id)


# ----------------------------------------------------------------------------- temp files on interruption

def test_interrupted_write_leaves_no_temp_file(tmp_path):
    target = tmp_path / "model.pth"
    target.write_bytes(b"before")

    def write(tmp):
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        errors.write_atomically(target, write)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth"]
    assert target.read_bytes() == b"before"


def test_stale_temp_file_of_a_dead_process_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited: nothing runs under its id (unless reused, unlikely)
    stale = tmp_path / f".stats.json.partial-{pid}-abc123"
    stale.write_bytes(b"left by a killed run")
    alive = tmp_path / f".stats.json.partial-{os.getpid()}-def456"  # a write in progress: kept
    alive.write_bytes(b"being written")
    errors.write_atomically(tmp_path / "stats.json", lambda tmp: tmp.write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "stats.json"]
