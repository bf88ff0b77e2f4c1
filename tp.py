"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over torch.distributed, launched by torchrun.

Every rank holds a slice of each block: wqkv (its n_head/N query and n_kv/N KV heads), w1 and w3 column-parallel;
wo and w2 row-parallel, their partial sums added by one all-reduce each. The output layer is split by vocabulary rows
(when N divides it) and all-gathered; embeddings and the draft are replicated. Ranks never diverge: all compute the
same logits and sample from the same seed, so they pick the same tokens without a broadcast (docs/tensor-parallel.md).
A server is another matter (requests arrive at rank 0 alone): there rank 0 leads and the others follow its engine
calls (Lockstep).
"""
import contextlib
import dataclasses
import hashlib
import math
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from errors import UserError, first_line, quiet_stderr


JOIN_TIMEOUT = 60  # seconds every rank waits for the others to join (FASTGEN_DIST_TIMEOUT overrides it)
JOIN_SLACK = 10  # seconds torch's own join timeout comes after ours (join)


def init_distributed(device: str) -> tuple:
    """Join the torchrun job; returns (rank, world_size). NCCL on cuda:LOCAL_RANK, else gloo. Raises UserError if
    the peers do not join within join_timeout(); collectives keep the backend's longer timeout (loads can be slow)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
            raise UserError("WORLD_SIZE > 1 but RANK/MASTER_ADDR are not set: launch with "
                            "torchrun --nproc_per_node=N generate.py ...")
        environment = {name: os.environ.get(name, "0") for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        bad = [f"{name}={value!r}" for name, value in environment.items() if not value.isdigit()]
        if bad:
            raise UserError(f"{', '.join(bad)} is not a number: launch with "
                            f"torchrun --nproc_per_node=N generate.py ...")
        rank, world_size = int(environment["RANK"]), int(environment["WORLD_SIZE"])
        if rank >= world_size:
            raise UserError(f"RANK={rank} is not below WORLD_SIZE={world_size}: launch with torchrun")
        timeout = join_timeout()
        backend, device_id = "gloo", None
        if device.startswith("cuda"):
            if device != "cuda":
                raise UserError(f"--device {device}: under torchrun pass --device cuda; rank r uses cuda:LOCAL_RANK")
            local_rank = int(environment["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            backend, device_id = "nccl", torch.device("cuda", local_rank)
        where = f"{os.environ['MASTER_ADDR']}:{environment['MASTER_PORT']}"
        try:
            join(backend, rank, world_size, device_id, timeout)
        except (RuntimeError, TimeoutError, ValueError) as e:  # DistStoreError, DistNetworkError are RuntimeErrors
            reason = first_line(e, 200)
            # a timeout is the same line whoever saw it first (join's deadline, torch's connect or store timeout)
            reason = "" if isinstance(e, TimeoutError) or "timed out" in reason.lower() else f" ({reason})"
            raise UserError(f"rank {rank} of {world_size} could not join the others at {where} within {timeout:g} s"
                            f"{reason}: start every rank (torchrun --nproc_per_node=N) with the same MASTER_ADDR and "
                            f"MASTER_PORT, or raise FASTGEN_DIST_TIMEOUT") from None
        try:  # collectives: back to the backend's default timeout
            dist.distributed_c10d._set_pg_timeout(dist.distributed_c10d._get_default_timeout(backend))
        except (AttributeError, TypeError, ValueError):
            pass
    return dist.get_rank(), dist.get_world_size()


def join(backend: str, rank: int, world_size: int, device_id, timeout: float):
    """dist.init_process_group, given up after `timeout` seconds whatever the peer at MASTER_ADDR:MASTER_PORT does:
    torch's own timeout covers a port where no one listens, not a process there that accepts the connection and
    never answers (the store's handshake reads without a deadline). So the join runs in a daemon thread that this
    one waits for (Ctrl-C and SIGTERM still end the wait), and torch's timeout is set a little later than ours, so
    that one deadline decides. torch's C++ log of the attempts (socket timeouts, retries, frame lists) is kept out
    of stderr meanwhile, unless TORCH_CPP_LOG_LEVEL or FASTGEN_TRACEBACK asks for it: the error line says it all."""
    outcome = []

    def attempt():
        try:
            if device_id is not None:
                torch.cuda.set_device(device_id)  # the current device is per thread
            dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device_id,
                                    timeout=timedelta(seconds=timeout + JOIN_SLACK))
        except BaseException as e:  # handed to the waiting thread
            outcome.append(e)
    thread = threading.Thread(target=attempt, name="join", daemon=True)
    with quiet_stderr(unless="TORCH_CPP_LOG_LEVEL"):  # torch reads its log level as it loads: too early here
        thread.start()
        thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError("no answer")
    if outcome:
        raise outcome[0]


def check_same_settings(settings: dict):
    """Every rank must run the same generation (ranks never exchange tokens): each rank's settings ({name: text}),
    as a digest and a short form per setting, gathered on every rank; where one differs from rank 0's, every rank
    raises the same UserError, instead of the ranks running collectives of different shapes or counts (a hang)."""
    mine = {name: (hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(), shorten(text))
            for name, text in settings.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    first = gathered[0]
    for rank, other in enumerate(gathered):
        differ = sorted(name for name in set(first) | set(other) if other.get(name) != first.get(name))
        if differ:
            name = differ[0]
            theirs, ours = (other.get(name, (None, "nothing"))[1], first.get(name, (None, "nothing"))[1])
            raise UserError(f"rank {rank} was launched with another `{name}` than rank 0 ({theirs} instead of "
                            f"{ours}): give every rank the same arguments")


def shorten(text: str, limit: int = 40) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


def join_timeout() -> float:
    value = os.environ.get("FASTGEN_DIST_TIMEOUT", str(JOIN_TIMEOUT))
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise UserError(f"FASTGEN_DIST_TIMEOUT={value!r}: give the seconds ranks wait for each other to join, e.g. 60")
    return seconds


def check_world_size(model, world_size: int):
    """Refuse a world size that does not split every head group and the feed-forward evenly."""
    args = model.args
    sizes = {"n_head": args.n_head, "n_kv_heads": args.n_local_heads, "intermediate_size": args.intermediate_size}
    bad = [f"{name}={n}" for name, n in sizes.items() if n % world_size]
    if bad:
        common = math.gcd(*sizes.values())
        valid = [n for n in range(2, common + 1) if common % n == 0]
        fix = (f"launch torchrun with a total of N ranks (--nproc_per_node x --nnodes), N in {valid}" if valid
               else "this model does not split, run generate.py without torchrun")
        raise UserError(f"tensor parallelism over {world_size} ranks needs {', '.join(bad)} to be a multiple of "
                        f"{world_size}: {fix}")


def apply_tp(model, rank: int, world_size: int):
    """Shard a loaded target model in place for this rank; generation.load_model calls it on the memory-mapped
    checkpoint, before the move to the device, so each rank reads only its own part."""
    check_world_size(model, world_size)
    group = dist.group.WORLD.group_name if dist.is_initialized() else None
    for layer in model.layers:
        attn, ffn = layer.attention, layer.feed_forward
        q_size, kv_size = attn.n_head * attn.head_dim, attn.n_local_heads * attn.head_dim
        q_rows, kv_rows = q_size // world_size, kv_size // world_size
        q = torch.arange(rank * q_rows, (rank + 1) * q_rows)
        kv = torch.arange(rank * kv_rows, (rank + 1) * kv_rows)
        keep_rows(attn.wqkv, torch.cat([q, q_size + kv, q_size + kv_size + kv]))  # [q; k; v] of this rank
        keep_columns(attn.wo, rank, world_size)
        attn.n_head //= world_size
        attn.n_local_heads //= world_size
        rows = model.args.intermediate_size // world_size
        for linear in (ffn.w1, ffn.w3):
            keep_rows(linear, torch.arange(rank * rows, (rank + 1) * rows))
        keep_columns(ffn.w2, rank, world_size)
        for module in (attn, ffn):
            module.register_forward_hook(lambda _m, _inputs, out: all_reduce(out, group))
    vocab = model.args.vocab_size
    if vocab % world_size == 0:
        part = vocab // world_size
        keep_rows(model.output, torch.arange(rank * part, (rank + 1) * part))
        model.output.register_forward_hook(lambda _m, _inputs, out: all_gather_last_dim(out, world_size, group))
    model.world_size = world_size
    return model


def all_reduce(x: Tensor, group) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))


def all_gather_last_dim(x: Tensor, world_size: int, group) -> Tensor:
    # the collective stacks the ranks' [B, T, V/N] along dim 0; put them side by side along the vocabulary
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world_size, group)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    return torch.cat(gathered.chunk(world_size, dim=0), dim=-1)


