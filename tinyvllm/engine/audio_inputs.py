"""Realtime speech prompts (Voxtral Realtime): `{"prompt_token_ids": ids, "multi_modal_data":
{"audio": item}}` -> the same ids plus one audio MultiModalFeature over decoder positions.

There are no placeholder tokens: every decoder position, prompt and output alike, reads the
audio of its own 80 ms (HF's processor too only tokenizes the streaming prefix and left-pads
the audio). The item is an AudioStream (streaming: audio keeps arriving, see
`multimodal/audio_stream.py`) or anything `multimodal.audio.audio_samples` takes (offline:
the whole audio now; the request then stops where HF's generate does, one token per audio
position, via `output_limit`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tinyvllm.multimodal.audio_stream import AudioFrameConfig, AudioStream, audio_stream_of
from tinyvllm.request import MultiModalFeature


def frame_config_for(hf_config: Any, model_path: str) -> AudioFrameConfig:
    """The model's frame settings: preprocessor_config.json (the feature extractor's) when the
    checkpoint has one, else the Voxtral Realtime defaults; mel bins and frames per position
    from the model config."""
    values: dict[str, Any] = {}
    path = Path(model_path) / "preprocessor_config.json"
    if path.is_file():
        raw = json.loads(path.read_text())
        values = {k: raw[k] for k in ("sampling_rate", "hop_length", "n_fft") if k in raw}
        if "global_log_mel_max" in raw:
            values["global_log_mel_max"] = raw["global_log_mel_max"]
        win = raw.get("win_length", values.get("n_fft", 400))
        if win != values.get("n_fft", 400):
            raise ValueError(
                f"{path}: win_length={win} differs from n_fft={values.get('n_fft', 400)}; "
                "only equal sizes are supported"
            )
    return AudioFrameConfig(
        num_mel_bins=hf_config.audio_config.num_mel_bins,
        mel_frames_per_position=hf_config.audio_length_per_tok,
        **values,
    )


class RealtimeAudioProcessor:
    enabled = True
    realtime = True
    placeholders: Mapping[str, str] = MappingProxyType({})

    def __init__(self, hf_config: Any, model_path: str) -> None:
        self.frame_config = frame_config_for(hf_config, model_path)

    def process(
        self, prompt_ids: list[int], mm_data: Any
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(prompt ids unchanged, [the audio feature]); ValueError naming what is wrong."""
        if not isinstance(mm_data, Mapping):
            raise TypeError(
                f"multi_modal_data must be a dict like {{'audio': (samples, 16000)}}, got "
                f"{type(mm_data).__name__}"
            )
        unknown = sorted(set(mm_data) - {"audio"})
        if unknown:
            raise ValueError(
                f"multi_modal_data has unsupported key(s) {unknown}: this speech model takes "
                "'audio' only"
            )
        item = mm_data.get("audio")
        if isinstance(item, list):
            if len(item) != 1:
                raise ValueError(
                    f"multi_modal_data['audio'] holds {len(item)} items; a realtime request "
                    "transcribes exactly one audio stream"
                )
            item = item[0]
        if item is None:
            raise ValueError("multi_modal_data['audio'] is None; pass the audio")
        stream = item if isinstance(item, AudioStream) else self.offline_stream(item)
        if stream.config != self.frame_config:
            raise ValueError(
                f"the AudioStream's frame settings {stream.config} differ from the model's "
                f"{self.frame_config}; create it with engine.mm_processor.frame_config"
            )
        ready = stream.positions_ready()
        limit = stream.sequence_limit()
        if limit is not None and limit <= len(prompt_ids):
            raise ValueError(
                f"the audio gives {limit} decoder positions ({stream.num_samples} samples), "
                f"no more than the prompt's {len(prompt_ids)} tokens, so nothing is left to "
                "transcribe; pass longer audio (or the model's streaming prefix only)"
            )
        return prompt_ids, [stream.chunk_feature(0, ready)]

    def offline_stream(self, item: Any) -> AudioStream:
        # Imported here: the engine imports this module and must stay torch-free to import.
        from tinyvllm.multimodal.audio import audio_samples

        cfg = self.frame_config
        samples = audio_samples(item, cfg.sampling_rate)
        if cfg.mel_frames_ready(samples.size, True) < cfg.mel_frames_per_position:
            raise ValueError(
                f"the audio has {samples.size} samples, shorter than one decoder position "
                f"({cfg.samples_per_position} samples at {cfg.sampling_rate} Hz)"
            )
        return AudioStream(cfg, samples, ended=True)

    def check_text_prompt(self, prompt_ids: list[int]) -> None:
        raise ValueError(
            "this model transcribes audio: pass it as {'prompt_token_ids': ..., "
            "'multi_modal_data': {'audio': (samples, sample_rate)}}"
        )


def output_limit(features: list[MultiModalFeature], num_prompt_tokens: int) -> int | None:
    """Output tokens a request with all its audio known may produce (HF's generate: the
    sequence ends at ceil(mel frames / frames per position)); None without ended audio."""
    stream = audio_stream_of(features)
    if stream is None:
        return None
    limit = stream.sequence_limit()
    return None if limit is None else max(0, limit - num_prompt_tokens)
