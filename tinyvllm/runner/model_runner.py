"""ModelRunner: executes one SchedulerOutput and returns the sampled tokens.

The runner never decides policy: it applies the scheduler's decisions to its persistent
request rows, builds the flattened batch, runs the model once and samples. This module holds
only what every model kind shares; what differs per kind (rotary positions, per-request state
beside the paged KV, extra attention metadata, work around the forward) lives in the model
state that the registry's `state_kind` selects (`runner/model_states/`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from tinyvllm.config import EngineConfig
from tinyvllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from tinyvllm.models.loader import module_bytes
from tinyvllm.models.registry import resolve_architecture
from tinyvllm.platforms import Platform
from tinyvllm.runner.cuda_graphs import (
    CudaGraphRunner,
    capture_model_graphs,
)
from tinyvllm.runner.decode_logits import DecodeLogits
from tinyvllm.runner.draft_model import DraftModelProposer, load_draft_model
from tinyvllm.runner.input_batch import InputBatch, prepare_inputs
from tinyvllm.runner.kv_cache import (
    KVCacheSize,
    allocate_kv_caches,
    allocate_state_tensors,
    apply_ssm_cache_dtype,
    determine_num_blocks,
)
from tinyvllm.runner.loading import load_target_model
from tinyvllm.runner.memory_profile import profile_peak_bytes
from tinyvllm.runner.model_states import ModelInputs, ModelState, create_model_state
from tinyvllm.runner.sampling import (
    build_sampling_metadata,
    finite_rows,
    greedy_tokens,
    logprobs_to_lists,
)
from tinyvllm.runner.speculator import Speculator
from tinyvllm.runner.states import RequestStates
from tinyvllm.sample.logprobs import compute_token_logprobs
from tinyvllm.sample.sampler import Sampler

if TYPE_CHECKING:
    from tinyvllm.native.llama_decode import LlamaDecodeProgram

logger = logging.getLogger(__name__)

# Steps of at most this many tokens run torch single-threaded when the layers' heavy work is
# native (their GEMVs have their own thread pool), as the decode program's steps do.
NATIVE_STEP_TOKENS = 16

NON_FINITE_LOGITS = (
    "the model's logits were not finite (NaN or inf), likely from NaN/inf weights or a value "
    "that overflows the model's dtype; the output would be meaningless"
)


class ModelRunner:
    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        mc = config.model
        self.block_size = config.cache.block_size
        # Every device-specific kernel choice is made here, once (see tinyvllm/platforms/).
        self.platform: Platform
        self.platform, self.model = load_target_model(config, dtype, device)
        self.weight_bytes = module_bytes(self.model)
        state_kind = resolve_architecture(mc.hf_config)[1].state_kind
        self.model_state: ModelState = create_model_state(
            state_kind, self.model, config.scheduler.max_num_seqs, device, mc.video_pruning_rate
        )
        self.layers = self.model.attention_layers()
        # Hybrid models' mixer layers with per-request recurrent state (empty: none).
        self.recurrent_layers = list(getattr(self.model, "recurrent_layers", list)())
        apply_ssm_cache_dtype(self.recurrent_layers, config.cache.mamba_ssm_cache_dtype)
        self.backend = self.platform.attention_backend(config.device.attention_backend)
        self.draft: DraftModelProposer | None = None
        kv_layers = list(self.layers)
        spec = config.speculative
        if spec is not None and self.recurrent_layers:
            raise ValueError(
                f"speculative decoding is not supported for {mc.model!r}: its recurrent "
                "(short-conv / Mamba) layers cannot roll back rejected draft tokens; "
                "drop speculative_config"
            )
        if spec is not None and spec.method == "draft_model":
            draft_model = load_draft_model(
                spec.model,
                mc.hf_config,
                dtype,
                device,
                mc.max_model_len,
                mc.requested_quantization,
                self.platform.quant_kernels,
            )
            self.platform.prepare_model(draft_model)
            self.draft = DraftModelProposer(draft_model, self.block_size)
            # The draft's KV shares the target's blocks, so each block costs both.
            kv_layers += self.draft.attention_layers()

        self.kv_layers = kv_layers
        # Set by initialize_kv_cache, which must run before the first step.
        self.max_model_len = mc.max_model_len
        self.kv_caches: list[torch.Tensor] = []
        self.decode_program: LlamaDecodeProgram | None = None
        self._program_step = False  # whether the step in progress runs on the program
        self.cuda_graphs: CudaGraphRunner | None = None
        self.speculator: Speculator | None = None
        self.sampler = Sampler()
        # Sampled rows' logits into persistent buffers (GGUF Llama-family heads on CPU).
        self.decode_logits = DecodeLogits.build(self.model) if device.type == "cpu" else None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(mc.seed)

    def initialize_kv_cache(self) -> KVCacheSize:
        """Size and allocate the paged KV cache, then build what depends on it (request rows,
        CUDA graphs, the native decode program). Returns the size chosen: the engine sizes its
        block pool and max_model_len from it."""
        config, mc = self.config, self.config.model
        size = determine_num_blocks(
            config.cache,
            self.kv_layers,
            self.dtype,
            self.device,
            mc.max_model_len,
            config.scheduler.max_num_seqs,
            profile_peak_bytes=(
                functools.partial(profile_peak_bytes, self) if self.device.type == "cuda" else None
            ),
            may_shrink_max_model_len=not mc.max_model_len_explicit,
            recurrent_layers=self.recurrent_layers,
            cache_state_snapshots=config.cache.caches_state_snapshots,
            may_cap_max_num_seqs=not config.scheduler.max_num_seqs_explicit,
        )
        self.max_model_len = max_model_len = size.max_model_len
        self.kv_caches = allocate_kv_caches(
            self.kv_layers, self.backend, size.num_blocks, self.block_size, self.dtype, self.device
        )
        allocate_state_tensors(
            self.recurrent_layers,
            size.num_running_states + size.num_snapshot_states,
            self.device,
        )
        # Built after the KV caches exist: the program points into them. Both fast paths
        # take flat positions only.
        flat = self.model_state.flat_positions
        self.decode_program = self.platform.decode_program(self.model) if flat else None
        max_blocks_per_req = -(-max_model_len // self.block_size)
        if self.platform.uses_cuda_graphs and flat:
            self.cuda_graphs = capture_model_graphs(self, max_blocks_per_req)
        # One spare column so the token sampled at max_model_len has somewhere to go.
        self.states = RequestStates(
            config.scheduler.max_num_seqs, max_model_len + 1, max_blocks_per_req, mc.vocab_size
        )
        if config.speculative is not None:
            self.speculator = Speculator(
                config.speculative, max_model_len, self.draft, self.backend, self.device
            )
        return size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Inference mode entered here only where the caller does not hold it already
        # (LLM.generate holds it across its steps: entering it costs ~30 us a decode step once
        # the weights have streamed through the caches).
        if torch.is_inference_mode_enabled():
            return self._platform_step(sched)
        with torch.inference_mode():
            return self._platform_step(sched)

    def _platform_step(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        program = self.decode_program
        num_tokens = sched.total_num_scheduled_tokens
        if program is not None:
            # Where torch's bf16 GEMMs are fast the platform may send a step the program
            # supports to the layers instead (measured per row count: decode_route.py).
            native_step = program.supports(num_tokens) and self.platform.routes_to_program(
                num_tokens
            )
        else:  # models without a program (hybrids): decode-sized steps on native layer ops
            native_step = self.platform.native_layer_ops and num_tokens <= NATIVE_STEP_TOKENS
        self._program_step = program is not None and native_step
        self.platform.start_step(num_tokens, native_step)
        try:
            return self._execute_model(sched)
        finally:
            self.platform.finish_step()

    def _execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        states = self.states
        self.model_state.begin_step(sched)
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            row = states.req_id_to_row.get(req_id)
            if row is not None:
                states.remove(req_id)
                self.model_state.remove_request(row)
        failed = self._add_requests(sched)
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = states.req_id_to_row[req_id]
            states.append_blocks(row, block_ids)
            states.np_num_computed_tokens[row] = num_computed
        for req_id, token_ids in cached.appended_prompt_ids.items():  # streaming input
            states.append_prompt_tokens(states.req_id_to_row[req_id], token_ids)
        scheduled = {r: n for r, n in sched.num_scheduled_tokens.items() if r not in failed}
        if not scheduled:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed=failed)

        req_ids = list(scheduled)
        drafts = sched.scheduled_spec_decode_tokens
        if drafts:
            Speculator.write_drafts(states, drafts)
        num_scheduled = list(scheduled.values())
        batch = prepare_inputs(states, req_ids, num_scheduled, self.block_size, self.device)
        hidden = self._forward(batch)
        if self.draft is not None:
            self.draft.follow_batch(batch)

        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list | None = None
        spec_counts: dict[str, tuple[int, int]] = {}
        if drafts and batch.sample_list:
            sampled, logprobs, spec_counts = self._verify(batch, hidden, drafts)
        elif batch.sample_list:
            sampled, logprobs = self._sample(batch, hidden)
        computed = states.np_num_computed_tokens
        for row, n in zip(batch.row_list, num_scheduled, strict=True):
            computed[row] += n
        for i, rid in enumerate(req_ids):
            if sampled[i] and sampled[i][0] < 0:  # its logits were not finite
                failed[rid] = NON_FINITE_LOGITS
                sampled[i] = []
        proposals: dict[str, list[int]] = {}
        spec_k: int | None = None
        if self.speculator is not None and batch.sample_list:
            sample_idx = [i for i in batch.sample_list if req_ids[i] not in failed]
            proposals = self.speculator.propose(
                states, [req_ids[i] for i in sample_idx], batch.rows[sample_idx]
            )
            spec_k = self.speculator.current_k
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            draft_token_ids=proposals,
            spec_counts=spec_counts,
            num_speculative_tokens=spec_k,
            failed=failed,
        )

    def _add_requests(self, sched: SchedulerOutput) -> dict[str, str]:
        """Give the step's new requests their rows; one whose values cannot be stored fails
        alone (request id -> why) instead of failing the whole step."""
        failed: dict[str, str] = {}
        for new in sched.scheduled_new_reqs:
            row: int | None = None
            try:
                row = self.states.add(new)
                self.model_state.add_request(row, new)
            except Exception as exc:
                self.states.remove(new.req_id)  # when add itself failed it took no row
                if row is not None:  # the model state may hold part of it
                    self.model_state.remove_request(row)
                logger.warning("request %s cannot join the batch: %s", new.req_id, exc)
                failed[new.req_id] = (
                    f"the request's values cannot be stored by the model runner: "
                    f"{type(exc).__name__}: {exc}"
                )
        return failed

    def _sample(
        self, batch: InputBatch, hidden: torch.Tensor
    ) -> tuple[list[list[int]], list | None]:
        """One token per sampling request; -1 for a request whose logits are not finite."""
        states = self.states
        sample_idx = batch.sample_list
        # A step whose every token samples (decode) needs no gather of the hidden rows: its
        # logits indices are 0..T-1 (see prepare_inputs).
        every = len(sample_idx) == hidden.shape[0]
        sampled_hidden = hidden if every else hidden[batch.logits_indices]
        logits = None if self.decode_logits is None else self.decode_logits(sampled_hidden)
        if logits is None:
            logits = self.model.compute_logits(sampled_hidden)
        if len(sample_idx) == batch.num_reqs:
            sample_rows, row_list = batch.rows, batch.row_list
        else:
            sample_rows = batch.rows[batch.sample_idx]
            row_list = [batch.row_list[i] for i in sample_idx]
        metadata = build_sampling_metadata(states, sample_rows, self.generator)
        tokens = greedy_tokens(logits, metadata)
        out = None
        if tokens is None:
            out = self.sampler(logits, metadata)
            tokens = out.sampled_token_ids.tolist()
            for i, ok in enumerate(finite_rows(logits, tokens, metadata)):
                if not ok:
                    tokens[i] = -1
        self._append_tokens(row_list, tokens)
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        for i, tok in zip(sample_idx, tokens, strict=True):
            sampled[i] = [tok]
        logprobs: list | None = None
        if out is not None and out.logprobs is not None:
            logprobs = [None] * len(batch.req_ids)
            per_row = logprobs_to_lists(out.logprobs, [states.num_logprobs[r] for r in row_list])
            for i, lp in zip(sample_idx, per_row, strict=True):
                logprobs[i] = None if lp is None else [lp]
        return sampled, logprobs

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        inputs = self.model_state.model_inputs(batch)
        self.model_state.pre_forward(batch, inputs)
        hidden = self._run_model(inputs)
        self.model_state.post_forward(batch, hidden)
        return hidden

    def _run_model(self, inputs: ModelInputs) -> torch.Tensor:
        md = inputs.attn_metadata
        graphs = self.cuda_graphs
        # The fast paths embed the ids themselves and attend causally only.
        if inputs.inputs_embeds is not None or md.bidirectional_ranges is not None:
            graphs = program = None
        else:
            program = self.decode_program
        if graphs is not None:
            desc = graphs.dispatcher.dispatch(md.num_reqs, md.num_actual_tokens, md.max_query_len)
            if desc is not None:
                return graphs.run(desc, inputs.input_ids, inputs.positions, md)
        if program is not None and self._program_step:
            if self.draft is not None:  # the draft model runs its layers on this plan
                self.backend.plan(md)
            return program.run(
                inputs.input_ids, inputs.positions, md.slot_mapping, md.query_start_loc,
                md.block_table, md.recurrent,
            )  # fmt: skip
        self.backend.plan(md)
        if inputs.inputs_embeds is not None:
            return self.model(inputs.input_ids, inputs.positions, md, inputs.inputs_embeds)
        return self.model(inputs.input_ids, inputs.positions, md)

    def _verify(
        self, batch: InputBatch, hidden: torch.Tensor, drafts: dict[str, list[int]]
    ) -> tuple[list[list[int]], list | None, dict[str, tuple[int, int]]]:
        """Sampling when some requests carry drafts: the target's K_i + 1 logits per request
        go through the rejection sampler (K_i = 0 rows sample as usual)."""
        assert self.speculator is not None
        sample_idx = batch.sample_idx.tolist()
        req_drafts = [drafts.get(batch.req_ids[i], []) for i in sample_idx]
        query_end = torch.tensor(batch.attn_metadata.query_start_loc_cpu[1:])[batch.sample_idx]
        num_drafts = torch.tensor([len(d) for d in req_drafts], dtype=torch.int64)
        indices = Speculator.logits_indices(query_end, num_drafts, hidden.device)
        logits = self.model.compute_logits(hidden[indices])
        rows = batch.rows[batch.sample_idx]
        result = self.speculator.verify(self.states, rows, logits, req_drafts, self.generator)
        # A request fails if any of its K + 1 positions has non-finite logits (see _sample).
        bad = (~torch.isfinite(logits.amax(dim=-1))).to("cpu", torch.int64)
        request_of = torch.repeat_interleave(torch.arange(len(sample_idx)), num_drafts + 1)
        bad_requests = torch.zeros(len(sample_idx), dtype=torch.int64).index_add_(
            0, request_of, bad
        )
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list | None = None if result.logprobs is None else [None] * len(batch.req_ids)
        spec_counts: dict[str, tuple[int, int]] = {}
        for j, i in enumerate(sample_idx):
            sampled[i] = [-1] if bad_requests[j] else result.tokens[j]
            if req_drafts[j]:
                spec_counts[batch.req_ids[i]] = (len(req_drafts[j]), len(result.tokens[j]) - 1)
            if logprobs is not None and result.logprobs is not None:
                entries = result.logprobs[j]
                logprobs[i] = None if entries[0] is None else entries
        return sampled, logprobs, spec_counts

    def _append_tokens(self, rows: list[int], tokens: list[int]) -> None:
        # Scalar writes to the numpy views (a decode step's few rows; see _prepare_decode).
        token_ids, num_tokens = self.states.np_token_ids, self.states.np_num_tokens
        for row, token in zip(rows, tokens, strict=True):
            pos = num_tokens[row]
            token_ids[row, pos] = token
            num_tokens[row] = pos + 1

    def _prompt_logprobs(
        self, batch: InputBatch, hidden: torch.Tensor
    ) -> dict[str, list[tuple[list[int], list[float], int]]]:
        """Logprobs of each prompt token given its prefix, for requests that asked for them."""
        states = self.states
        result: dict[str, list[tuple[list[int], list[float], int]]] = {}
        qsl = batch.attn_metadata.query_start_loc_cpu
        for i, row in enumerate(batch.row_list):
            n = states.num_prompt_logprobs[row]
            if n is None:
                continue
            req_id = batch.req_ids[i]
            start = int(states.num_computed_tokens[row])
            num_prompt = int(states.num_prompt_tokens[row])
            # Position p predicts token p + 1; only positions whose next token is in the prompt.
            end = min(start + qsl[i + 1] - qsl[i], num_prompt - 1)
            if end <= start:
                continue
            logits = self.model.compute_logits(hidden[qsl[i] : qsl[i] + end - start])
            targets = states.token_ids[row, start + 1 : end + 1].to(self.device)
            lp = compute_token_logprobs(logits, targets, n)
            result[req_id] = logprobs_to_lists(lp, [n] * (end - start))
        return result