def own_tensors(module: nn.Module):
    return list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))


def replace(module: nn.Module, name: str, tensor: Tensor):
    # a new Parameter, never .data: the output layer may share its weight with the embeddings
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor


def keep_rows(linear: nn.Module, rows: Tensor):
    """Column-parallel: keep these output rows of every tensor (int8's scales too); int4 slices itself."""
    if hasattr(linear, "keep_rows"):
        return linear.keep_rows(rows)
    for name, tensor in own_tensors(linear):
        replace(linear, name, tensor.index_select(0, rows.to(tensor.device)))
    if hasattr(linear, "out_features"):
        linear.out_features = len(rows)


def keep_columns(linear: nn.Module, rank: int, world_size: int):
    """Row-parallel: keep this rank's slice of the weight's inputs (dim 1); int8's per-row scales stay whole (each
    partial sum is scaled before the all-reduce); int4 slices itself, whole groups only."""
    if hasattr(linear, "keep_columns"):
        return linear.keep_columns(rank, world_size)
    for name, tensor in own_tensors(linear):
        if tensor.dim() >= 2:
            part = tensor.shape[1] // world_size
            replace(linear, name, tensor.narrow(1, rank * part, part).contiguous())
    if hasattr(linear, "in_features"):
        linear.in_features //= world_size


