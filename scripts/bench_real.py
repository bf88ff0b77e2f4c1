"""A real pretrained model, end to end, in one process run: our decode (fp32, bf16, int8, int4; compiled),
speculative decoding with the model's own int4 copy as the draft and with n-gram lookups, against
transformers' generate() (plain and prompt_lookup_num_tokens) and llama.cpp on the GGUF the model came from
(llama-cpp-python, if installed; same threads), and on a Q8_0 copy of it for the 8-bit column.

    python scripts/bench_real.py                      # SmolLM2-135M-Instruct from scripts/demo.sh
    python scripts/bench_real.py --checkpoint_dir DIR --gguf FILE.gguf --json bench_results/real.json

Configurations take turns run by run (best of --repeats after a warm-up), so a machine slowing down
hurts them alike. Greedy, exactly --new_tokens tokens after each chat-formatted question, or with --stop_at_eos each
answer up to its end of turn (at most --new_tokens; tokens/s: every answer's tokens over the time from prompt to the
answer's end, prefill included, each engine its own answer's length); the first run of
each of our configurations compiles (stored graphs: builds them, or loads them when stored), and its time is
reported as setup seconds (in-process graphs cold: a fresh inductor cache directory unless --warm_cache;
--fresh_graphs removes the stored graphs first, so setup is their build). For configurations with stored graphs,
launch_s is a new process's `generate.py --compile` from launch to exit after one new token (an upper bound on
launch to first token, the stored graphs loaded). x_llama_same_bits: int8 against llama.cpp Q8_0, int4 against
Q4_1 (int8-a8 / int4-a8 likewise), the rest against llama.cpp's fastest.
"""
import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402
import decode  # noqa: E402
import generation  # noqa: E402
import quantize  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

QUESTIONS = ["What is the capital of France? Answer in two sentences.",
             "Write a Python function that returns the n-th Fibonacci number.",
             "Explain what a KV cache is in a transformer, briefly.",
             "List three tips for writing clear emails."]


def ours(model, draft_model=None, k=5, nodes=None, ngram=0, compiled=True, autotune=False, mode="auto", eos=()):
    """A run function for one of our configurations: target and draft compiled in one mode (generate.py's
    --compile: auto, stored graphs; --compile autotune: stored graphs with every matmul timed; or `mode`) or
    eager."""
    mode = ("autotune" if autotune else mode) if compiled else "none"
    engine = decode.compile_engine(model, "cpu", mode, compile_prefill=compiled)
    draft = decode.compile_engine(draft_model, "cpu", mode) if draft_model is not None else None
    speculator = generation.make_speculator(generation.Speculation(k, nodes, ngram), draft, model.args.block_size)
    stats = {"model_bytes": model.model_bytes()}  # weight bytes a decode step reads

    def run(ids, new_tokens):
        if speculator is not None:  # each answer as in a new run: no copying the last answer to the same question
            speculator.forget()
        tokens, s = generation.generate(engine, torch.tensor(ids), new_tokens, decode.Sampling(), list(eos),
                                        stop_at_eos=bool(eos), speculator=speculator)
        stats.update(s)
        return tokens[0]
    return run, stats


def transformers_run(checkpoint_dir: Path, eos=(), **kwargs):
    model = benchlib.hf_model(checkpoint_dir)

    def run(ids, new_tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 **({"eos_token_id": list(eos)} if eos else {"min_new_tokens": new_tokens}), **kwargs)
        return out[0, len(ids):].tolist()
    return run, {}


def llama_cpp_run(gguf: Path, threads: int, eos=()):
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

    def run(ids, new_tokens):
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):  # greedy; stops where we say
            out.append(token)
            if len(out) == new_tokens or token in eos:
                break
        return out
    return run, {}


