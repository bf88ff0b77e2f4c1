"""Weight-only quantization, int8 per output row or int4 in groups, and the CLI that writes it.

    python quantize.py --checkpoint_path checkpoints/tiny/target/model.pth --mode int8   # -> model_int8.pth

int8: s = max|w| / 127 per row, q = round(w / s). int4, per group of G inputs: s = (max - min) / 15, z = min + 8 * s,
q = round((w - z) / s) + 8 in [0, 15] (tinygemm's convention). Scales and zeros are rounded to bf16 (all the CPU
kernels take) before q is computed, so |w - dequantized w| <= s / 2 holds as run. The output layer is int8 in both
modes, and the embedding table int8 (one row read per token); norms stay in full precision. int8-a8 / int4-a8 store
the same integers and quantize each linear's input to 8 bits per block of 32 as it runs, multiplying in integers
(kernels_a8.cpp). File, kernels and layer choices: docs/quantization.md.
"""
import argparse
import os
import sys
import time
from pathlib import Path

from errors import UserError, interruptible_imports, load_weights, read_checkpoint, run_cli, write_atomically

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import kernels  # noqa: E402
from model import FeedForward, ModelArgs, Transformer  # noqa: E402

GROUPSIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
MODES = ("int8", "int4", "int8-a8", "int4-a8")
A8_STEP = 64  # the a8 kernels' step over a row's inputs: their weight rows are padded to a multiple of it
MIN_SCALE = 1e-6  # an all-equal row or group would otherwise get scale 0


# ----------------------------------------------------------------------------- int8

def quantize_int8(weight: Tensor):
    """[N, K] float -> (int8 [N, K], bf16 scales [N]), symmetric per output row."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=MIN_SCALE).to(torch.bfloat16)
    # |w| / s <= 127 * (1 + 2^-8) after s is rounded to bf16: still rounds to at most 127
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(weight: Tensor, scales: Tensor, dtype=torch.float32) -> Tensor:
    return weight.to(dtype) * scales.to(dtype)[:, None]


class Int8Linear(nn.Module):
    """y = x @ (q * s)^T with int8 q [N, K] and one bf16 scale per output row. On the CPU, once packed, the product
    runs in kernels_a8.cpp's fastgen::int8_linear: float32 activations times the int8 weight converted in registers,
    float32 sums (ATen's int8 kernel rounds the activations to bf16 and reads the weight slower: BENCHMARKS.md)."""
    packed_for_cpu = False

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16, device=device))

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_for_cpu:
            y = torch.ops.fastgen.int8_linear(x.reshape(-1, x.shape[-1]).float().contiguous(), self.weight,
                                              self.scales)
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        if x.device.type == "cpu":  # no compiler for kernels_a8.cpp
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.weight,
                                                   self.scales.to(torch.bfloat16))
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        # per-row scales commute with the matmul: scale the outputs, not the N x K weight
        return F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)

    def stacked(self, other: "Int8Linear", empty: bool = False) -> "Int8Linear":
        """One layer computing [self(x), other(x)] (not yet packed): its rows, then other's (`empty`: its shape
        only, for a stored packed copy to fill)."""
        fused = type(self)(self.in_features, self.out_features + other.out_features, device="meta")
        if not empty:
            fused.weight, fused.scales = torch.cat([self.weight, other.weight]), torch.cat([self.scales, other.scales])
        return fused

    def pack_for_cpu(self):
        """kernels_a8.cpp's layout: rows padded with zeros to a multiple of A8_STEP inputs, float32 scales (the
        bf16 values, exactly). Made after sharding; kept in the checkpoint's packed copy (store_packed), whose file
        pages later loads use in place."""
        if not self.packed_for_cpu and self.weight.device.type == "cpu" and kernels.a8_kernels():
            self.weight = F.pad(self.weight, (0, padded_inputs(self.in_features) - self.in_features)).contiguous()
            self.scales = self.scales.float()
            self.packed_for_cpu = True


