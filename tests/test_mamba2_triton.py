"""The Triton Mamba2 decode step, run by Triton's CPU interpreter, against the torch step
(`ssd.causal_conv1d_step` + `ssd.ssd_step`) and through `Mamba2Mixer` against its torch path.

As in test_triton_attention.py, Triton picks the interpreter at import, so the kernel tests run
in a child pytest process started with TRITON_INTERPRET=1 (`test_in_interpreter`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in the TRITON_INTERPRET=1 child of test_in_interpreter",
)


def test_in_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already in the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout  # the kernel tests really ran


@interpreted
@pytest.mark.parametrize(
    ("groups", "bias", "limit"),
    [(2, True, (0.0, float("inf"))), (1, False, (0.05, 0.5)), (4, True, (0.0, 0.3))],
)
def test_step_matches_torch(groups: int, bias: bool, limit: tuple[float, float]) -> None:
    from tinyvllm.models.layers.mamba2_triton import mamba2_decode_step
    from tinyvllm.models.layers.ssd import causal_conv1d_step, ssd_step

    torch.manual_seed(groups)
    heads, head_dim, state, kernel, slots = 4, 6, 5, 4, 5  # non-power-of-2 sizes: masks
    inter = heads * head_dim
    channels = inter + 2 * groups * state
    tokens_total = 7
    # One in_proj-like row per token: [gate | xBC | dt]; the kernel reads column slices.
    proj = torch.randn(tokens_total, inter + channels + heads)
    xbc, dt = proj[:, inter : inter + channels], proj[:, inter + channels :]
    weight, conv_bias = torch.randn(channels, 1, kernel), torch.randn(channels) if bias else None
    A, D, dt_bias = -torch.rand(heads) - 0.1, torch.randn(heads), torch.randn(heads)
    conv_state = torch.randn(slots, channels, kernel - 1)
    ssm_state = torch.randn(slots, heads, head_dim, state)
    tokens, rows = torch.tensor([5, 0, 3]), torch.tensor([2, 4, 0])

    conv, windows = causal_conv1d_step(xbc[tokens], conv_state[rows], weight[:, 0], conv_bias)
    x, B, C = F.silu(conv).split([inter, groups * state, groups * state], dim=-1)
    x = x.reshape(-1, heads, head_dim)
    step_dt = F.softplus(dt[tokens] + dt_bias).clamp(*limit)
    states_want = ssm_state[rows]  # a copy, stepped in place by the torch reference
    y_want = ssd_step(
        x, step_dt, A, B.reshape(-1, groups, state), C.reshape(-1, groups, state), states_want
    )
    y_want = (y_want + x * D[:, None]).flatten(-2)

    y = torch.zeros(tokens_total, inter)
    args = (weight, conv_bias, A, D, dt_bias, limit, groups, y)
    mamba2_decode_step(xbc, dt, tokens, rows, conv_state, ssm_state, *args)
    torch.testing.assert_close(y[tokens], y_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_state[rows], windows)
    torch.testing.assert_close(ssm_state[rows], states_want, atol=1e-5, rtol=1e-5)
    assert y[[1, 2, 4, 6]].abs().sum() == 0  # rows of other tokens untouched


@interpreted
def test_mixer_decode_matches_torch_path() -> None:
    """Prefill through the torch scan, then decode steps: the Triton mixer and the torch mixer
    give the same outputs and leave the same states."""
    from mamba2_helpers import run

    from tinyvllm.models.layers.mamba2 import Mamba2Config, Mamba2Mixer

    sizes = dict(n_groups=2, state_size=16, conv_kernel=4, chunk_size=8, rms_norm_eps=1e-5)
    config = Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, **sizes)
    torch_mixer, triton_mixer = Mamba2Mixer(config), Mamba2Mixer(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in torch_mixer.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    triton_mixer.load_state_dict(torch_mixer.state_dict())
    shapes = torch_mixer.state_shapes()
    torch_mixer.states = [torch.randn(4, *s.shape, dtype=s.dtype) for s in shapes]
    assert not triton_mixer.triton_decode  # built on the CPU: torch path by default
    triton_mixer.triton_decode = True
    triton_mixer.states = [t.clone() for t in torch_mixer.states]
    torch.manual_seed(4)
    a, b = torch.randn(12, 32), torch.randn(9, 32)
    for mixer in (torch_mixer, triton_mixer):
        run(mixer, [a[:9], b[:6]], [0, 3], [False, False])
    for t in range(3):
        parts = [a[9 + t : 10 + t], b[6 + t : 7 + t]]
        want = run(torch_mixer, parts, [0, 3], [True, True])
        got = run(triton_mixer, parts, [0, 3], [True, True])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for g, w in zip(triton_mixer.states, torch_mixer.states, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_sm90(dtype: str) -> None:
    """What only the GPU compiler rejects, checked without a GPU (as test_triton_compile.py)."""
    from test_triton_compile import _compile_sm90, skip_unless_compilable

    from tinyvllm.models.layers import mamba2_triton as kernels

    skip_unless_compilable(kernels._conv_step_kernel)
    ids = {"token_ptr": "*i64", "slot_ptr": "*i64"}
    conv_ptrs = {n: f"*{dtype}" for n in ("xbc_ptr", "window_ptr", "weight_ptr", "bias_ptr")}
    constants = dict(CHANNELS=1280, WIDTH=3, HAS_BIAS=True, BLOCK_C=128)
    _compile_sm90(kernels._conv_step_kernel, conv_ptrs | ids | {"out_ptr": "*fp32"}, constants, 4)
    ssm_ptrs = {"conv_ptr": "*fp32", "dt_ptr": f"*{dtype}", "state_ptr": "*fp32", "a_ptr": "*fp32"}
    ssm_ptrs |= {n: f"*{dtype}" for n in ("d_ptr", "dt_bias_ptr")} | {"y_ptr": "*fp32"}
    # A realistic mixer: 48 heads of 64, state 128, one group.
    sizes = dict(HEAD_DIM=64, STATE=128, HEADS_PER_GROUP=48, GROUPS=1, BLOCK_P=64, BLOCK_N=128)
    constants = sizes | {"INTERMEDIATE": 48 * 64}
    scalars = {"dt_min": "fp32", "dt_max": "fp32"}
    _compile_sm90(kernels._ssm_step_kernel, ssm_ptrs | ids | scalars, constants, 4)