def launch_seconds(model_pth: Path, draft_pth=None, k=5, ngram=0) -> float:
    """A new process's generate.py --compile from launch to exit, one new token after a chat question."""
    argv = [sys.executable, str(ROOT / "generate.py"), "--checkpoint_path", str(model_pth), "--compile", "--chat",
            "--prompt", QUESTIONS[0], "--max_new_tokens", "1", "--num_samples", "1", "--temperature", "0"]
    if draft_pth is not None:
        argv += ["--draft_checkpoint_path", str(draft_pth), "--speculate_k", str(k)]
    if ngram:
        argv += ["--draft_ngram", str(ngram), "--speculate_k", str(k)]
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_dir", type=Path, default=ROOT / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--gguf", type=Path, default=ROOT / "checkpoints/gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--new_tokens", type=int, default=64, help="tokens per answer (with --stop_at_eos: at most)")
    p.add_argument("--stop_at_eos", action="store_true", help="each answer ends at its end of turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch and llama.cpp threads (default: every core)")
    p.add_argument("--warm_cache", action="store_true", help="keep inductor's cache (default: cold compile)")
    p.add_argument("--no_compile", action="store_true", help="our configurations eager (no compile time)")
    p.add_argument("--fresh_graphs", action="store_true", help="remove the stored graphs first (setup = their build)")
    p.add_argument("--only", default="", help="semicolon-separated configuration names to run (default: all)")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/real.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    benchlib.check_counts(args, "new_tokens", "repeats", "threads")
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    bandwidth = benchlib.measure_bandwidth()  # this run's, as the machine's moves between runs
    print(f"measured: read {bandwidth['read_gbs']:.1f} GB/s, fp32 mat-vec {bandwidth['fp32_matvec_gbs']:.1f} GB/s",
          flush=True)
    torch._dynamo.config.cache_size_limit = 64
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    model_pth = args.checkpoint_dir / "model.pth"
    if not model_pth.is_file():
        sys.exit(f"error: {model_pth} not found: run bash scripts/demo.sh (or convert a checkpoint) first")
    tokenizer = get_tokenizer(args.checkpoint_dir)
    prompts = [tokenizer.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = tuple(tokenizer.eos_ids) if args.stop_at_eos else ()
    configs, launches = configurations(args, model_pth, eos, threads)
    if args.fresh_graphs:
        shutil.rmtree(args.checkpoint_dir / "compiled", ignore_errors=True)
    configs = benchlib.pick(configs, args.only, ";")
    built, outputs, setup_seconds = build_and_warm_up(configs, prompts, args.new_tokens)
    best = time_turns(built, prompts, args.new_tokens, args.repeats)
    rows = result_rows(built, outputs, best, setup_seconds, launches if not args.no_compile else {}, bandwidth)
    add_ratios(rows)
    print()
    benchlib.print_table(rows, ["config", "tokens_per_sec", "tokens", "gbs", "pct_read_bw", "x_ours_fp32",
                                "x_transformers_fp32", "x_llama_cpp", "x_llama_same_bits",
                                "tokens_per_target_forward", "same_as_ours_fp32", "same_as_plain", "setup_seconds",
                                "launch_s"])
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv, "rows": rows,
                                    "bandwidth": bandwidth,
                                    "settings": {k: str(v) for k, v in vars(args).items()}})