class Int8Embedding(nn.Module):
    """An embedding table stored as quantize_int8 stores a linear's weight (int8 rows, one bf16 scale each): a token
    reads one row, so the table costs a quarter of its float32 bytes in the file and in memory, and a row is
    dequantized as it is read. A tied output layer is quantized from the same table (the same bytes: the file
    holds them once)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=torch.bfloat16, device=device))

    def forward(self, idx: Tensor) -> Tensor:  # float32 rows [..., dim]: the model casts them to its own dtype
        return self.weight[idx].float() * self.scales[idx].float().unsqueeze(-1)


# ----------------------------------------------------------------------------- int4

def quantize_int4(weight: Tensor, groupsize: int):
    """[N, K] float -> (uint8 [N, K/2] two 4-bit values a byte, bf16 scales_and_zeros [K/G, N, 2])."""
    N, K = weight.shape
    w = weight.float().view(N, K // groupsize, groupsize)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=MIN_SCALE).to(torch.bfloat16).float()
    zeros = (lo + 8 * scales).to(torch.bfloat16).float()
    q = (torch.round((w - zeros[..., None]) / scales[..., None]) + 8).clamp(0, 15).to(torch.uint8).view(N, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_and_zeros


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [N, K/2] -> [N, K] values 0..15 (column 2i from the low 4 bits, 2i+1 from the high 4 bits)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def dequantize_int4(packed: Tensor, scales_and_zeros: Tensor, groupsize: int, dtype=torch.float32) -> Tensor:
    q = unpack_int4(packed)
    N, K = q.shape
    scales, zeros = scales_and_zeros.to(dtype).transpose(0, 1).unsqueeze(-2).unbind(-1)  # [N, K/G, 1] each
    return ((q.view(N, K // groupsize, groupsize).to(dtype) - 8) * scales + zeros).view(N, K)


class Int4Linear(nn.Module):
    """y = x @ W^T with W = (q - 8) * s + z, one bf16 scale s and zero z per group of `groupsize` inputs."""

    def __init__(self, in_features: int, out_features: int, groupsize: int, device=None):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales_and_zeros", torch.empty(in_features // groupsize, out_features, 2,
                                                             dtype=torch.bfloat16, device=device))
        self.packed_for_cpu = False  # True once `weight` is in the CPU kernel's own layout
        # the group size as a tensor of the module's: inductor's lowering of aten._weight_int4pack_mm_for_cpu makes
        # it a constant of its own, which a stored graph (kernels only) would not have at load
        self.register_buffer("groupsize_tensor", torch.tensor([groupsize]), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_for_cpu:
            y = torch.ops.quantized.int4mm_packed_weight_cpu(x.reshape(-1, x.shape[-1]).to(torch.bfloat16),
                                                             self.weight, self.groupsize_tensor,
                                                             self.scales_and_zeros.to(torch.bfloat16))
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        return F.linear(x, dequantize_int4(self.weight, self.scales_and_zeros, self.groupsize, x.dtype))

    def pack_for_cpu(self):
        """Rearrange the weight for aten._weight_int4pack_mm_for_cpu, whose layout depends on the CPU's vector
        width (so the file keeps the portable layout, and a packed copy is keyed by the ISA: packed_key). The
        kernel needs N % 16 == 0."""
        if not self.packed_for_cpu and self.weight.device.type == "cpu" and self.out_features % 16 == 0:
            q = unpack_int4(self.weight).to(torch.int32)
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # 1: inner k-tiles, unused on CPU
            self.packed_for_cpu = True

    def stacked(self, other: "Int4Linear", empty: bool = False) -> "Int4Linear":
        """One layer computing [self(x), other(x)] (not yet packed): its rows, then other's (`empty`: its shape
        only, for a stored packed copy to fill)."""
        fused = type(self)(self.in_features, self.out_features + other.out_features, self.groupsize, device="meta")
        fused.groupsize_tensor = self.groupsize_tensor
        if not empty:
            fused.weight = torch.cat([self.weight, other.weight])
            fused.scales_and_zeros = torch.cat([self.scales_and_zeros, other.scales_and_zeros], dim=1)
        return fused

    def keep_rows(self, rows: Tensor):
        """Column parallelism: keep these output rows, with their scales and zeros."""
        assert not self.packed_for_cpu, "shard int4 weights before pack_for_cpu (generate.load_model does)"
        self.weight = self.weight.index_select(0, rows.to(self.weight.device))
        self.scales_and_zeros = self.scales_and_zeros.index_select(1, rows.to(self.weight.device))
        self.out_features = len(rows)

    def keep_columns(self, rank: int, world_size: int):
        """Row parallelism: keep this rank's slice of the inputs and the groups that cover exactly it."""
        assert not self.packed_for_cpu, "shard int4 weights before pack_for_cpu (generate.load_model does)"
        part = self.in_features // world_size
        if self.in_features % world_size or part % self.groupsize:
            raise UserError(f"int4 group size {self.groupsize} does not divide the {part} inputs each of {world_size} "
                            f"ranks gets from a layer of {self.in_features}: quantize with a --groupsize that does, "
                            f"or use int8")
        groups = part // self.groupsize
        self.weight = self.weight.narrow(1, rank * part // 2, part // 2).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.narrow(0, rank * groups, groups).contiguous()
        self.in_features = part


# ----------------------------------------------------------------------------- 8-bit activations

def padded_inputs(in_features: int) -> int:
    return -(-in_features // A8_STEP) * A8_STEP


class Int8A8Linear(Int8Linear):
    """int8-a8: Int8Linear's weights times the input quantized to 8 bits per block of 32 inputs (d = max|x| / 127),
    multiplied in integers: y = s * sum_b d_b * (q_w . q_x)_b. Off the CPU, or where kernels_a8.cpp cannot be built,
    the weight-only int8 path."""

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_for_cpu:
            y = torch.ops.fastgen.a8_int8_linear(x.reshape(-1, x.shape[-1]).float().contiguous(), self.weight,
                                                 self.scales)
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        return super().forward(x)


class Int4A8Linear(Int4Linear):
    """int4-a8: Int4Linear's weights times the input quantized to 8 bits per block of 32 inputs, multiplied in
    integers (llama.cpp's Q4_1 x Q8_1): with w = (u - 8) s + z and T_g = sum over g's blocks of d_b * sum(q_x),
    y = sum_g s_g * sum_b d_b (u . q_x)_b + sum_g (z_g - 8 s_g) T_g. Off the CPU, or where kernels_a8.cpp cannot be
    built, the weight-only int4 path."""
    a8 = False

    def forward(self, x: Tensor) -> Tensor:
        if self.a8:
            y = torch.ops.fastgen.a8_int4_linear(x.reshape(-1, x.shape[-1]).float().contiguous(), self.weight,
                                                 self.scales_and_zeros, self.groupsize)
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        return super().forward(x)

    def pack_for_cpu(self):
        """The kernel's layout: each row padded with zeros to a multiple of A8_STEP inputs, then in steps of 128
        inputs (and a last one of 64), byte i of a step holding its input i in the low 4 bits and input step / 2 + i
        in the high 4 bits, so that one shift unpacks whole vectors; scales and zeros [N, 2, K/G], each row's own
        contiguous."""
        if self.packed_for_cpu or self.weight.device.type != "cpu" or not kernels.a8_kernels():
            return super().pack_for_cpu()
        # on the packed bytes, never unpacked (most of a load): a step's byte 2j holds its inputs 2j and half + 2j,
        # byte 2j + 1 inputs 2j + 1 and half + 2j + 1, from bytes j (2j, 2j + 1) and half / 2 + j of the file's
        b = F.pad(self.weight, (0, padded_inputs(self.in_features) // 2 - self.weight.shape[1]))
        N, full = b.shape[0], b.shape[1] // 64 * 64

        def step_bytes(lo: Tensor, hi: Tensor) -> Tensor:  # a step's first and second halves of file bytes
            return torch.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], dim=-1).view(N, -1)

        steps = b[:, :full].view(N, -1, 2, 32)  # whole tensors at once: a loop over steps took seconds at 1B
        parts = [step_bytes(steps[:, :, 0], steps[:, :, 1])]
        if full < b.shape[1]:  # a last step of 64 inputs
            parts.append(step_bytes(b[:, full:full + 16], b[:, full + 16:]))
        self.weight = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        self.scales_and_zeros = self.scales_and_zeros.permute(1, 2, 0).contiguous()  # [K/G, N, 2] -> [N, 2, K/G]
        self.packed_for_cpu = self.a8 = True


# ----------------------------------------------------------------------------- schemes

def quantized_layers(model: Transformer, scheme: dict):
    """(name, nn.Linear, quantized module class and arguments) for every linear the scheme quantizes."""
    mode = scheme.get("mode")
    if mode not in MODES:
        raise UserError(f"unknown quantization mode {mode!r}: quantize.py writes {', '.join(MODES)}")
    a8 = mode.endswith("-a8")
    int8, int4 = (Int8A8Linear, Int4A8Linear) if a8 else (Int8Linear, Int4Linear)
    mode = mode.removesuffix("-a8")
    groupsize = scheme.get("groupsize")
    if mode == "int4" and groupsize not in GROUPSIZES:
        raise UserError(f"int4 group size {groupsize!r} is not supported: use one of {', '.join(map(str, GROUPSIZES))}")
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if mode == "int4":
        inputs = {module.in_features for name, module in layers if name != "output"}
        bad = sorted(k for k in inputs if k % groupsize)
        if bad:
            fits = [g for g in GROUPSIZES if all(k % g == 0 for k in inputs)]
            fix = f"use --groupsize {' or '.join(map(str, fits))}" if fits else "use --mode int8"
            raise UserError(f"--groupsize {groupsize} does not divide the layer input size {bad[0]}: {fix}")
    for name, linear in layers:
        if mode == "int4" and name != "output":
            yield name, linear, int4, (linear.in_features, linear.out_features, groupsize)
        else:
            yield name, linear, int8, (linear.in_features, linear.out_features)


def apply_quantization_scheme(model: Transformer, scheme: dict):
    """Swap the model's nn.Linear layers for the quantized modules of `scheme` (empty, on the same device;
    load_state_dict fills them), and its embedding table for an Int8Embedding where the scheme says so (files
    written before it did keep a float table). A tied output layer gets weights of its own."""
    for name, linear, cls, sizes in list(quantized_layers(model, scheme)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cls(*sizes, device=linear.weight.device))
    if scheme.get("embedding") == "int8":
        table = model.tok_embeddings.weight
        model.tok_embeddings = Int8Embedding(*table.shape, device=table.device)
    elif scheme.get("embedding") is not None:
        raise UserError(f"unknown embedding quantization {scheme['embedding']!r}: quantize.py writes int8")
    return model


def fuse_gate_up(model: nn.Module, empty: bool = False):
    """Each feed-forward's quantized w1 and w3 as one product w13 (w1's rows, then w3's): they read the same
    input, and a decode step's products are small enough that each call's fixed cost shows (BENCHMARKS.md,
    "Integer kernels"). Every output row is computed as before, so the results are the same bits. Each pair's file
    pages go as its stacked copy is made (kernels.drop_file_pages), not all at the end: a load's peak memory.
    `empty`: the stacked layers' shapes only, for a stored packed copy to fill (load_packed)."""
    mappings = kernels.file_mappings()
    for module in model.modules():
        if isinstance(module, FeedForward) and module.w13 is None and type(module.w1) is type(module.w3) \
                and isinstance(module.w1, (Int8Linear, Int4Linear)) and not module.w1.packed_for_cpu:
            read = [*module.w1.buffers(), *module.w3.buffers()]
            module.w13 = module.w1.stacked(module.w3, empty)
            del module.w1, module.w3
            if not empty:
                kernels.drop_file_pages(read, mappings, model)


def pack_for_device(model: nn.Module):
    """After loading (and sharding): w1 and w3 stacked (fuse_gate_up), and int8 and int4 weights on the CPU in
    their CPU kernel's layout."""
    fuse_gate_up(model)
    mappings = kernels.file_mappings()  # read once: every weight below was made before
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8Linear)) and not module.packed_for_cpu:
            read = list(module.buffers())
            module.pack_for_cpu()
            kernels.drop_file_pages(read, mappings, model)  # the file's pages of a weight now in a layout of its own
    kernels.release_file_pages(model)  # and the pages that weights packed on both sides of them shared


