"""Ulysses' q/k/v all-to-all through the copy engines against NCCL's, alone and beside attention
(issue 36, item 3: communication off the critical path).

NCCL's all-to-all runs as kernels on the SMs: launched beside attention it waits for SMs, and the
peer's NCCL kernel waits behind the peer's attention (head-chunk pipelining measured slower,
benchmarks/NOTES.md). A copy-engine all-to-all takes no SMs: every rank's send buffer is symmetric
memory (torch.distributed._symmetric_memory, peer mappings only: NVLink multicast stays off), and
each rank pulls its chunk from every peer's buffer with cudaMemcpyAsync (a tensor copy_ between
the mapped peer buffer and local memory), between two barriers (all senders ready; all readers
done before a buffer is written again). The question this answers before any integration: how
fast the copy engines move Ulysses' bytes, and whether attention keeps its speed while they do.

Per case, at its Ulysses shape on N GPUs (each rank: B x S/N tokens of all H heads out, B x S
tokens of H/N heads in), GPU time from CUDA events, the slowest rank's median of --reps:
  nccl          dist.all_to_all_single of the q/k/v send buffer
  ce            the copy-engine all-to-all, the peers' chunks pulled one after another on one stream
  ce streams    the same with one stream per peer (copies to different peers at once)
  attention     cuDNN SDPA over this rank's heads of the whole sequence (what the q/k/v feed)
  attn + nccl   attention and an all-to-all of the same bytes launched together (side stream)
  attn + ce     the same with the copy-engine all-to-all (one stream per peer)
"overlap" is (attention + all-to-all alone) / (both together): 2.0 would hide the shorter fully.

  torchrun --nproc_per_node 4 benchmarks/cp_copy_engine.py
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.nn.functional as F

#: name -> (batch, tokens, heads, head_dim) of one self-attention under Ulysses (issue 36's shapes).
CASES = {
    "LTX-Video 2B, 2x8064": (2, 8064, 32, 64),
    "LTX-Video 13B, 2x12672": (2, 12672, 32, 128),
    "HunyuanVideo-1.5 480p, 48360": (1, 48360, 16, 128),
}


class CopyEngineAllToAll:
    """All-to-all of a [world, chunk] buffer through the copy engines: `send` is this rank's
    symmetric send buffer (write the chunk for rank p into send[p]); __call__(recv) fills
    recv[p] with rank p's chunk for this rank, on side streams the current stream then waits for."""

    def __init__(self, world: int, chunk: int, dtype, group, streams_per_peer: bool):
        self.world, self.chunk, self.dtype = world, chunk, dtype
        self.send = symm_mem.empty(world * chunk, dtype=dtype, device="cuda").view(world, chunk)
        self.handle = symm_mem.rendezvous(self.send, group)
        self.rank = self.handle.rank
        count = world if streams_per_peer else 1
        self.streams = [torch.cuda.Stream() for _ in range(count)]

    def __call__(self, recv: torch.Tensor) -> None:
        main = torch.cuda.current_stream()
        first = self.streams[0]
        first.wait_stream(main)  # this rank's send buffer written
        with torch.cuda.stream(first):
            self.handle.barrier(channel=0)  # every rank's send buffer written
        for step in range(self.world):
            peer = (self.rank + step) % self.world
            stream = self.streams[step % len(self.streams)]
            if stream is not first:
                stream.wait_stream(first)
            with torch.cuda.stream(stream):
                source = self.handle.get_buffer(
                    peer, (self.chunk,), self.dtype, self.rank * self.chunk
                )
                recv[peer].copy_(source)
        for stream in self.streams[1:]:
            first.wait_stream(stream)
        with torch.cuda.stream(first):
            self.handle.barrier(channel=1)  # every peer has read this rank's buffer
        main.wait_stream(first)


def timed(fn, reps: int) -> float:
    """The slowest rank's median ms of fn() over reps calls (ranks lined up before each)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def run_case(name, shape, world, reps, group, say):
    batch, tokens, heads, head_dim = shape
    local, local_heads = tokens // world, heads // world
    # a destination's chunk: q, k, v of its heads for this rank's tokens
    chunk = 3 * batch * local * local_heads * head_dim
    send = torch.randn(world, chunk, device="cuda", dtype=torch.bfloat16)
    recv_nccl = torch.empty_like(send)

    def nccl():
        dist.all_to_all_single(recv_nccl, send)

    engines = {
        "ce": CopyEngineAllToAll(world, chunk, torch.bfloat16, group, streams_per_peer=False),
        "ce streams": CopyEngineAllToAll(world, chunk, torch.bfloat16, group, True),
    }
    recv_ce = torch.empty_like(send)
    for engine in engines.values():
        engine.send.copy_(send)
    nccl()
    engines["ce streams"](recv_ce)
    torch.cuda.synchronize()
    equal = torch.equal(recv_ce, recv_nccl)

    q, k, v = (
        torch.randn(batch, tokens, local_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    out = torch.empty_like(q)

    def attention():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            out.copy_(
                F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                ).transpose(1, 2)
            )

    side = torch.cuda.Stream()

    def attention_and_nccl():
        work = dist.all_to_all_single(recv_nccl, send, async_op=True)
        attention()
        work.wait()

    def attention_and_ce():
        engine = engines["ce streams"]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            engine(recv_ce)
        attention()
        torch.cuda.current_stream().wait_stream(side)

    ms = {
        "nccl": timed(nccl, reps),
        "ce": timed(lambda: engines["ce"](recv_ce), reps),
        "ce streams": timed(lambda: engines["ce streams"](recv_ce), reps),
        "attention": timed(attention, reps),
        "attn + nccl": timed(attention_and_nccl, reps),
        "attn + ce": timed(attention_and_ce, reps),
    }
    moved = (world - 1) * chunk * 2  # bytes leaving (and arriving at) each rank
    flops = 4 * batch * local_heads * tokens * tokens * head_dim
    nccl_overlap = (ms["attention"] + ms["nccl"]) / ms["attn + nccl"]
    ce_overlap = (ms["attention"] + ms["ce streams"]) / ms["attn + ce"]
    say(
        f"| {name} | {moved / 2**20:.0f} | {ms['nccl']:.3f} ({moved / ms['nccl'] / 1e6:.0f}) "
        f"| {ms['ce']:.3f} ({moved / ms['ce'] / 1e6:.0f}) "
        f"| {ms['ce streams']:.3f} ({moved / ms['ce streams'] / 1e6:.0f}) "
        f"| {ms['attention']:.3f} ({flops / ms['attention'] / 1e9:.0f}) "
        f"| {ms['attn + nccl']:.3f} ({nccl_overlap:.2f}x) | {ms['attn + ce']:.3f} "
        f"({ce_overlap:.2f}x) | {'yes' if equal else 'NO'} |",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        parser.error("runs under torchrun --nproc_per_node N (N GPUs)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # (needed before torch 2.9)
        symm_mem.enable_symm_mem_for_group(group)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"# Ulysses q/k/v all-to-all, {world} x {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}: ms (GB/s leaving a rank; attention: TF/s), slowest rank's median "
        f"of {args.reps}"
    )
    say(
        "| case | MiB out | nccl | ce | ce streams | attention | attn + nccl (overlap) "
        "| attn + ce (overlap) | ce = nccl |"
    )
    say("|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, shape in CASES.items():
        run_case(name, shape, world, args.reps, group, say)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
