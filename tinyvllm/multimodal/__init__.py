"""Multimodal inputs: media loading, Qwen-VL preprocessing and EVS video-token pruning.

Torch-free except `evs` (it works on embeddings); none of it imports torchvision.
"""