# ----------------------------------------------------------------------------- the packed copy beside the checkpoint

def packed_layers(model: nn.Module) -> dict:
    """name -> every quantized linear of the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (Int4Linear, Int8Linear))}


def packed_key(model: nn.Module, checkpoint_path, scheme: dict) -> tuple:
    """(fields, key) of a checkpoint's packed copy: everything the packed bytes depend on. The weights file's
    identity, the config and scheme, the layers to fill (their names and kinds), this file's source (the
    layouts), kernels_a8.cpp's (which kernels take them) and whether it built here, torch and the CPU's ISA (the
    int4 kernel's layout is made by ATen for the vector width)."""
    import dataclasses
    import artifacts
    fields = {"weights": artifacts.file_identity(checkpoint_path), "config": dataclasses.asdict(model.args),
              "scheme": scheme, "layers": sorted(f"{n}:{type(m).__name__}" for n, m in packed_layers(model).items()),
              "machine": {k: v for k, v in artifacts.machine().items() if k != "threads"},
              "sources": artifacts.sources_digest(("quantize",)), "a8_built": kernels.a8_kernels(),
              "native": artifacts.file_sha256(Path(kernels.__file__).with_name("kernels_a8.cpp"))}
    return fields, artifacts.key_of(fields)


def packed_name(checkpoint_path, key: str) -> str:
    return f"{Path(checkpoint_path).stem}-packed-{key[:16]}"


def load_packed(model: nn.Module, checkpoint_path, scheme: dict) -> bool:
    """Fill the model's quantized linears (w1 and w3 stacked) from the checkpoint's stored packed copy, if there is
    one for this key, signed by this user (artifacts.find), that holds exactly these layers' tensors; True if it
    did (the model is then as pack_for_device leaves it). Else the model is left as it was."""
    import artifacts
    kept = {m: (m.w1, m.w3) for m in model.modules() if isinstance(m, FeedForward) and m.w13 is None}
    fuse_gate_up(model, empty=True)  # the layers the copy fills, before the key: it names them
    fields, key = packed_key(model, checkpoint_path, scheme)
    directory = artifacts.directory_for(checkpoint_path)
    name = packed_name(checkpoint_path, key)
    path, refused = artifacts.find(directory, name, key, ".pth", content=False)
    stored = None
    if path is not None:
        try:
            # used in place, as llama.cpp maps its file (the server copies them onto 2 MB pages:
            # kernels.onto_huge_pages)
            stored = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception:
            refused = "it does not load"
    layers = packed_layers(model)
    if stored is not None:
        wanted = {f"{n}.{b}" for n, m in layers.items() for b, _ in m.named_buffers(recurse=False)
                  if b != "groupsize_tensor"}
        if not isinstance(stored, dict) or set(stored.get("tensors", {})) != wanted \
                or set(stored.get("flags", {})) != set(layers):
            refused, stored = "it holds other layers", None
    if stored is None:
        if refused:
            print(f"refusing the packed copy {directory / name}.pth: {refused}; packing again", file=sys.stderr)
        for module, (w1, w3) in kept.items():  # as it was: pack_for_device stacks and packs
            if module.w13 is not None:
                module.w13, module.w1, module.w3 = None, w1, w3
        return False
    for n, module in layers.items():
        for b, _ in list(module.named_buffers(recurse=False)):
            if b != "groupsize_tensor":
                setattr(module, b, stored["tensors"][f"{n}.{b}"])
        for flag in ("packed_for_cpu", "a8"):
            if flag in stored["flags"][n]:
                setattr(module, flag, bool(stored["flags"][n][flag]))
    kernels.release_file_pages(model)  # the checkpoint's pages of the layers the copy replaced
    return True


def store_packed(model: nn.Module, checkpoint_path, scheme: dict):
    """Write the packed layers of a model just packed (pack_for_device) as the checkpoint's packed copy, keyed and
    signed (artifacts.store: written whole or not at all; older copies of this checkpoint go). A copy that cannot
    be written (a read-only directory and cache, a full disk) is one line on stderr: the next load packs again."""
    import artifacts
    layers = packed_layers(model)
    if not layers or not any(m.packed_for_cpu for m in layers.values()):
        return
    fields, key = packed_key(model, checkpoint_path, scheme)
    tensors = {f"{n}.{b}": t for n, m in layers.items() for b, t in m.named_buffers(recurse=False)
               if b != "groupsize_tensor"}
    flags = {n: {f: getattr(m, f) for f in ("packed_for_cpu", "a8") if hasattr(m, f)} for n, m in layers.items()}

    def write(tmp):
        os.chmod(tmp, 0o644)  # another user's write access would let them change what this one's signature covers
        torch.save({"tensors": tensors, "flags": flags}, tmp)
    directory = artifacts.directory_for(checkpoint_path)
    try:
        artifacts.store(directory, packed_name(checkpoint_path, key), key, fields, write, ".pth", content=False)
    except OSError as e:
        print(f"cannot store the packed copy of {checkpoint_path} in {directory} ({e}); it is packed again at "
              f"every load", file=sys.stderr)


def pack_or_load(model: nn.Module, checkpoint_path, scheme: dict):
    """A CPU model's quantized layers in their kernels' layouts: from the checkpoint's stored packed copy where
    there is a valid one, else packed here (pack_for_device) and the copy stored for the next load."""
    if not load_packed(model, checkpoint_path, scheme):
        pack_for_device(model)
        store_packed(model, checkpoint_path, scheme)


def quantize_state_dict(state_dict: dict, args: ModelArgs, scheme: dict) -> dict:
    """A full-precision state dict -> the state dict of the quantized model. With scheme["embedding"] "int8" the
    embedding table is int8 too, and a tied output layer is not written: it is the table's own int8 rows and scales
    (generation.load_model gives it them)."""
    with torch.device("meta"):
        model = Transformer(args)
    out = dict(state_dict)
    mappings = kernels.file_mappings()  # read once: every weight below was made before
    table, output = state_dict.get("tok_embeddings.weight"), out.pop("output.weight", None)
    # converters may write a tied output beside the table (the same storage): it is still the table's rows
    tied = args.tie_word_embeddings and (output is None or output is table or torch.equal(output, table))
    if output is not None and not tied:
        out["output.weight"] = output
    if scheme.get("embedding") == "int8":
        out["tok_embeddings.weight"], out["tok_embeddings.scales"] = quantize_int8(state_dict["tok_embeddings.weight"])
        kernels.drop_file_pages([state_dict["tok_embeddings.weight"]], mappings)
    for name, linear, cls, _ in list(quantized_layers(model, scheme)):
        key = f"{name}.weight"
        if name == "output" and tied:
            if scheme.get("embedding") == "int8":
                continue
            key = "tok_embeddings.weight"  # the output gets its own quantized copy
        weight = state_dict[key]
        if issubclass(cls, Int8Linear):
            out[f"{name}.weight"], scales = quantize_int8(weight)
            out[f"{name}.scales"] = scales
        else:
            out[f"{name}.weight"], scales = quantize_int4(weight, scheme["groupsize"])
            out[f"{name}.scales_and_zeros"] = scales
        if not bool(torch.isfinite(scales).all()):  # a NaN or infinite weight makes its row's scale one
            raise UserError(f"{key} holds NaN or infinite values: the weights are broken; re-convert or "
                            f"re-download the checkpoint")
        kernels.drop_file_pages([weight], mappings)  # read once: its file pages need not stay beside the quantized copy
    return out


def check_state_dict(state_dict: dict, args: ModelArgs, path: Path):
    """Refuse weights that do not fit config.json's model exactly (names, shapes, floating point), as
    generation.load_model would: nothing is written for a checkpoint that could not load."""
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_word_embeddings and "output.weight" not in state_dict and "tok_embeddings.weight" in state_dict:
        state_dict = dict(state_dict, **{"output.weight": state_dict["tok_embeddings.weight"]})
    if not all(isinstance(v, Tensor) for v in state_dict.values()):
        raise UserError(f"{path} does not hold a state dict of tensors: re-convert it")
    load_weights(model, state_dict, path)
    for name, weight in state_dict.items():
        if not weight.is_floating_point():
            raise UserError(f"{path}: {name} holds {weight.dtype} values, not floating point: quantize the "
                            f"full-precision checkpoint")


def output_path(checkpoint_path: Path, scheme: dict) -> Path:
    suffix = scheme["mode"] if scheme["mode"].startswith("int8") else f"{scheme['mode']}.g{scheme['groupsize']}"
    return checkpoint_path.with_name(f"{checkpoint_path.stem}_{suffix}.pth")


def quantize_checkpoint(checkpoint_path: Path, mode: str, groupsize=None) -> Path:
    """Write the quantized checkpoint beside `checkpoint_path` (atomically); returns its path."""
    path = Path(checkpoint_path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path} (pass the full-precision model.pth)")
    if mode.startswith("int8") and groupsize is not None:
        raise UserError(f"--groupsize is for --mode int4 or int4-a8 ({mode} has one scale per output row): drop "
                        f"--groupsize")
    scheme = {"mode": mode} if mode.startswith("int8") else {"mode": mode, "groupsize": groupsize or 128}
    scheme["embedding"] = "int8"
    args = ModelArgs.from_checkpoint_dir(path.parent)
    state_dict = read_checkpoint(path)
    if isinstance(state_dict.get("quantization"), dict):
        raise UserError(f"{path} is already quantized ({state_dict['quantization'].get('mode')}): "
                        f"quantize the full-precision model.pth instead")
    check_state_dict(state_dict, args, path)
    out = output_path(path, scheme)
    if out.exists() and not out.is_file():  # checked before the work (the write would name its temp file)
        raise UserError(f"{out}, where the {mode} copy goes, exists and is not a file: move it away")
    try:
        quantized = quantize_state_dict(state_dict, args, scheme)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    write_atomically(out, lambda tmp: torch.save({"quantization": scheme, "model": quantized}, tmp))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Write an int8 or int4 weight-only quantized copy of a checkpoint")
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/tiny/target/model.pth"),
                   help="the full-precision model.pth (config.json beside it)")
    p.add_argument("--mode", choices=MODES, default="int8",
                   help="-a8: the same weights, each layer's input quantized to 8 bits as it runs (faster on x86 "
                        "CPUs; changes the outputs a little more)")
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES, default=None,
                   help="int4 modes only: inputs sharing one scale and zero (default 128; smaller is more accurate)")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = quantize_checkpoint(args.checkpoint_path, args.mode, args.groupsize)
    print(f"wrote {out} ({args.checkpoint_path.stat().st_size / 1e6:.1f} MB -> {out.stat().st_size / 1e6:.1f} MB) "
          f"in {time.perf_counter() - t0:.1f} s")
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
