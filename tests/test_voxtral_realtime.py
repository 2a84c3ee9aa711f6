"""Voxtral Realtime against HF transformers on a tiny random checkpoint: offline requests
(all audio known) give HF generate's greedy tokens with logprobs within 1e-3; a request fed
one position's audio per step gives HF's full-forward tokens; the streaming encoder equals
the whole-audio encoder; the audio hash keys the prefix cache; preemption re-encodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from voxtral_realtime_fixtures import (
    PROMPT,
    build_tiny_voxtral,
    hf_features,
    hf_model,
    hf_reference,
    make_llm,
    random_audio,
)

from tinyvllm import LLM, SamplingParams
from tinyvllm.multimodal.audio_stream import AudioStream

# HF's generate stops at the audio's length itself (it warns that max_length is a default).
pytestmark = pytest.mark.filterwarnings("ignore:Using the model-agnostic default")


@pytest.fixture(scope="module")
def vox_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_voxtral(tmp_path_factory.mktemp("voxtral_rt"), tokenizer_dir)


@pytest.fixture(scope="module")
def hf(vox_dir: Path) -> Any:
    return hf_model(vox_dir)


@pytest.fixture(scope="module")
def llm(vox_dir: Path) -> LLM:
    return make_llm(vox_dir)


def greedy(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)


def audio_prompt(samples: Any, prompt: list[int] = PROMPT) -> dict[str, Any]:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"audio": samples}}


def check_output(hf: Any, output: Any, samples: np.ndarray) -> None:
    """Greedy tokens identical to HF generate's (stopping where it stops), each token's
    logprob within 1e-3 of HF's full forward."""
    completion = output.outputs[0]
    want, logp = hf_reference(hf, list(output.prompt_token_ids), samples)
    assert list(completion.token_ids) == want
    start = len(output.prompt_token_ids) - 1
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert abs(entry[token].logprob - logp[start + i, token].item()) < 1e-3


