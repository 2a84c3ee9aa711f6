"""Token-budget scheduler: continuous batching, chunked prefill, preemption by recompute.

There are no prefill or decode phases. Each step hands out one token budget: running
requests first (in arrival order), then waiting ones (FCFS). A request simply asks for the
tokens it has not computed yet, so a long prompt is prefilled in chunks across steps while
other requests keep decoding. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed and it re-enters the front of the queue to recompute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.config import SchedulerConfig
from tinyvllm.core.chunk_bounds import round_hit, shape_chunk
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tinyvllm.request import Request, RequestStatus


@dataclass
class RequestUpdate:
    """What one step produced for one request, for the engine's output processing."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queue sizes at one moment (`Scheduler.stats()`)."""

    num_running: int
    num_waiting: int
    num_preempted_waiting: int  # of the waiting ones, preempted and queued to resume
    total_preemptions: int


@dataclass
class _StepPlan:
    """What one `schedule()` call has handed out so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    # Hashes of full blocks whose KV this step computes: a waiting request whose next
    # uncached block is among them waits one step and then reads it from the cache,
    # instead of computing the same prefix alongside. Hybrid models: only the blocks whose
    # state this step snapshots (`KVCacheManager.waits_for_inflight`).
    inflight: set[bytes] = field(default_factory=set)
    # Hybrid models: request -> snapshot slot for its state after this step.
    snapshots: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if self.config.atomic_mm_spans:
            budget = self.config.max_num_batched_tokens
            for f in request.mm_features:
                if f.length > budget:
                    raise ValueError(
                        f"an {f.modality} of the prompt takes {f.length} tokens, more than "
                        f"max_num_batched_tokens={budget}; its tokens must run in one step "
                        f"(bidirectional attention), so raise max_num_batched_tokens to at "
                        f"least {f.length}"
                    )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop string, abort, error) requests wherever they are; frees their blocks."""
        finished = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        """Safe from another thread: it copies the queue before reading it."""
        waiting = list(self.waiting)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(waiting),
            num_preempted_waiting=sum(r.status == RequestStatus.PREEMPTED for r in waiting),
            total_preemptions=self.num_preemptions,
        )

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.end_step()
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:  # a step that had to preempt admits no one
            self._schedule_waiting(plan)
        for rid, n in plan.num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            scheduled_spec_decode_tokens=plan.spec_tokens,
            finished_req_ids=self._finished_since_last_step,
            preempted_req_ids=plan.preempted,
            state_snapshots=plan.snapshots,
        )
        self._finished_since_last_step = set()
        return out

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests first, in order; preempt from the back when blocks run out."""
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            # A streaming-input request whose input has not arrived yet is skipped (parked).
            num_new = min(request.num_schedulable_tokens - request.num_computed_tokens, plan.budget)
            num_new = shape_chunk(self.kv, request, num_new, self.config.atomic_mm_spans)
            if num_new <= 0:
                i += 1
                continue
            if request.spec_token_ids:
                # Draft tokens beyond the budget are dropped, not postponed.
                num_spec = max(0, request.num_computed_tokens + num_new - request.num_tokens)
                del request.spec_token_ids[num_spec:]
            new_blocks = self._allocate_or_preempt(request, num_new, plan.preempted)
            if new_blocks is None:
                break
            plan.cached.req_ids.append(request.request_id)
            plan.cached.new_block_ids.append(new_blocks)
            plan.cached.num_computed_tokens.append(request.num_computed_tokens)
            self._send_appended_input(request, plan.cached)
            if request.spec_token_ids:
                plan.spec_tokens[request.request_id] = list(request.spec_token_ids)
            self._take(plan, request, num_new)
            i += 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: set[str]
    ) -> list[int] | None:
        """Blocks for `num_new` more tokens of a running request, preempting the most recently
        admitted requests until they fit; None once `request` itself had to go."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, self._lookahead(request, num_new))
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Then waiting requests, first come first served, while budget and seats last."""
        parked: list[Request] = []
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.waiting[0].num_schedulable_tokens <= 0:
                # Streaming input that has not arrived: the requests behind it go first.
                parked.append(self.waiting.popleft())
            elif not self._admit(self.waiting[0], plan):
                break
        self.waiting.extendleft(reversed(parked))

    def _admit(self, request: Request, plan: _StepPlan) -> bool:
        """Schedule the head of the waiting queue (a chunk of it with chunked prefill); False,
        leaving it waiting, when its prefix is being computed this step or it does not fit."""
        hits: list[int] = []
        if request.num_computed_tokens == 0:
            hits, request.num_computed_tokens = self.kv.get_computed_blocks(request)
            hits = round_hit(request, hits, self.kv.block_size, self.config.atomic_mm_spans)
            request.num_cached_tokens = request.num_computed_tokens
            if self.kv.waits_for_inflight(request, len(hits), plan.inflight):
                request.num_computed_tokens = 0
                return False
        num_new = request.num_schedulable_tokens - request.num_computed_tokens
        if num_new > plan.budget:
            if not self.config.enable_chunked_prefill:
                request.num_computed_tokens = 0
                return False
            num_new = plan.budget
        num_new = shape_chunk(self.kv, request, num_new, self.config.atomic_mm_spans)
        if num_new <= 0:  # the next image span waits for a step with room for all of it
            request.num_computed_tokens = 0
            return False
        new_blocks = self.kv.allocate_slots(
            request, num_new, self._lookahead(request, num_new), computed_blocks=hits
        )
        if new_blocks is None:
            # Look the cache up again next time: its content may have changed by then.
            request.num_computed_tokens = 0
            return False
        self.waiting.popleft()
        self.kv.record_lookup(request, request.num_cached_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        state_slot, restore_slot = self.kv.state_slots(request)
        # Copies: a streaming-input request's prompt and media keep growing.
        request.num_runner_prompt_tokens = request.num_prompt_tokens
        plan.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=list(self.kv.get_block_ids(request.request_id)),
                num_computed_tokens=request.num_computed_tokens,
                eos_token_id=request.eos_token_id,
                state_slot=state_slot,
                restore_state_slot=restore_slot,
                mm_features=list(request.mm_features),
            )
        )
        self._take(plan, request, num_new)
        return True

    @staticmethod
    def _send_appended_input(request: Request, cached: CachedRequestData) -> None:
        """Streaming input: the prompt tokens the runner's copy of `request` lacks."""
        if request.num_runner_prompt_tokens < request.num_prompt_tokens:
            new = request.prompt_token_ids[request.num_runner_prompt_tokens :]
            cached.appended_prompt_ids[request.request_id] = new
            request.num_runner_prompt_tokens = request.num_prompt_tokens

    def _take(self, plan: _StepPlan, request: Request, num_new: int) -> None:
        plan.num_scheduled[request.request_id] = num_new
        end = request.num_computed_tokens + num_new
        snapshot = self.kv.plan_snapshot(request, end)
        if snapshot is not None:
            plan.snapshots[request.request_id] = snapshot
            plan.inflight.add(self.kv.block_hashes(request, end)[-1])
        elif self.kv.states is None:
            self._note_inflight_blocks(request, num_new, plan.inflight)
        plan.budget -= num_new

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, apply token-level stop conditions, free finished requests."""
        updates = []
        for rid, token_ids in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            request = self.requests.get(rid)
            if request is None:
                continue  # aborted meanwhile
            request.spec_token_ids = []
            if not token_ids:  # a partial prefill chunk: its finished blocks are now cacheable
                self.kv.cache_computed_blocks(request)
                continue
            accepted: list[int] = []
            for token in token_ids:
                request.output_token_ids.append(token)
                accepted.append(token)
                if self._check_stop(request, token):
                    break
            # Tokens rejected from a speculative run are recomputed later.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            self.kv.cache_computed_blocks(request)
            finished = request.status.is_finished
            if finished:
                self.running.remove(request)
                del self.requests[rid]
                self._release(request)
            else:
                self._set_drafts(request, runner_output.draft_token_ids.get(rid))
            updates.append(RequestUpdate(request, accepted, finished))
        return updates

    # ---- internals ------------------------------------------------------------------------
    def _note_inflight_blocks(self, request: Request, num_new: int, inflight: set[bytes]) -> None:
        if not self.kv.enable_caching:
            return
        block_size = self.kv.block_size
        start = request.num_computed_tokens // block_size
        end = min(request.num_computed_tokens + num_new, request.num_tokens) // block_size
        if end > start:
            inflight.update(self.kv.block_hashes(request, end * block_size)[start:end])

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            if token != request.eos_token_id or params.ignore_eos:
                request.stop_reason = token
            return True
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Lookahead slots, never past max_model_len (drafts stop there anyway)."""
        room = self.config.max_model_len - request.num_computed_tokens - num_new
        return max(0, min(self.config.num_lookahead_tokens, room))

    def _set_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """Keep the drafts that can still become output: none past max_tokens (the bonus
        token is one more) or max_model_len."""
        if not drafts:
            return
        room = min(
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens,
        )
        request.spec_token_ids = list(drafts[: max(room, 0)])

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self._finished_since_last_step.add(request.request_id)
