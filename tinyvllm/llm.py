"""LLM: the offline batch API, shaped like vLLM's `vllm.LLM`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tinyvllm.config import EngineArgs
from tinyvllm.engine.engine import PromptType, check_text
from tinyvllm.engine.factory import create_engine
from tinyvllm.outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.stats import EngineStats
from tinyvllm.utils.content_parts import PLACEHOLDERS, split_content_parts

logger = logging.getLogger(__name__)

ChatMessages = list[dict[str, Any]]


class LLM:
    """Load a model once, then generate for batches of prompts.

    >>> llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=2048)
    >>> out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    >>> print(out[0].outputs[0].text)
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.engine = create_engine(self.engine_args)
        self._request_counter = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts; outputs come back in the prompts' order."""
        if self.engine.runner_type != "generate":
            raise ValueError(
                f"generate() needs a generative model, but {self.engine_args.model!r} runs as a "
                "pooling model (runner='pooling'): use embed() or encode(), or pass "
                "runner='generate' for a model that can generate"
            )
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        finals = []
        for params in params_list:
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY
            finals.append(params)
        return self._run(self._add_all(prompts, finals), use_tqdm)

    def _add_all(
        self, prompts: list[PromptType], params_list: Sequence[SamplingParams | PoolingParams]
    ) -> list[str]:
        """Queue every prompt (none of them if one is bad: ValueError naming its index)."""
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = str(self._request_counter)
                self._request_counter += 1
                try:
                    self.engine.add_request(rid, prompt, params)  # type: ignore[arg-type]
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from exc
                request_ids.append(rid)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return request_ids

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate.

        A message's content may be a list of OpenAI-style parts: `{"type": "text", ...}`,
        `{"type": "image_url", "image_url": {"url": PATH_OR_FILE_URL}}`, `video_url`
        likewise, or in-memory `{"type": "image", "image": array_or_pil}` /
        `{"type": "video", "video": frames}` for vision-language models."""
        # Here, not at the top: jinja2 is for chat only (~25 ms of every `import tinyvllm`).
        from tinyvllm.utils.chat_template import render_chat_template

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "this tokenizer has no chat template; pass chat_template=... or use generate()"
            )
        prompts: list[PromptType] = []
        for conv in conversations:
            # Content parts (text / image_url / video_url) -> text with placeholders + media.
            conv, media = split_content_parts(conv, self.placeholders())
            text = render_chat_template(
                tokenizer,
                conv,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            ids = tokenizer.encode(check_text(text, "the chat"), add_special_tokens=False)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if media:
                prompt["multi_modal_data"] = media
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def placeholders(self) -> Mapping[str, str]:
        """The model's text for one image / video in a chat message."""
        processor = getattr(self.engine, "mm_processor", None)
        return getattr(processor, "placeholders", PLACEHOLDERS)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        normalize: bool | None = None,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`out.outputs.embedding`), in the prompts' order.

        Needs a pooling model: `LLM(model, runner="pooling")`, or an encoder / a
        sentence-transformers checkpoint (detected). `truncate_prompt_tokens` keeps that many
        tokens (-1: max_model_len); without it a longer prompt is an error. `normalize`
        overrides the model's pooler (None: as the checkpoint says).
        """
        params = _pooling_params(
            pooling_params,
            task="embed",
            truncate_prompt_tokens=truncate_prompt_tokens,
            normalize=normalize,
        )
        outputs = self._pool(prompts, params, use_tqdm, "embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        pooling_task: str = "token_embed",
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Per prompt, `out.outputs.data`: every token's last hidden state [tokens, hidden]
        (pooling_task="token_embed", not normalized unless pooling_params say so), or the
        pooled embedding (pooling_task="embed")."""
        task = pooling_params.task if pooling_params is not None else None
        params = _pooling_params(
            pooling_params, task=task or pooling_task, truncate_prompt_tokens=truncate_prompt_tokens
        )
        return self._pool(prompts, params, use_tqdm, "encode")

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: PoolingParams,
        use_tqdm: bool,
        what: str,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        if self.engine.runner_type != "pooling":
            raise ValueError(
                f"{what}() needs a pooling model, but {self.engine_args.model!r} runs as a "
                f"generative model here; create it with runner='pooling' (LLM("
                f"{self.engine_args.model!r}, runner='pooling')) to pool its hidden states"
            )
        prompt_list = _prompt_list(prompts)
        outputs = self._run(self._add_all(prompt_list, [params] * len(prompt_list)), use_tqdm)
        for index, out in enumerate(outputs):
            if out.outputs is None:
                raise RuntimeError(f"prompt {index} (request {out.request_id}) failed: {out.error}")
        return outputs

    def get_stats(self, include_blocks: bool = False) -> EngineStats:
        """KV-cache, prefix-cache, scheduler, throughput and latency numbers right now."""
        return self.engine.get_stats(include_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; later requests recompute them."""
        return self.engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        """Step until every request finished: RequestOutputs (PoolingRequestOutputs on a
        pooling engine) in `request_ids`' order."""
        results: dict[str, Any] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        import torch  # here: `import tinyvllm` leaves torch unloaded

        try:
            # Held across the steps, so the runner does not enter it per step (~30 us a
            # decode step once the weights have streamed through the caches).
            with torch.inference_mode(), self.engine.runner.platform.steps_in_a_row():
                self._step_until_done(request_ids, results, bar)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        for index, rid in enumerate(request_ids):
            out = results.get(rid)
            # vLLM's outputs have no error field, so without this a failure would go unnoticed.
            if out is not None and (
                out.error is not None
                or (
                    isinstance(out, RequestOutput)
                    and any(c.finish_reason == "error" for c in out.outputs)
                )
            ):
                logger.warning(
                    "prompt %d (request %s) failed: %s", index, rid, out.error or "unknown error"
                )
        return [results[r] for r in request_ids if r in results]

    def _step_until_done(self, request_ids: list[str], results: dict[str, Any], bar: Any) -> None:
        """`_run`'s steps until every request in `request_ids` finished (in `results`)."""
        start = time.perf_counter()
        num_in = num_out = 0
        while len(results) < len(request_ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                results[out.request_id] = out
                num_in += len(out.prompt_token_ids)
                if isinstance(out, RequestOutput):
                    num_out += sum(len(o.token_ids) for o in out.outputs)
                if bar is not None:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"in: {num_in / elapsed:.0f} tok/s, out: {num_out / elapsed:.0f} tok/s"
                    )
                    bar.update(1)
            if self.engine.last_step_empty and self.engine.has_unfinished_requests():
                # Nothing else can change what is schedulable here: stepping on would spin.
                raise RuntimeError(
                    f"{self.engine.get_num_unfinished_requests()} request(s) cannot be "
                    "scheduled (check max_num_batched_tokens and the KV cache size)"
                )


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, dict, or a flat list of token ids) or a sequence of them -> a list."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _pooling_params(params: PoolingParams | None, **overrides: Any) -> PoolingParams:
    """`params` (or the defaults) with the overrides that are not None, validated again."""
    given = {key: value for key, value in overrides.items() if value is not None}
    return replace(params if params is not None else PoolingParams(), **given)