def configurations(args, model_pth: Path, eos: tuple, threads: int) -> tuple:
    """name -> a function building (run, stats), built lazily in turn order (ours, transformers', llama.cpp's
    where llama-cpp-python is installed); and name -> generate.py's arguments for the configurations whose
    launch is timed."""
    load = generation.load_model
    compiled = not args.no_compile
    int4_pth = benchlib.quantized_checkpoint(model_pth, "int4", 32)
    int8_pth = benchlib.quantized_checkpoint(model_pth, "int8")
    a8 = {mode: (lambda mode=mode: benchlib.quantized_checkpoint(model_pth, mode, 32)) for mode in ("int8-a8", "int4-a8")}
    launches = {"ours fp32": (model_pth,), "ours int8": (int8_pth,), "ours int4 g32": (int4_pth,),
                "ours fp32, int4 draft chain K=5": (model_pth, int4_pth, 5),
                "ours fp32, 3-gram K=5": (model_pth, None, 5, 3),
                "ours int8, 3-gram K=5": (int8_pth, None, 5, 3),
                "ours int8, 3-gram K=auto": (int8_pth, None, "auto", 3),
                "ours int8-a8": (quantize.output_path(model_pth, {"mode": "int8-a8"}),),
                "ours int4-a8 g32": (quantize.output_path(model_pth, {"mode": "int4-a8", "groupsize": 32}),)}
    ours_ = functools.partial(ours, eos=eos, compiled=compiled)
    configs = {
        "ours fp32": lambda: ours_(load(model_pth)),
        "ours fp32 regional": lambda: ours_(load(model_pth), mode="regional"),
        "ours fp32 whole": lambda: ours_(load(model_pth), mode="whole"),
        "ours bf16": lambda: ours_(load(model_pth, precision=torch.bfloat16)),
        "ours int8": lambda: ours_(load(int8_pth)),
        "ours int4 g32": lambda: ours_(load(int4_pth)),
        "ours fp32, int4 draft chain K=5": lambda: ours_(load(model_pth), load(int4_pth), 5),
        "ours fp32, int8 draft chain K=5": lambda: ours_(load(model_pth), load(int8_pth), 5),
        "ours fp32, int4 draft tree N=12 K=4": lambda: ours_(load(model_pth), load(int4_pth), 4, 12),
        "ours fp32, 3-gram K=5": lambda: ours_(load(model_pth), None, 5, None, 3),
        "ours int8, int4 draft chain K=4": lambda: ours_(load(int8_pth), load(int4_pth), 4),
        "ours int8, 3-gram K=5": lambda: ours_(load(int8_pth), None, 5, None, 3),
        "ours int8, 3-gram K=auto": lambda: ours_(load(int8_pth), None, "auto", None, 3),
        "ours fp32, 3-gram K=auto": lambda: ours_(load(model_pth), None, "auto", None, 3),
        "ours fp32, int4 draft chain K=auto": lambda: ours_(load(model_pth), load(int4_pth), "auto"),
        # 8-bit activations, integer dot products (kernels_a8.cpp)
        "ours int8-a8": lambda: ours_(load(a8["int8-a8"]())),
        "ours int4-a8 g32": lambda: ours_(load(a8["int4-a8"]())),
        "ours fp32, int4-a8 draft chain K=5": lambda: ours_(load(model_pth), load(a8["int4-a8"]()), 5),
        "ours fp32, int8-a8 draft chain K=5": lambda: ours_(load(model_pth), load(a8["int8-a8"]()), 5),
        # --compile autotune: stored graphs, every matmul shape timed against inductor's C++ GEMM templates
        "ours fp32 autotune": lambda: ours_(load(model_pth), autotune=True),
        "ours int8 autotune": lambda: ours_(load(int8_pth), autotune=True),
        "ours int4 g32 autotune": lambda: ours_(load(int4_pth), autotune=True),
        "ours fp32 autotune, int4 draft chain K=5": lambda: ours_(load(model_pth), load(int4_pth), 5, autotune=True),
        "ours fp32 autotune, 3-gram K=5": lambda: ours_(load(model_pth), None, 5, None, 3, autotune=True),
        # the weights on 2 MB pages (kernels.onto_huge_pages, as the server does; same graphs, same bytes)
        "ours fp32 2M pages": on_huge_pages(lambda: ours_(load(model_pth))),
        "ours int8-a8 2M pages": on_huge_pages(lambda: ours_(load(a8["int8-a8"]()))),
        "ours int4-a8 g32 2M pages": on_huge_pages(lambda: ours_(load(a8["int4-a8"]()))),
        "transformers fp32": lambda: transformers_run(args.checkpoint_dir, eos),
        "transformers fp32, prompt lookup": lambda: transformers_run(args.checkpoint_dir, eos, prompt_lookup_num_tokens=5),
    }
    try:
        import llama_cpp  # noqa: F401
        if args.gguf.is_file():
            configs[f"llama.cpp {args.gguf.name.split('.')[-2]}"] = lambda: llama_cpp_run(args.gguf, threads, eos)
            if args.gguf.name.split(".")[-2] != "Q8_0":  # the 8-bit peer of our int8
                configs["llama.cpp Q8_0"] = lambda: llama_cpp_run(benchlib.requantized_q8_0(args.gguf), threads, eos)
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp column", flush=True)
    return configs, launches


