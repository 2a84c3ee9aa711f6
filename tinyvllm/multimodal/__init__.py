"""Multimodal inputs: media loading, Qwen-VL preprocessing, EVS video-token pruning, and audio
(WAV reading and resampling, log-mel frames, the AudioStream of a realtime request).

Torch-free except `evs` (it works on embeddings), `audio` (resampling) and `log_mel` (the
STFT); none of it imports torchvision or torchaudio.
"""
