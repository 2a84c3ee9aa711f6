"""Pooling models on tiny random checkpoints, against HF transformers on the same weights.

- BertModel (encoder-only, our own implementation): every token's hidden state (`encode`) and
  the sentence-transformers poolings (CLS / MEAN / LAST, Normalize) in batches of different
  lengths; auto-detection; truncation; the errors for bad input and the wrong runner.
- Decoder models pooled at their last token (`runner="pooling"`, as Qwen3-Embedding): every
  family against HF's final hidden states (mistral's sliding window included).
- AsyncLLM: concurrent `embed` calls run as one batch.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinyvllm import LLM, AsyncLLM, EmbeddingRequestOutput, PoolingParams, SamplingParams

# Token-id prompts of different lengths (the tiny tokenizer's ids are < 2000).
PROMPTS = [
    [5, 17, 300, 42, 7, 99, 1000, 12, 8],
    [3, 4],
    [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262, 263, 264, 265, 266],
    [1999],
    [10, 20, 30, 40, 50, 60, 70, 80, 90],
    list(range(100, 140)),
]
TINY_BERT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 48,
    "hidden_act": "gelu",
}


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import BertConfig, BertModel

    out = tmp_path_factory.mktemp("tiny_bert")
    config = BertConfig(vocab_size=2000, **TINY_BERT)
    model = BertModel(config).float().eval()
    _randomize(model)
    model.save_pretrained(out)
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            shutil.copy(path, out / path.name)
    return out


def _sentence_transformers_dir(src: Path, dst: Path, mode: str, normalize: bool) -> Path:
    """`src` as a sentence-transformers directory pooling with `mode` (their flag name)."""
    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    (dst / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    return dst


@pytest.fixture(scope="module")
def hf_bert_states(bert_dir: Path) -> list[torch.Tensor]:
    from transformers import BertModel

    model = BertModel.from_pretrained(bert_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in PROMPTS]


@pytest.fixture(scope="module")
def bert_llm(bert_dir: Path, one_torch_thread: None) -> LLM:
    return LLM(str(bert_dir))  # BertModel: pooling without being asked


def _embeddings(outputs: list[EmbeddingRequestOutput]) -> torch.Tensor:
    return torch.tensor([out.outputs.embedding for out in outputs])


def test_bert_encode_matches_hf_every_token(
    bert_llm: LLM, hf_bert_states: list[torch.Tensor]
) -> None:
    assert bert_llm.engine.runner_type == "pooling"
    outputs = bert_llm.encode([{"prompt_token_ids": ids} for ids in PROMPTS])
    for ids, out, ref in zip(PROMPTS, outputs, hf_bert_states, strict=True):
        assert out.prompt_token_ids == ids and out.finished
        torch.testing.assert_close(out.outputs.data, ref, atol=1e-4, rtol=1e-4)


def test_bert_default_pooling_is_normalized_cls(
    bert_llm: LLM, hf_bert_states: list[torch.Tensor]
) -> None:
    got = _embeddings(bert_llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS]))
    want = F.normalize(torch.stack([h[0] for h in hf_bert_states]), dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    raw = _embeddings(bert_llm.embed([{"prompt_token_ids": PROMPTS[0]}], normalize=False))
    torch.testing.assert_close(raw[0], hf_bert_states[0][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("mode", "normalize", "pool"),
    [
        ("pooling_mode_mean_tokens", True, lambda h: h.mean(0)),
        ("pooling_mode_cls_token", False, lambda h: h[0]),
        ("pooling_mode_lasttoken", True, lambda h: h[-1]),
    ],
)
def test_bert_sentence_transformers_pooling(
    tmp_path: Path,
    bert_dir: Path,
    hf_bert_states: list[torch.Tensor],
    mode: str,
    normalize: bool,
    pool: object,
    one_torch_thread: None,
) -> None:
    st_dir = _sentence_transformers_dir(bert_dir, tmp_path / "st", mode, normalize)
    llm = LLM(str(st_dir))
    # sentence_bert_config.json's max_seq_length caps the 48 positions.
    assert llm.engine.config.model.max_model_len == 32
    prompts = [ids for ids in PROMPTS if len(ids) <= 32]
    got = _embeddings(llm.embed([{"prompt_token_ids": ids} for ids in prompts]))
    states = [h for ids, h in zip(PROMPTS, hf_bert_states, strict=True) if len(ids) <= 32]
    want = torch.stack([pool(h) for h in states])  # type: ignore[operator]
    if normalize:
        want = F.normalize(want, dim=-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_pooler_config_overrides_the_checkpoint(
    bert_dir: Path, hf_bert_states: list[torch.Tensor], one_torch_thread: None
) -> None:
    llm = LLM(str(bert_dir), pooler_config={"pooling_type": "mean", "normalize": False})
    got = _embeddings(llm.embed([{"prompt_token_ids": PROMPTS[2]}]))
    torch.testing.assert_close(got[0], hf_bert_states[2].mean(0), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"pooling_type='max'.*MEAN, CLS, LAST"):
        LLM(str(bert_dir), pooler_config={"pooling_type": "max"})


def test_truncation(bert_llm: LLM, bert_dir: Path) -> None:
    from transformers import BertModel

    too_long = list(range(1, 61))  # 60 tokens, 48 positions
    with pytest.raises(ValueError, match=r"60 tokens.*max_model_len=48.*truncate_prompt_tokens"):
        bert_llm.embed([{"prompt_token_ids": too_long}])
    # Token ids keep the last k (vLLM's rule); -1 means the model's maximum.
    ten = bert_llm.embed([too_long], truncate_prompt_tokens=10, normalize=False)[0]
    assert ten.prompt_token_ids == too_long[-10:]
    full = bert_llm.embed([too_long], truncate_prompt_tokens=-1, normalize=False)[0]
    assert full.prompt_token_ids == too_long[-48:]
    model = BertModel.from_pretrained(bert_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([too_long[-48:]])).last_hidden_state[0, 0]
    torch.testing.assert_close(torch.tensor(full.outputs.embedding), ref, atol=1e-4, rtol=1e-4)
    # Text goes through the tokenizer's own truncation.
    text = "def f(x):\n    return x * 2\n" * 20
    out = bert_llm.embed(text, truncate_prompt_tokens=12)[0]
    assert len(out.prompt_token_ids) == 12
    assert out.prompt_token_ids == bert_llm.get_tokenizer().encode(text)[:12]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        bert_llm.embed("hello", truncate_prompt_tokens=0)


def test_failed_step_raises_and_the_engine_goes_on(
    bert_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = bert_llm.engine.runner

    def broken(inputs: object) -> None:
        raise RuntimeError("kernel exploded")

    with monkeypatch.context() as patch:
        patch.setattr(runner, "execute", broken)
        with pytest.raises(RuntimeError, match=r"prompt 0 .*failed: model step failed.*exploded"):
            bert_llm.embed([PROMPTS[0], PROMPTS[1]])
    assert not bert_llm.engine.has_unfinished_requests()
    assert len(bert_llm.embed([PROMPTS[0]])[0].outputs.embedding) == TINY_BERT["hidden_size"]


def test_wrong_runner_errors(bert_llm: LLM, bert_dir: Path, tiny_models: object) -> None:
    with pytest.raises(
        ValueError, match=r"generate\(\) needs a generative model.*runner='pooling'"
    ):
        bert_llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"BertModel is an encoder-only model.*runner='pooling'"):
        LLM(str(bert_dir), runner="generate")
    generative = LLM(str(tiny_models["qwen3"]), dtype="float32")  # type: ignore[index]
    with pytest.raises(ValueError, match=r"embed\(\) needs a pooling model.*runner='pooling'"):
        generative.embed("hello")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_decoder_last_token_pooling_matches_hf(
    family: str, tiny_models: object, one_torch_thread: None
) -> None:
    from transformers import AutoModel

    path = tiny_models[family]  # type: ignore[index]
    llm = LLM(str(path), runner="pooling", dtype="float32")
    assert llm.engine.config.model.pooler_config.pooling_type == "LAST"
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    raw = _embeddings(llm.embed(prompts, normalize=False))
    normed = _embeddings(llm.embed(prompts))
    tokens = llm.encode(prompts)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for i, ids in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(tokens[i].outputs.data, ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(raw[i], ref[-1], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(normed[i], F.normalize(ref[-1], dim=-1), atol=1e-5, rtol=1e-4)


async def _hold_engine(llm: AsyncLLM) -> threading.Event:
    """Block the engine thread (inside a call) until the returned event is set. Returns once
    it is blocked, so every command posted from now on waits in the queue, to be applied
    together (in order) before the next step."""
    started, release = threading.Event(), threading.Event()

    def hold(engine: object) -> None:
        started.set()
        release.wait(30)

    llm._call(hold)
    await asyncio.to_thread(started.wait, 30)
    return release


def test_headless_backbone_pools_but_cannot_generate(
    tmp_path: Path, tiny_models: object, one_torch_thread: None
) -> None:
    """A checkpoint of the base model alone (no "model." prefix, no lm_head) named as a causal
    LM with a sentence-transformers last-token pooler: how Qwen3-Embedding ships."""
    from transformers import AutoModel

    source = Path(tiny_models["qwen3"])  # type: ignore[index]
    base = AutoModel.from_pretrained(source, dtype=torch.float32).eval()
    headless = tmp_path / "qwen3-embedding"
    base.save_pretrained(headless)
    config = json.loads((headless / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (headless / "config.json").write_text(json.dumps(config))
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            shutil.copy(path, headless / path.name)
    with pytest.raises(ValueError, match=r"no lm_head\.weight.*runner='pooling'"):
        LLM(str(headless), dtype="float32")
    st_dir = _sentence_transformers_dir(headless, tmp_path / "st", "pooling_mode_lasttoken", True)
    llm = LLM(str(st_dir), dtype="float32")  # detected from modules.json
    got = _embeddings(llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS[:3]]))
    with torch.no_grad():
        want = [base(torch.tensor([ids])).last_hidden_state[0, -1] for ids in PROMPTS[:3]]
    torch.testing.assert_close(got, F.normalize(torch.stack(want), dim=-1), atol=1e-5, rtol=1e-4)


def test_async_embeds_batch_together(
    bert_dir: Path, bert_llm: LLM, hf_bert_states: list[torch.Tensor], one_torch_thread: None
) -> None:
    expected = _embeddings(bert_llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS]))

    async def main(llm: AsyncLLM) -> tuple[list[EmbeddingRequestOutput], torch.Tensor]:
        # Hold the engine thread until every request is queued, so they meet in one step.
        release = await _hold_engine(llm)
        calls = [llm.embed(ids, request_id=f"r{i}") for i, ids in enumerate(PROMPTS)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        # Every token's hidden state, in the same batch as the embeddings.
        tokens = asyncio.ensure_future(llm.encode(PROMPTS[2], PoolingParams(task="token_embed")))
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*tasks), (await tokens).outputs.data

    with AsyncLLM(str(bert_dir)) as llm:
        outputs, token_states = asyncio.run(main(llm))
        stats = llm.get_stats()
        with pytest.raises(ValueError, match=r"60 tokens.*truncate_prompt_tokens"):
            asyncio.run(llm.embed(list(range(1, 61))))
        with pytest.raises(ValueError, match="runner='pooling'"):
            asyncio.run(_first(llm.generate("hi", SamplingParams(max_tokens=2))))
    assert [out.request_id for out in outputs] == [f"r{i}" for i in range(len(PROMPTS))]
    torch.testing.assert_close(_embeddings(outputs), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(token_states, hf_bert_states[2], atol=1e-4, rtol=1e-4)
    assert stats.num_steps == 1 and stats.num_finished_requests == len(PROMPTS) + 1


def test_async_embed_abort_and_cancel(bert_dir: Path, one_torch_thread: None) -> None:
    from tinyvllm import RequestError

    async def main(llm: AsyncLLM) -> None:
        release = await _hold_engine(llm)
        aborted = asyncio.ensure_future(llm.embed(PROMPTS[0], request_id="a"))
        cancelled = asyncio.ensure_future(llm.embed(PROMPTS[1], request_id="c"))
        kept = asyncio.ensure_future(llm.embed(PROMPTS[2], request_id="k"))
        await asyncio.sleep(0.05)
        llm.abort("a")
        cancelled.cancel()
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(RequestError, match="aborted"):
            await aborted
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert len((await kept).outputs.embedding) == TINY_BERT["hidden_size"]
        assert not await llm._call(lambda engine: engine.has_unfinished_requests())

    with AsyncLLM(str(bert_dir)) as llm:
        asyncio.run(main(llm))


def test_async_embed_on_generative_engine(tiny_models: object) -> None:
    qwen3 = str(tiny_models["qwen3"])  # type: ignore[index]
    with AsyncLLM(qwen3, dtype="float32") as llm, pytest.raises(ValueError, match="runner="):
        asyncio.run(llm.embed("hello"))


async def _first(stream: object) -> object:
    async for item in stream:  # type: ignore[attr-defined]
        return item
    return None


def test_pooling_params_validation() -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=-2)
    with pytest.raises(ValueError, match="pooling task 'classify'"):
        PoolingParams(task="classify")


def test_sentence_transformers_config_errors_name_the_file(tmp_path: Path) -> None:
    from tinyvllm.models.sentence_transformers import (
        SentenceTransformersConfig,
        read_sentence_transformers_config,
    )

    assert read_sentence_transformers_config(tmp_path) == SentenceTransformersConfig()
    (tmp_path / "empty").mkdir()
    _sentence_transformers_dir(tmp_path / "empty", tmp_path / "st", "pooling_mode_max_tokens", True)
    with pytest.raises(ValueError, match=r"1_Pooling/config.json.*pooling_mode_max_tokens"):
        read_sentence_transformers_config(tmp_path / "st")
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*1_Pooling/config.json"):
        read_sentence_transformers_config(tmp_path / "st")