def on_huge_pages(build):
    """`build` with FASTGEN_HUGE_PAGES=1 while it runs: its weights go onto 2 MB pages."""
    def built():
        with mock.patch.dict(os.environ, FASTGEN_HUGE_PAGES="1"):
            return build()
    return built


def build_and_warm_up(configs: dict, prompts: list, new_tokens: int) -> tuple:
    """Each configuration built and run once over the prompts (our first run compiles). Returns (name -> (run,
    stats), name -> its greedy answers, name -> seconds to build and run once)."""
    built, outputs, setup_seconds = {}, {}, {}
    for name, build in configs.items():
        t = time.perf_counter()
        built[name] = build()
        outputs[name] = [built[name][0](ids, new_tokens) for ids in prompts]  # greedy: each run's answers
        setup_seconds[name] = time.perf_counter() - t
        print(f"  {name}: ready in {setup_seconds[name]:.1f} s", flush=True)
    return built, outputs, setup_seconds


def time_turns(built: dict, prompts: list, new_tokens: int, repeats: int) -> dict:
    """Best seconds per configuration and prompt, the configurations taking turns run by run."""
    best = {name: [float("inf")] * len(prompts) for name in built}
    for _ in range(repeats):
        for i, ids in enumerate(prompts):
            for name, (run, _) in built.items():
                t = time.perf_counter()
                run(ids, new_tokens)
                best[name][i] = min(best[name][i], time.perf_counter() - t)
    return best


def result_rows(built: dict, outputs: dict, best: dict, setup_seconds: dict, launches: dict, bandwidth: dict) -> list:
    """A row per configuration: tokens/s, bandwidth used, acceptance, same answers as plain fp32 and as its own
    target's plain decode, and (for `launches`) a new process's launch seconds."""
    rows = []
    for name, (run, stats) in built.items():
        tokens = sum(len(answer) for answer in outputs[name])
        tps = tokens / sum(best[name])
        row = {"config": name, "tokens_per_sec": tps, "tokens": tokens, "setup_seconds": setup_seconds[name],
               "per_question": [{"tokens": len(answer), "seconds": t} for answer, t in zip(outputs[name], best[name])]}
        if name in launches:  # after the timed runs: nothing else runs beside it
            row["launch_s"] = launch_seconds(*launches[name])
        if stats.get("accept_counts"):
            row["tokens_per_target_forward"] = stats["tokens_per_target_forward"]
        elif "model_bytes" in stats:  # plain decode: one read of the weights per token
            row["gbs"] = stats["model_bytes"] * tps / 1e9
            row["pct_read_bw"] = 100 * row["gbs"] / bandwidth["read_gbs"]
        if "ours fp32" in outputs:  # greedy ids of every answer, token for token
            row["same_as_ours_fp32"] = outputs[name] == outputs["ours fp32"]
        if "," in name and name.split(",")[0] in outputs:  # speculation: its target's plain greedy ids
            row["same_as_plain"] = outputs[name] == outputs[name.split(",")[0]]
        rows.append(row)
    return rows


def add_ratios(rows: list):
    """Each row's speed against ours fp32, transformers fp32, llama.cpp's fastest and llama.cpp at its own bits."""
    plain = next((r["tokens_per_sec"] for r in rows if r["config"] == "ours fp32"), None)
    reference = next((r["tokens_per_sec"] for r in rows if r["config"] == "transformers fp32"), None)
    peers = {r["config"].split()[1]: r["tokens_per_sec"] for r in rows if r["config"].startswith("llama.cpp")}
    llama = max(peers.values(), default=None)
    for row in rows:
        row["x_ours_fp32"] = row["tokens_per_sec"] / plain if plain else None
        row["x_transformers_fp32"] = row["tokens_per_sec"] / reference if reference else None
        row["x_llama_cpp"] = row["tokens_per_sec"] / llama if llama else None
        same_bits = peers.get("Q8_0" if "int8" in row["config"].split(",")[0] else
                              "Q4_1" if "int4" in row["config"].split(",")[0] else None)
        row["x_llama_same_bits"] = row["tokens_per_sec"] / same_bits if same_bits else row["x_llama_cpp"]


if __name__ == "__main__":
    sys.exit(run_cli(main))
