"""CUDA-graph bucketing and padding, checked on the CPU (capture/replay: tests/gpu)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.runner.cuda_graphs import (
    BatchDescriptor,
    CudaGraphDispatcher,
    GraphInputBuffers,
    cuda_graph_batch_sizes,
)


def test_batch_sizes() -> None:
    sizes = cuda_graph_batch_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert 256 in sizes and 264 not in sizes and 272 in sizes and 288 in sizes
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_batch_sizes(1) == [1]


def test_dispatch_pads_uniform_batches_and_rejects_mixed_ones() -> None:
    d = CudaGraphDispatcher(cuda_graph_batch_sizes(64))
    assert d.dispatch(1, 1, 1) == BatchDescriptor(1, 1)
    assert d.dispatch(3, 3, 1) == BatchDescriptor(4, 1)
    assert d.dispatch(9, 9, 1) == BatchDescriptor(16, 1)
    assert d.dispatch(64, 64, 1) == BatchDescriptor(64, 1)
    assert d.dispatch(65, 65, 1) is None  # beyond the largest graph
    assert d.dispatch(3, 7, 5) is None  # mixed query lengths
    assert d.dispatch(2, 10, 5) is None  # uniform, but K + 1 = 5 was not captured
    d.add_query_len(5)
    assert d.dispatch(2, 10, 5) == BatchDescriptor(10, 5)
    assert d.dispatch(3, 15, 5) == BatchDescriptor(20, 5)
    assert d.dispatch(0, 0, 0) is None
    descs = d.descriptors()
    assert descs == sorted(descs, reverse=True)
    assert {x.query_len for x in descs} == {1, 5}
    assert all(x.num_tokens % x.query_len == 0 for x in descs)


def _metadata(qsl: list[int], seq_lens: list[int], blocks: list[list[int]]) -> AttentionMetadata:
    n = qsl[-1]
    bt = torch.tensor(blocks, dtype=torch.int32)
    slots = torch.arange(100, 100 + n)
    return AttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=n,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=bt,
        slot_mapping=slots,
        max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=4,
    )


def test_buffers_fill_and_pad_in_place() -> None:
    buffers = GraphInputBuffers(8, 16, 6, 4, 24, torch.device("cpu"))
    # A larger batch first leaves stale values that padding must overwrite.
    big = _metadata([0, 2, 4, 6, 8], [5, 6, 7, 8], [[1, 2]] * 4)
    buffers.fill(BatchDescriptor(8, 2), torch.arange(8) + 1, torch.arange(8), big)
    md = _metadata([0, 2, 4], [9, 3], [[3, 4, 5], [6, 0, 0]])
    desc = BatchDescriptor(8, 2)
    ids = torch.tensor([11, 12, 13, 14])
    pos = torch.tensor([7, 8, 1, 2])
    view = buffers.metadata(desc)
    data_ptrs = [t.data_ptr() for t in (view.query_start_loc, view.seq_lens, view.slot_mapping)]
    buffers.fill(desc, ids, pos, md)
    # The graph's views still point at the same memory, now holding this batch.
    assert [t.data_ptr() for t in (view.query_start_loc, view.seq_lens, view.slot_mapping)] == (
        data_ptrs
    )
    assert buffers.input_ids[:8].tolist() == [11, 12, 13, 14, 0, 0, 0, 0]
    assert buffers.positions[:8].tolist() == [7, 8, 1, 2, 0, 0, 0, 0]
    assert view.slot_mapping.tolist() == [100, 101, 102, 103, -1, -1, -1, -1]
    assert view.seq_lens.tolist() == [9, 3, 0, 0]
    qsl = view.query_start_loc.tolist()
    assert qsl == [0, 2, 4, 4, 4]
    assert all(a <= b for a, b in itertools.pairwise(qsl))
    assert view.block_table[:2, :3].tolist() == [[3, 4, 5], [6, 0, 0]]
    assert view.max_query_len == 2 and view.max_seq_len == 24 and view.num_reqs == 4


@pytest.mark.parametrize("max_num_seqs", [3, 64, 300])
def test_every_decode_batch_up_to_max_num_seqs_has_a_graph(max_num_seqs: int) -> None:
    d = CudaGraphDispatcher(cuda_graph_batch_sizes(max_num_seqs))
    for b in range(1, max_num_seqs + 1):
        desc = d.dispatch(b, b, 1)
        assert desc is not None and b <= desc.num_reqs <= max_num_seqs


def test_device_side_positions_and_slots_match_the_host_path() -> None:
    """The GPU input path (per-token values computed on the device) run on the CPU."""
    from tinyvllm import SamplingParams
    from tinyvllm.core.outputs import NewRequestData
    from tinyvllm.runner.input_batch import prepare_inputs
    from tinyvllm.runner.states import RequestStates

    states = RequestStates(8, 129, 8, 1000)
    gen = torch.Generator().manual_seed(0)
    req_ids, sched = [], []
    for i, (n, done) in enumerate([(40, 0), (70, 64), (5, 4), (100, 37)]):
        blocks = torch.randperm(40, generator=gen)[: -(-n // 16)].tolist()
        prompt = torch.randint(0, 999, (n,), generator=gen).tolist()
        states.add(NewRequestData(f"r{i}", prompt, [], SamplingParams(), blocks, done, None))
        req_ids.append(f"r{i}")
        sched.append(n - done)
    cpu = torch.device("cpu")
    host = prepare_inputs(states, req_ids, sched, 16, cpu, device_side=False)
    dev = prepare_inputs(states, req_ids, sched, 16, cpu, device_side=True)
    assert torch.equal(host.positions, dev.positions)
    assert torch.equal(host.attn_metadata.slot_mapping, dev.attn_metadata.slot_mapping)
    assert torch.equal(host.input_ids, dev.input_ids)
    assert torch.equal(host.attn_metadata.block_table, dev.attn_metadata.block_table)