def test_offline_matches_hf_generate(llm: LLM, hf: Any) -> None:
    """One token per audio position until the audio ends (HF's length), batched requests of
    different lengths included; the sequence stops at ceil(mel frames / 8)."""
    clips = [random_audio(1.5, seed=1), random_audio(0.77, seed=2)]
    outs = llm.generate([audio_prompt((c, 16000)) for c in clips], greedy(), use_tqdm=False)
    for out, clip in zip(outs, clips, strict=True):
        check_output(hf, out, clip)
        assert out.outputs[0].finish_reason == "length"
        frames = clip.size // 160
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == -(-frames // 8)
    # A user's max_tokens still caps it, as max_new_tokens does for HF.
    short = llm.generate(audio_prompt(clips[0]), greedy(3), use_tqdm=False)[0]
    assert list(short.outputs[0].token_ids) == list(outs[0].outputs[0].token_ids[:3])


def test_one_position_of_audio_per_step_matches_hf_full_forward(llm: LLM, hf: Any) -> None:
    """A request whose audio arrives while it runs, exactly one decoder position's worth per
    step (the prompt's audio first): every decode step encodes the new audio with the
    streaming caches and adds it to the step's row."""
    clip = random_audio(1.2, seed=3)
    engine = llm.engine
    cfg = engine.mm_processor.frame_config
    per, pad = cfg.samples_per_position, cfg.n_fft // 2

    def upto(positions: int) -> np.ndarray:  # the samples that make `positions` ready
        return clip[: min(clip.size, positions * per + pad)]

    stream = AudioStream(cfg, upto(len(PROMPT)))
    total = cfg.sequence_limit(clip.size)
    engine.add_request("stream", audio_prompt(stream), greedy(total - len(PROMPT)))
    fed = stream.num_samples
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        position = len(PROMPT) + (len(final.outputs[0].token_ids) if final else 0)
        more = upto(position + 1)[fed:]
        if more.size:
            stream.append(more)
            fed += more.size
        if fed == clip.size and not stream.ended:
            stream.end()
    assert final is not None and final.finished
    assert stream.positions_ready() >= total - 1
    check_output(hf, final, clip)


def test_streaming_encoder_equals_whole_audio(llm: LLM, hf: Any) -> None:
    """The encoder fed the mel frames in chunks of 1, 3 and 5 positions gives the frames HF's
    encoder and projector give for the whole audio (window 12 frames: the chunks cross it)."""
    model = llm.engine.runner.model
    tower = model.audio_tower
    clip = random_audio(1.0, seed=4)
    feats = hf_features(clip)[0]
    positions = feats.shape[1] // 8
    with torch.no_grad():
        want = hf.model.get_audio_features(input_features=feats[None, :, : positions * 8])
        want = want.pooler_output[0]
        for size in (1, 3, 5):
            state = tower.new_state()
            got = torch.cat([
                tower.encode(feats[:, 8 * p : 8 * min(positions, p + size)], state)
                for p in range(0, positions, size)
            ])  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # Streams with different histories (none, 1 and 3 positions: the window of 12 frames
        # full, part full, empty) encoded in one batch, one position each, as concurrent
        # streams are: each gets its own whole-audio frames.
        states = [tower.new_state() for _ in range(3)]
        for state, done in zip(states, (0, 1, 3), strict=True):
            if done:
                tower.encode(feats[:, : 8 * done], state)
        for step in range(3):
            chunks = [feats[:, 8 * (d + step) : 8 * (d + step + 1)] for d in (0, 1, 3)]
            got = torch.stack(tower.encode_many(chunks, states))
            torch.testing.assert_close(
                got[:, 0], want[[step, 1 + step, 3 + step]], atol=1e-4, rtol=1e-4
            )


def test_prefix_cache_keys_on_audio_content(vox_dir: Path) -> None:
    """The same audio hits the prefix cache and answers the same; one changed sample misses
    (the audio hash is every block's extra key: the tokens alone are identical)."""
    # Not eager: the platform's native layer kernels run, but every step carries
    # inputs_embeds, so there is no fast path that embeds token ids itself (no native decode
    # program; vLLM too refuses full CUDA graphs for realtime models).
    llm = make_llm(vox_dir, enable_prefix_caching=True, block_size=4, enforce_eager=False)
    runner = llm.engine.runner
    assert runner.decode_program is None and runner.cuda_graphs is None
    clip = random_audio(1.0, seed=5)
    prompt = [1, 5, 7, 9, 11, 13, 15, 17, 19]
    first = llm.generate(audio_prompt(clip, prompt), greedy(), use_tqdm=False)[0]
    again = llm.generate(audio_prompt(clip.copy(), prompt), greedy(), use_tqdm=False)[0]
    changed = clip.copy()
    changed[-1] += 0.25
    other = llm.generate(audio_prompt(changed, prompt), greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0


def test_preemption_reencodes_the_received_audio(vox_dir: Path, hf: Any) -> None:
    """Requests preempted for KV blocks drop their encoder cache and re-encode on resume:
    HF's tokens all the same."""
    llm = make_llm(vox_dir, num_gpu_blocks_override=8, block_size=4, max_model_len=32)
    clips = [random_audio(1.2, seed=s) for s in (6, 7, 8)]
    outs = llm.generate([audio_prompt(c) for c in clips], greedy(), use_tqdm=False)
    assert llm.get_stats().total_preemptions > 0
    for out, clip in zip(outs, clips, strict=True):
        check_output(hf, out, clip)


def test_encoder_attention_takes_4d_operands(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU torch runs SDPA's fused kernel on 4-D operands only (3-D: the math fallback, ~4x
    slower for the encoder's chunks)."""
    import torch.nn.functional as F

    ranks: list[int] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ranks.append(q.dim())
        return real(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tower = llm.engine.runner.model.audio_tower
    with torch.no_grad():
        tower.encode(hf_features(random_audio(0.2, seed=9))[0, :, :16], tower.new_state())
    assert ranks and set(ranks) == {4}


def test_live_stream_encoder_takes_the_native_gemv(
    vox_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live stream encodes one position (a few frames) per step, inside a native decode
    step where torch runs one thread: every encoder and projector linear takes the native
    GEMV (the conv embedder's transposed output once made all of them fall back to torch)."""
    llm = make_llm(vox_dir, enforce_eager=False)
    tower = llm.engine.runner.model.audio_tower
    from tinyvllm.models.layers.linear import LinearBase

    linears = [m for m in tower.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 7 * len(tower.layers) + 2
    native = linears[0].native
    if native is None:
        pytest.skip("no native CPU kernels on this machine")
    assert all(m.native is native for m in linears)
    seen: set[int] = set()
    real = native.linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.add(weight.data_ptr())
        return real(x, weight, bias)

    monkeypatch.setattr(native, "linear", spy)
    mel = hf_features(random_audio(0.2, seed=9))[0, :, : tower.mel_frames_per_position]
    with torch.no_grad():
        tower.encode(mel, tower.new_state())
    assert seen == {m.weight.data_ptr() for m in linears}
