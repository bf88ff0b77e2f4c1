"""Decode on a GPU at the Llama-3.2-1B and Llama-3.1-8B shapes: ours (`generate.py --compile`, the whole graph
with CUDA graph replay) at bf16 / int8 / int4 g32 against transformers (static cache, which its generate() compiles
with torch.compile) on the same random weights, as bench_scale.py makes them (its shapes, seed and SmolLM2's
tokenizer; no llama.cpp here).

    python scripts/bench_gpu.py --runs 1b:bf16,8b:bf16,1b:int8,1b:int4 --json out.json

Runs one after another in the order of --runs, all under one deadline (--seconds): a run that would start after it
is skipped with one line, so a short lease still gets the first rows (--prepare SHAPES makes the checkpoints alone,
to run beside the timed runs of another shape). Ours: greedy, --new_tokens
after bench_scale's prompt, --repeats samples after one warm-up (which compiles), tokens/s the best sample's;
transformers: the same prompt ids and token count, best of --repeats after one warm-up. The tokens column says how
far the two greedy answers agree (bf16 on both sides: they part at near-ties). --loader_check first runs the tiny
shape twice with `--compile auto` and says whether the second process loaded the stored graph the first built
(compile_mode "stored") or torch's AOTInductor loader failed there and it compiled in the process.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from errors import UserError, interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import bench_scale  # noqa: E402
import benchlib  # noqa: E402
from bench_scale import PROMPT, failure, run_measured, say  # noqa: E402

PRECISIONS = ("bf16", "int8", "int4")


def checkpoint(shape: str, work_dir: Path, seed: int) -> Path:
    """bench_scale's transformers checkpoint of `shape` (made as it makes it) and our bf16 conversion beside it."""
    hf = work_dir / shape / "hf"
    if not (hf / "config.json").is_file():
        bench_scale.make_hf_checkpoint(shape, str(hf), str(work_dir / "tokenizer"), seed)
    ours = hf / "model.pth"
    if not ours.is_file():
        result = run_measured([sys.executable, ROOT / "scripts/convert_hf_checkpoint.py", "--checkpoint_dir", hf,
                               "--dtype", "bf16"], work_dir / shape / "convert.log")
        if result["returncode"]:
            raise UserError(f"converting {hf}: {failure(result, work_dir / shape / 'convert.log')}")
    return ours


def run_ours(path: Path, args, log: Path, compile_mode: str = "whole") -> dict:
    """One generate.py process: a warm-up sample (which compiles), then --repeats timed ones; the best's tokens/s."""
    stats = log.with_suffix(".json")
    stats.unlink(missing_ok=True)
    result = run_measured([sys.executable, ROOT / "generate.py", "--checkpoint_path", path, "--device", args.device,
                           "--precision", "bf16", "--compile", compile_mode, "--prompt", PROMPT, "--max_new_tokens",
                           args.new_tokens, "--num_samples", args.repeats + 1, "--temperature", 0, "--ignore_eos",
                           "--stats_json", stats], log)
    if result["returncode"]:
        return {"error": failure(result, log)}
    s = json.loads(stats.read_text())
    timed = s["samples"][1:]
    return {"tokens_per_sec": max(x["tokens_per_sec"] for x in timed), "compile_s": s["compile_seconds"],
            "compile_mode": s.get("compile_mode"), "prompt_ids": s["prompt_tokens"], "ids": timed[-1]["tokens"],
            "wall_s": result["seconds"]}


def run_transformers(hf: Path, prompt_ids: list, args) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).to(args.device).eval()
    kwargs = dict(device=args.device, cache_implementation="static")
    started = time.perf_counter()
    benchlib.time_transformers(model, prompt_ids, args.new_tokens, repeats=1, **kwargs)  # compiles
    warm = time.perf_counter() - started
    speed, ids = benchlib.time_transformers(model, prompt_ids, args.new_tokens, repeats=args.repeats, **kwargs)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"tokens_per_sec": speed, "compile_s": warm, "ids": ids}


