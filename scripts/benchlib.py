"""What the benchmark scripts share: the machine's measured bandwidth, timing our generation.generate() and
transformers' generate() on the same weights, and writing the table and the JSON."""
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
import generation  # noqa: E402
from errors import UserError, write_atomically  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def check_counts(args, *names, zero_means_default=("threads",)):
    """Counts a benchmark takes as flags, refused before any timing: --repeats 0 ran every build and warm-up, then
    failed in min() of no times (a traceback); --threads -1 failed in torch.set_num_threads. 0 threads means every
    core where the flag's help says so."""
    for name in names:
        value, least = getattr(args, name), 0 if name in zero_means_default else 1
        if value is not None and value < least:
            raise UserError(f"--{name} must be >= {least}, got {value}")


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_bandwidth(device: str = "cpu", gib: float = 1.0) -> dict:
    """Read bandwidth: sum of a 1 GiB fp32 tensor (every byte read once, nothing written), best of 5.
    Also what an fp32 mat-vec of the same size reaches: the kernel decode actually runs."""
    n = int(gib * 2**30) // 4
    x = torch.randn(n, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def read():
        x.sum()
        sync()

    read_gbs = x.numel() * 4 / best_seconds(read, 5) / 1e9
    w = x.view(-1, 8192)
    v = torch.randn(8192, device=device)

    def matvec():
        torch.mv(w, v)
        sync()

    matvec_gbs = w.numel() * 4 / best_seconds(matvec, 5) / 1e9
    return {"read_gbs": read_gbs, "fp32_matvec_gbs": matvec_gbs}


def time_ours(engine, prompt_ids: list, new_tokens: int, sampling, speculator=None, repeats: int = 3,
              device="cpu"):
    """Best-of-`repeats` wall time of generate() (prefill included) after one warm-up run (which compiles).
    Returns (tokens/s, tokens of the last run, stats of the last run)."""
    prompt = torch.tensor(prompt_ids, device=device)
    out = {}

    def run():
        torch.manual_seed(0)
        if speculator is not None:  # no copying the last run's answer to the same prompt
            speculator.forget()
        out["tokens"], out["stats"] = generation.generate(engine, prompt, new_tokens, sampling, eos_ids=[],
                                                          stop_at_eos=False, speculator=speculator)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    seconds = best_seconds(run, repeats)
    return len(out["tokens"][0]) / seconds, out["tokens"][0], out["stats"]


def time_interleaved(engine, speculators: dict, prompts: list, new_tokens: int, sampling, repeats: int = 3,
                     device="cpu") -> dict:
    """time_ours() for several configurations (name -> speculator, None for plain decoding), taking turns
    run by run so that a machine slowing down for a while hurts them alike.
    Returns name -> (tokens/s over all prompts, [(tokens, stats) of the last run, per prompt])."""
    seconds = {name: [float("inf")] * len(prompts) for name in speculators}
    last = {name: [None] * len(prompts) for name in speculators}
    for i, ids in enumerate(prompts):
        prompt = torch.tensor(ids, device=device)
        for turn in range(repeats + 1):  # turn 0 warms up (and compiles)
            for name, speculator in speculators.items():
                torch.manual_seed(0)
                if speculator is not None:  # no copying the last turn's answer to the same prompt
                    speculator.forget()
                start = time.perf_counter()
                tokens, stats = generation.generate(engine, prompt, new_tokens, sampling, eos_ids=[],
                                                    stop_at_eos=False, speculator=speculator)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                if turn:
                    seconds[name][i] = min(seconds[name][i], time.perf_counter() - start)
                last[name][i] = ([int(t) for t in tokens[0]], stats)
    return {name: (sum(len(t) for t, _ in last[name]) / sum(seconds[name]), last[name]) for name in speculators}


def quantized_checkpoint(model_pth: Path, mode: str, groupsize: int = 32) -> Path:
    """quantize.py's file beside model_pth, written by the CLI exactly as a user does, if not there yet."""
    import quantize
    path = quantize.output_path(model_pth, {"mode": mode, "groupsize": groupsize})
    if not path.is_file():
        extra = ["--groupsize", str(groupsize)] if mode.startswith("int4") else []
        subprocess.run([sys.executable, str(ROOT / "quantize.py"), "--checkpoint_path", str(model_pth),
                        "--mode", mode, *extra], check=True)
    return path


def hf_model(checkpoint_dir: Path, dtype=torch.float32, device="cpu"):
    """transformers' LlamaForCausalLM with our checkpoint's weights (exported through the converter)."""
    from transformers import LlamaForCausalLM
    from convert_hf_checkpoint import export_hf
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(checkpoint_dir, tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, dtype=dtype)
    return model.to(device).eval()


def time_transformers(model, prompt_ids: list, new_tokens: int, assistant=None, repeats: int = 3,
                      device="cpu", **generate_kwargs):
    """Best-of-`repeats` wall time of transformers' generate() (prefill included), exactly new_tokens; greedy
    unless generate_kwargs say otherwise. Returns (tokens/s, new token ids)."""
    ids = torch.tensor([prompt_ids], device=device)
    out = {}
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    kwargs.update(generate_kwargs)
    if assistant is not None:
        kwargs["assistant_model"] = assistant

    def run():
        torch.manual_seed(0)
        with torch.no_grad():
            out["ids"] = model.generate(ids, **kwargs)[0, len(prompt_ids):].tolist()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    seconds = best_seconds(run, repeats)
    return len(out["ids"]) / seconds, out["ids"]


def print_table(rows: list, columns: list):
    cells = [[c for c in columns]] + [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(cell.rjust(w) if j and i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_json(path: Path, data: dict):
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n"))
    print(f"wrote {path}")


def pick(configs, only: str, separator: str = ","):
    """The configurations (a dict's items or a list) that --only names, all where it names none; a name that matches
    nothing is refused before any timing (it used to run the baselines for minutes and print an empty table)."""
    if not only:
        return configs
    names = [name.strip() for name in only.split(separator) if name.strip()]
    unknown = [name for name in names if name not in configs]
    if unknown:
        raise UserError(f"--only {separator.join(unknown)!r} names no configuration here; choose from: "
                        f"{separator.join(configs)}")
    if isinstance(configs, dict):
        return {name: config for name, config in configs.items() if name in names}
    return [name for name in configs if name in names]


def requantized_q8_0(gguf: Path) -> Path:
    """A Q8_0 copy of a GGUF, for llama.cpp's 8-bit column when only a 4-bit file is at hand: llama.cpp
    dequantizes each tensor and quantizes it again (8.5 bits a weight: the bytes and kernels of a native Q8_0
    file; its values carry the 4-bit file's rounding). Written once, beside the original."""
    import ctypes
    import llama_cpp
    out = gguf.with_name(gguf.name.replace(gguf.name.split(".")[-2], "Q8_0"))
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {gguf}")
        tmp.rename(out)
    return out
