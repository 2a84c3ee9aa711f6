"""The Mamba2 mixer against HF's torch path (GraniteMoeHybrid's mamba layer), on random weights:
whole sequences packed in one batch, sequences split into chunks that carry state, and decode
steps continuing a prefill."""

from __future__ import annotations

import pytest
import torch
from granite_hybrid_fixtures import TINY_GRANITE
from mamba2_helpers import run, step_metadata
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)

from tinyvllm.models.layers.mamba2 import Mamba2Config, Mamba2Mixer, mamba2_config_from_hf

HIDDEN = 32
TOLERANCE = 2e-5


def hf_config(**overrides: object) -> GraniteMoeHybridConfig:
    values: dict[str, object] = {
        **TINY_GRANITE,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "layer_types": ["mamba"],
    }
    values.update(overrides)
    return GraniteMoeHybridConfig(**values)


def make_pair(
    config: GraniteMoeHybridConfig, slots: int = 4
) -> tuple[GraniteMoeHybridMambaLayer, Mamba2Mixer]:
    torch.manual_seed(0)
    hf = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        hf.A_log.copy_(torch.rand_like(hf.A_log))  # decays in (e^-e, 1/e): a real memory
    ours = Mamba2Mixer(mamba2_config_from_hf(config))
    ours.load_state_dict(hf.state_dict())
    bind_zero_state(ours, slots)
    return hf, ours


def bind_zero_state(mixer: Mamba2Mixer, slots: int) -> None:
    # Stale garbage, not zeros: a first chunk must never read its slot.
    mixer.states = [torch.randn(slots, *s.shape, dtype=s.dtype) for s in mixer.state_shapes()]


def hf_out(hf: GraniteMoeHybridMambaLayer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x.unsqueeze(0))[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"mamba_n_groups": 1, "mamba_chunk_size": 5},
        {"mamba_n_groups": 8, "mamba_conv_bias": False, "mamba_proj_bias": True},
        {"time_step_limit": (0.05, 0.4)},
    ],
)
def test_packed_sequences_match_hf(overrides: dict[str, object]) -> None:
    hf, ours = make_pair(hf_config(**overrides))
    torch.manual_seed(1)
    seqs = [torch.randn(n, HIDDEN) for n in (19, 1, 8, 3)]
    got = run(ours, seqs, [2, 0, 3, 1], [False] * 4)
    for seq, out in zip(seqs, got, strict=True):
        torch.testing.assert_close(out, hf_out(hf, seq), atol=TOLERANCE, rtol=1e-4)


def test_scan_chunk_is_capped_and_result_unchanged() -> None:
    # HF scans this sequence as one chunk of 256; we scan chunks of 64 (faster on CPUs).
    hf, ours = make_pair(hf_config(mamba_chunk_size=256))
    assert ours.config.scan_chunk == 64
    seq = torch.randn(150, HIDDEN)
    got = run(ours, [seq], [0], [False])[0]
    torch.testing.assert_close(got, hf_out(hf, seq), atol=TOLERANCE, rtol=1e-4)


def test_chunks_carrying_state_match_one_shot() -> None:
    hf, ours = make_pair(hf_config())
    torch.manual_seed(2)
    seq = torch.randn(30, HIDDEN)
    pieces = [seq[:11], seq[11:12], seq[12:30]]  # 2-token, 1-token and long chunks alike
    got = [run(ours, [pieces[0]], [1], [False])[0]]
    got += [run(ours, [piece], [1], [True])[0] for piece in pieces[1:]]
    torch.testing.assert_close(torch.cat(got), hf_out(hf, seq), atol=TOLERANCE, rtol=1e-4)


# Slots apart (a gathered copy) and consecutive (updated in place through a view).
@pytest.mark.parametrize("slots", [(0, 3), (2, 3)])
def test_decode_steps_continue_prefill_in_a_mixed_batch(slots: tuple[int, int]) -> None:
    hf, ours = make_pair(hf_config())
    torch.manual_seed(3)
    a, b = torch.randn(14, HIDDEN), torch.randn(9, HIDDEN)
    both = list(slots)
    outs_a = run(ours, [a[:10]], [slots[0]], [False])
    # Request a decodes one token per step while b prefills, then both decode together.
    step_a, step_b = run(ours, [a[10:11], b[:6]], both, [True, False])
    outs_a.append(step_a)
    outs_b = [step_b]
    for t in range(3):
        step_a, step_b = run(ours, [a[11 + t : 12 + t], b[6 + t : 7 + t]], both, [True, True])
        outs_a.append(step_a)
        outs_b.append(step_b)
    torch.testing.assert_close(torch.cat(outs_a), hf_out(hf, a), atol=TOLERANCE, rtol=1e-4)
    torch.testing.assert_close(torch.cat(outs_b), hf_out(hf, b), atol=TOLERANCE, rtol=1e-4)


def test_first_chunk_ignores_stale_slot() -> None:
    # A one-token prompt's slot may hold a finished request's state: it must read as zeros.
    hf, ours = make_pair(hf_config())
    x = torch.randn(1, HIDDEN)
    got = run(ours, [x], [2], [False])[0]
    torch.testing.assert_close(got, hf_out(hf, x), atol=TOLERANCE, rtol=1e-4)


def test_bad_sizes_name_the_field() -> None:
    with pytest.raises(ValueError, match="n_groups=3 must divide"):
        Mamba2Config(32, 8, 8, 3, 16, 4, 8, 1e-5)
    mixer = Mamba2Mixer(mamba2_config_from_hf(hf_config()))
    with pytest.raises(RuntimeError, match="recurrent states bound"):
        mixer(torch.zeros(1, HIDDEN), step_metadata([0, 1], [0], [False]))


def test_state_shapes() -> None:
    c = mamba2_config_from_hf(hf_config())
    conv, ssm = Mamba2Mixer(c).state_shapes()
    # x (8 heads x 8) plus B and C for 2 groups of 16; the window keeps kernel - 1 inputs.
    assert conv.shape == (64 + 2 * 2 * 16, 3) and conv.dtype == torch.get_default_dtype()
    assert ssm.shape == (8, 8, 16) and ssm.dtype == torch.float32