def agree(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def timed_runs(args, rows: list, deadline: float):
    """Each (shape, precision) of --runs in order; transformers once per shape, after its first run of ours."""
    references = {}
    for shape, precision in args.runs:
        if time.time() > deadline:
            say(f"{shape} {precision}: skipped (past --seconds)")
            continue
        base = checkpoint(shape, args.work_dir, args.seed)
        path = base if precision == "bf16" else benchlib.quantized_checkpoint(base, precision)
        got = run_ours(path, args, args.work_dir / shape / f"ours-{precision}.log")
        say(f"{shape} ours {precision}: {json.dumps({k: v for k, v in got.items() if 'ids' not in k})}")
        row = {"shape": shape, "precision": precision, **{k: v for k, v in got.items() if k != "prompt_ids"}}
        if "error" not in got and shape not in references and time.time() < deadline:
            references[shape] = run_transformers(base.parent, got["prompt_ids"], args)
            say(f"{shape} transformers bf16: {references[shape]['tokens_per_sec']:.1f} tok/s")
            rows.append({"shape": shape, "precision": "transformers bf16", **references[shape]})
        if "error" not in got and shape in references:
            row["x_transformers"] = got["tokens_per_sec"] / references[shape]["tokens_per_sec"]
            row["tokens_agree"] = agree(got["ids"], references[shape]["ids"])
        rows.append(row)


def loader_check(args) -> dict:
    """The tiny shape through `--compile auto` twice: the first process builds a stored graph, the second loads it
    (compile_mode "stored") unless torch's loader failed on this machine (then it compiles in the process)."""
    path = checkpoint("tiny", args.work_dir, args.seed)
    short = argparse.Namespace(**{**vars(args), "new_tokens": 8, "repeats": 1})
    got = [run_ours(path, short, args.work_dir / "tiny" / f"loader-{i}.log", compile_mode="auto") for i in (1, 2)]
    say(f"loader check: {json.dumps([{k: v for k, v in g.items() if 'ids' not in k} for g in got])}")
    return {"first": got[0].get("compile_mode", got[0].get("error")), "second": got[1].get("compile_mode",
                                                                                          got[1].get("error"))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="1b:bf16,8b:bf16,1b:int8,1b:int4,8b:int8,8b:int4",
                   help=f"comma-separated SHAPE:PRECISION in the order to run (precisions: {', '.join(PRECISIONS)})")
    p.add_argument("--prepare", default="", help="comma-separated SHAPE:PRECISION: make these checkpoints, and exit")
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=480, help="no run starts after this many seconds")
    p.add_argument("--loader_check", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu only to try the script itself on the tiny shape")
    p.add_argument("--work_dir", type=Path, default=Path("~/.cache/fastgen/bench_gpu"))
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.work_dir = args.work_dir.expanduser().resolve()
    pairs = {}
    for name in ("runs", "prepare"):
        pairs[name] = [tuple(x.split(":", 1)) if ":" in x else (x, "") for x in getattr(args, name).split(",") if x]
    args.runs, args.prepare = pairs["runs"], pairs["prepare"]
    if bad := [f"{s}:{p}" for s, p in args.runs + args.prepare if s not in bench_scale.SHAPES or p not in PRECISIONS]:
        p.error(f"unknown {', '.join(bad)}: shapes are {', '.join(bench_scale.SHAPES)}, precisions "
                f"{', '.join(PRECISIONS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    benchlib.check_counts(args, "new_tokens", "repeats")
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("no CUDA device: this benchmark measures decode on a GPU")
    deadline = time.time() + args.seconds
    args.work_dir.mkdir(parents=True, exist_ok=True)
    bench_scale.tokenizer_files(args.work_dir)
    if args.prepare:
        for shape, precision in args.prepare:
            path = checkpoint(shape, args.work_dir, args.seed)
            if precision != "bf16":
                benchlib.quantized_checkpoint(path, precision)
        return
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    out = {"device": device, "torch": torch.__version__, "rows": []}
    if args.loader_check:
        out["loader"] = loader_check(args)
    timed_runs(args, out["rows"], deadline)
    if args.json:
        benchlib.write_json(args.json, out)
    benchlib.print_table(out["rows"], ["shape", "precision", "tokens_per_sec", "x_transformers", "tokens_agree",
                                       "compile_s", "error"])


if __name__ == "__main__":
    run_cli(main)
