"""Full-model CUDA graphs for uniform batches (decode, and later K + 1 verify batches).

A graph replays a fixed sequence of kernels on fixed memory, so every input lives in a
persistent buffer that each step fills in place, and batches are padded up to a captured
size. Only uniform batches (every request has the same query length) are captured; mixed
prefill/decode batches run eagerly. Padding rules: padded tokens get slot -1 (no KV write),
padded requests get seq_len 0 and a repeated query_start_loc (no queries), so the attention
kernels skip them and real rows never see them.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from tinyvllm.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256, then steps of 16; capped by max_num_seqs
    (which is always included, so every uniform decode batch has a graph)."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_num_seqs + 1, 16)]
    capped = [s for s in sizes if s < max_num_seqs]
    return [*capped, max_num_seqs]


@dataclass(frozen=True, order=True)
class BatchDescriptor:
    """What a graph is keyed by: padded token count and the uniform query length."""

    num_tokens: int
    query_len: int

    @property
    def num_reqs(self) -> int:
        return self.num_tokens // self.query_len


class CudaGraphDispatcher:
    """Decides which captured graph (if any) runs a batch, and how far it is padded."""

    def __init__(self, batch_sizes: Iterable[int], query_lens: Iterable[int] = (1,)) -> None:
        self.batch_sizes = sorted(set(batch_sizes))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        self.query_lens = sorted(set(query_lens))

    def add_query_len(self, query_len: int) -> None:
        """Also capture uniform batches of `query_len` tokens per request (K + 1 verify)."""
        if query_len not in self.query_lens:
            self.query_lens = sorted({*self.query_lens, query_len})

    def descriptors(self) -> list[BatchDescriptor]:
        """Every graph to capture, largest first (so smaller ones reuse its memory pool)."""
        keys = [BatchDescriptor(b * q, q) for q in self.query_lens for b in self.batch_sizes]
        return sorted(keys, reverse=True)

    def dispatch(
        self, num_reqs: int, num_tokens: int, max_query_len: int
    ) -> BatchDescriptor | None:
        """The graph for this batch, or None to run it eagerly (mixed query lengths, an
        uncaptured query length, or more requests than the largest graph)."""
        if num_reqs == 0 or num_tokens != num_reqs * max_query_len:
            return None  # not uniform: some request has a shorter query
        if max_query_len not in self.query_lens:
            return None
        i = bisect.bisect_left(self.batch_sizes, num_reqs)
        if i == len(self.batch_sizes):
            return None
        return BatchDescriptor(self.batch_sizes[i] * max_query_len, max_query_len)


class GraphInputBuffers:
    """Persistent device buffers a graph reads; `fill` copies one step's inputs into them."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=i32, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=i32, device=device)

    def metadata(self, desc: BatchDescriptor) -> AttentionMetadata:
        """Metadata whose tensors are views of the buffers, sized for `desc`. Host-side
        fields hold the bucket's bounds: graph-safe backends read only those."""
        n, r = desc.num_tokens, desc.num_reqs
        return AttentionMetadata(
            num_reqs=r,
            num_actual_tokens=n,
            query_start_loc=self.query_start_loc[: r + 1],
            seq_lens=self.seq_lens[:r],
            block_table=self.block_table[:r],
            slot_mapping=self.slot_mapping[:n],
            max_query_len=desc.query_len,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=[min(i * desc.query_len, n) for i in range(r + 1)],
            seq_lens_cpu=[self.max_model_len] * r,
            block_size=self.block_size,
        )

    def fill(
        self,
        desc: BatchDescriptor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        """Copy a real batch (unpadded tensors) into the buffers and pad it to `desc`."""
        n, r = md.num_actual_tokens, md.num_reqs
        pad_n, pad_r = desc.num_tokens, desc.num_reqs
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping[:n], non_blocking=True)
        self.seq_lens[:r].copy_(md.seq_lens[:r], non_blocking=True)
        self.query_start_loc[: r + 1].copy_(md.query_start_loc[: r + 1], non_blocking=True)
        width = md.block_table.shape[1]
        self.block_table[:r, :width].copy_(md.block_table[:r], non_blocking=True)
        if pad_n > n:
            self.input_ids[n:pad_n].zero_()
            self.positions[n:pad_n].zero_()
            self.slot_mapping[n:pad_n].fill_(-1)
        if pad_r > r:
            self.seq_lens[r:pad_r].zero_()
            self.query_start_loc[r + 1 : pad_r + 1].fill_(n)


ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class CudaGraphRunner:
    """Captures one graph per `BatchDescriptor` and replays it for matching batches."""

    def __init__(
        self,
        forward: ModelForward,
        backend: AttentionBackend,
        dispatcher: CudaGraphDispatcher,
        buffers: GraphInputBuffers,
    ) -> None:
        self.forward = forward
        self.backend = backend
        self.dispatcher = dispatcher
        self.buffers = buffers
        self.graphs: dict[BatchDescriptor, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.metadata: dict[BatchDescriptor, AttentionMetadata] = {}
        self.pool = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        for desc in self.dispatcher.descriptors():
            self._capture(desc)
        logger.info("captured %d CUDA graphs", len(self.graphs))

    def _capture(self, desc: BatchDescriptor) -> None:
        buffers = self.buffers
        md = buffers.metadata(desc)
        # Nothing real to attend to: every request empty, every token padding.
        buffers.seq_lens.zero_()
        buffers.query_start_loc.zero_()
        buffers.slot_mapping.fill_(-1)
        ids, pos = buffers.input_ids[: desc.num_tokens], buffers.positions[: desc.num_tokens]
        self.backend.plan(md)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside capture
                self.forward(ids, pos, md)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(ids, pos, md)
        self.graphs[desc] = (graph, out)
        self.metadata[desc] = md

    def run(
        self,
        desc: BatchDescriptor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_actual_tokens, hidden] for a batch `dispatch` mapped to desc."""
        graph, out = self.graphs[desc]
        self.buffers.fill(desc, input_ids, positions, md)
        graph.replay()
        return out[: md.num_actual_tokens]


def capture_model_graphs(runner: ModelRunner, max_blocks_per_req: int) -> CudaGraphRunner | None:
    """Full-model graphs for uniform decode (and K + 1 verify) batches; only with a
    backend whose forward is graph-safe (no host reads of per-step values)."""
    if not getattr(runner.backend, "cuda_graph_safe", False):
        logger.info("CUDA graphs off: the %s attention backend is eager-only", runner.backend)
        return None
    if runner.recurrent_layers:
        # The graphs' input buffers carry no recurrent-state metadata.
        logger.info("CUDA graphs off: hybrid models with recurrent state run eagerly")
        return None
    sched = runner.config.scheduler
    sizes = cuda_graph_batch_sizes(sched.max_num_seqs)
    dispatcher = CudaGraphDispatcher(sizes)
    if runner.config.speculative is not None:
        dispatcher.add_query_len(runner.config.speculative.num_speculative_tokens + 1)
    buffers = GraphInputBuffers(
        sched.max_num_seqs,
        sizes[-1] * max(dispatcher.query_lens),
        max_blocks_per_req,
        runner.block_size,
        runner.max_model_len,
        runner.device,
    )
    graphs = CudaGraphRunner(runner.model, runner.backend, dispatcher, buffers)
    graphs.capture_all()
    return graphs