def end_process(error=None, status: Optional[int] = None):
    """End this rank: on success (error None) all ranks leave together; else print `error` (unless empty: printed
    already), no barrier (a peer may be inside a collective). Exit status: `status`, by default 0 on success, else 1.
    os._exit: interpreter shutdown can abort while the collective threads free tensors."""
    if error is None:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    if error:
        # one write of the whole line: the ranks share stderr, and print's separate newline lets two lines interleave
        os.write(sys.stderr.fileno(), f"{error}\n".encode())
    os._exit(status if status is not None else 0 if error is None else 1)


def read_prompt(question: str) -> str:
    """Interactive mode: rank 0 reads stdin, every rank gets the same text (EOFError on all at the end)."""
    box = [None]
    if dist.get_rank() == 0 and sys.stdin is not None:  # None: no stdin at all, the end of the input
        try:
            box[0] = input(question)
        except EOFError:
            pass
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        raise EOFError
    return box[0]


# ----------------------------------------------------------------------------- serving: rank 0 leads, the others follow

class RanksFailed(RuntimeError):
    """Tensor-parallel serving cannot go on: a rank went away, or a call that ran on every rank failed on this one
    (the ranks may be out of step). The message is the one line a server prints and answers with."""


class Lockstep:
    """Tensor-parallel serving (serve.py under torchrun): rank 0 runs the server and its scheduler; the other ranks
    hold their shards and follow. Everything that changes the target model's state is an engine callable (its
    forwards, decode_one_token, prefill, move_cache_slots: every field of the engine typed `callable`), so wrapping
    the engine once mirrors every caller, the speculative loop's included: rank 0's engine (leader()) broadcasts each
    call, its name and arguments (tensors on the host, the model as a marker), over a gloo group of their own, then
    runs it; the other ranks run the same calls in the same order on their shards (follow()), so their collectives
    meet rank 0's. Only rank 0 samples, drafts (the draft is replicated and runs there alone) and decides; the
    others never see a token's choice, only the calls it leads to."""
    MODEL, PING, STOP = "<model>", "<ping>", "<stop>"
    PING_SECONDS = 2.0  # an idle rank 0 looks this often whether the others are still there (keep_alive)

    def __init__(self, group=None):
        """Every rank, right after joining (before loading, so that a rank that fails to load is a closed connection
        for the others, not a wait for a group that never forms)."""
        # gloo whatever the backend: a dead peer shows as a closed connection at the next call, not an NCCL timeout
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.engine, self.names, self.device = None, [], None
        self.last = time.monotonic()
        self.failed = None

    def attach(self, engine):
        self.engine = engine
        self.names = [f.name for f in dataclasses.fields(engine) if f.type is callable and getattr(engine, f.name)]
        self.device = engine.model.tok_embeddings.weight.device

    # --- rank 0

    def leader(self, engine):
        """The engine rank 0 runs: each callable broadcasts its call first. A call that fails there is RanksFailed:
        the other ranks ran it too, or are waiting inside it for this rank's collective."""
        self.attach(engine)

        def mirrored(name, fn):
            def call(*args, **kwargs):
                self.send((name, self.portable(args), self.portable(kwargs)))
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    raise self.failure(e, f"`{name}` failed") from e
            return call
        return dataclasses.replace(self.engine, **{name: mirrored(name, getattr(self.engine, name))
                                                   for name in self.names})

    def portable(self, values):
        """Arguments as the other ranks can load them: tensors on the host, the model named, the rest as it is."""
        if isinstance(values, dict):
            return {key: self.portable([value])[0] for key, value in values.items()}
        return [self.MODEL if value is self.engine.model else value.cpu() if isinstance(value, torch.Tensor)
                else value for value in values]

    def send(self, message):
        if self.failed is not None:
            raise RanksFailed(self.failed)
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except Exception as e:
            raise self.failure(e, "a call could not reach them") from e
        self.last = time.monotonic()

    def failure(self, e: Exception, what: str) -> RanksFailed:
        reason = peer_lost(e)
        self.failed = (f"rank 0 lost the other ranks of tensor parallelism ({reason}): a rank failed or was stopped; "
                       f"restart the server" if reason else
                       f"tensor parallelism stopped: {what} on rank 0 ({type(e).__name__}: "
                       f"{first_line(e, default='')}), the ranks may be out of step; restart the "
                       f"server")
        return RanksFailed(self.failed)

    def keep_alive(self):
        """Called by an idle rank 0: a ping now and then, so that a rank gone while no request ran is noticed (its
        connection found closed) without waiting for the next request."""
        if time.monotonic() - self.last >= self.PING_SECONDS:
            self.send((self.PING, [], {}))

    def stop(self):
        """The other ranks leave follow(); nothing more is sent."""
        self.send((self.STOP, [], {}))
        self.failed = "the server is shutting down"

    # --- the other ranks

    def follow(self, engine, context=None):
        """Run rank 0's calls on this rank's shard (`engine`, built as rank 0's) until it stops (returns) or goes
        away (RanksFailed). `context` (a function returning a context manager) wraps each call as rank 0's caller
        wraps its own."""
        self.attach(engine)
        while self.run(self.receive(), context):
            pass

    def receive(self):
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as e:
            reason = peer_lost(e) or f"{type(e).__name__}: {str(e).strip()[:160]}"
            raise RanksFailed(f"rank {dist.get_rank()} lost rank 0 ({reason}): the server stopped; its error, if "
                              f"any, is above") from e
        return box[0]

    def run(self, message, context=None) -> bool:
        """One call of rank 0's on this rank's engine; False at the end."""
        name, args, kwargs = message
        if name == self.STOP:
            return False
        if name != self.PING:
            args, kwargs = self.local(args), {key: self.local([value])[0] for key, value in kwargs.items()}
            try:
                with torch.no_grad(), context() if context else contextlib.nullcontext():
                    getattr(self.engine, name)(*args, **kwargs)
            except Exception as e:
                rank = dist.get_rank() if dist.is_initialized() else 0
                raise RanksFailed(f"rank {rank}: `{name}` failed ({type(e).__name__}: "
                                  f"{first_line(e, default='')}); the server stops") from e
        return True

    def local(self, values: list) -> list:
        return [self.engine.model if isinstance(value, str) and value == self.MODEL else
                value.to(self.device) if isinstance(value, torch.Tensor) else value for value in values]


def peer_lost(e: Exception):
    """The reason, if `e` is a collective that failed because another rank went away (gloo: "Connection closed by
    peer"; NCCL), else None."""
    text = str(e)
    if not (isinstance(e, getattr(dist, "DistError", ())) or any(w in text for w in ("gloo", "NCCL", "closed by peer",
                                                                                      "Connection reset"))):
        return None
    reason = (text.strip().splitlines() or [type(e).__name__])[0]
    return reason.split("] ", 1)[-1].split(". ")[0][:160]  # "[.../pair.cc:537] Connection closed by peer [...]:N"
