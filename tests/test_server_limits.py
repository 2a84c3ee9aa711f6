"""Untrusted input to `tinyvllm serve` is bounded: file:// media only inside
--allowed-local-media-path (symlinks and `..` resolved, no probing outside), image pixels,
video frames and a request's total media pixels, the request body's size (while it streams
in), `n` and the prompt batch. One refused request leaves the server serving the others."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402
from server_helpers import ServerThread  # noqa: E402

from tinyvllm.cli import main  # noqa: E402
from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.multimodal.media import load_image  # noqa: E402
from tinyvllm.server.app import build_app  # noqa: E402
from tinyvllm.server.chat_media import chat_messages  # noqa: E402
from tinyvllm.server.errors import APIError  # noqa: E402
from tinyvllm.server.limits import MAX_BATCH, MAX_N, ServerLimits  # noqa: E402
from tinyvllm.server.serving import ServerState  # noqa: E402

MODEL = "tiny-llama"
MAX_MODEL_LEN = 128


def _png(path: Path, width: int = 8, height: int = 6) -> Path:
    Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(path)
    return path


def _png_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _media(limits: ServerLimits, *urls: str, kind: str = "image_url") -> dict[str, list[Any]]:
    """The decoded media of one user message holding `urls`, as the server checks them."""
    parts = [{"type": kind, kind: {"url": url}} for url in urls]
    _, media = chat_messages([{"role": "user", "content": parts}], True, "vlm", limits)
    return media


def _refusal(limits: ServerLimits, *urls: str, kind: str = "image_url") -> str:
    with pytest.raises(APIError) as info:
        _media(limits, *urls, kind=kind)
    assert info.value.status == 400
    return info.value.message


# ---- file:// URLs ------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """An allowed directory with an image and a symlink out of it, and a secret beside it."""
    allowed = tmp_path / "media"
    allowed.mkdir()
    secret = _png(tmp_path / "secret.png")
    (allowed / "escape.png").symlink_to(secret)
    return {"allowed": allowed, "inside": _png(allowed / "ok.png"), "secret": secret}


def test_file_urls_are_refused_by_default_naming_the_flag(layout: dict[str, Path]) -> None:
    message = _refusal(ServerLimits(), layout["inside"].as_uri())
    assert "--allowed-local-media-path" in message and "data: URL" in message
    # The same answer for a file that does not exist: nothing to probe.
    missing = _refusal(ServerLimits(), (layout["allowed"] / "nope.png").as_uri())
    assert missing.replace("nope", "ok") == message
    # Inline media stay allowed without the flag.
    assert _media(ServerLimits(), _png_url(8, 6))["image"][0].size == (8, 6)


def test_file_urls_inside_the_allowed_directory(layout: dict[str, Path]) -> None:
    limits = ServerLimits(allowed_local_media_path=layout["allowed"])
    assert _media(limits, layout["inside"].as_uri())["image"][0].size == (8, 6)
    # `..` that stays inside, and a relative spelling of the directory, are fine.
    dotted = f"file://{layout['allowed']}/../media/ok.png"
    assert _media(limits, dotted)["image"][0].size == (8, 6)
    assert "does not exist" in _refusal(limits, (layout["allowed"] / "nope.png").as_uri())


def test_file_urls_outside_the_allowed_directory(layout: dict[str, Path]) -> None:
    limits = ServerLimits(allowed_local_media_path=layout["allowed"])
    allowed = layout["allowed"]
    escapes = {
        "dotdot": f"file://{allowed}/../secret.png",
        "encoded dotdot": f"file://{allowed}/%2e%2e/secret.png",
        "symlink": (allowed / "escape.png").as_uri(),
        "absolute": layout["secret"].as_uri(),
        "host": f"file://otherhost{layout['inside']}",
        "NUL": f"file://{allowed}/ok.png%00",
    }
    for name, url in escapes.items():
        message = _refusal(limits, url)
        assert "not a file:// URL of a file inside the directory" in message, name
        assert str(allowed) not in message.replace(url[:80], ""), name  # the dir stays secret
    # Outside, a missing file is answered exactly as an existing one.
    there = _refusal(limits, layout["secret"].as_uri())
    missing = _refusal(limits, layout["secret"].with_name("secreT.png").as_uri())
    assert missing.replace("secreT", "secret") == there


def test_allowed_local_media_path_must_be_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        ServerLimits(allowed_local_media_path=tmp_path / "nope")
    # The command refuses it (and bad bounds) before loading any model.
    assert main(["serve", "/nonexistent/model", "--allowed-local-media-path", "/no/dir"]) == 2
    assert "--allowed-local-media-path '/no/dir' is not a directory" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model", "--max-request-body-bytes", "0"]) == 2
    assert "--max-request-body-bytes" in capsys.readouterr().err


def test_in_process_loading_still_reads_local_paths(tmp_path: Path) -> None:
    """In-process media loading (LLM.chat, ChatSession) is the process owner's: no policy.
    (test_server_vlm's reference answers come from LLM.chat given a file:// URL.)"""
    path = _png(tmp_path / "mine.png")
    assert load_image(path.as_uri()).size == load_image(str(path)).size == (8, 6)


# ---- media sizes -------------------------------------------------------------------------


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (the pixel data is not needed to refuse it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_image_pixel_bounds() -> None:
    small = ServerLimits(max_image_pixels=8 * 6)
    assert _media(small, _png_url(8, 6))["image"][0].size == (8, 6)
    assert "9x6 = 54 pixels, more than the 48 allowed" in _refusal(small, _png_url(9, 6))
    # Pillow's decompression-bomb guard stays on, and its error is a ValueError (a 400).
    with pytest.raises(ValueError, match="decompression bomb"):
        load_image(_bomb_png(20_000, 20_000))
    # Between Pillow's warning and error thresholds: refused from the header by the server.
    bomb = base64.b64encode(_bomb_png(10_000, 10_000)).decode()
    with pytest.warns(Image.DecompressionBombWarning):
        message = _refusal(ServerLimits(), "data:image/png;base64," + bomb)
    assert "10000x10000 = 100000000 pixels, more than the 89478485 allowed" in message
    # Many allowed images cannot add up past the per-request budget.
    budget = ServerLimits(max_media_pixels_per_request=100)
    assert len(_media(budget, _png_url(8, 6), _png_url(8, 6))["image"]) == 2
    message = _refusal(budget, _png_url(8, 6), _png_url(8, 6), _png_url(8, 6))
    assert "messages[0].content[2]" in message and "100 pixels one request" in message


def _clip_url(tmp_path: Path, frames: int, width: int = 32, height: int = 24) -> str:
    av = pytest.importorskip("av")
    path = tmp_path / "clip.mkv"  # Matroska does not state its length: frames are counted
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        for i in range(frames):
            image = np.full((height, width, 3), i * 10, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, "rgb24")))
        container.mux(stream.encode())
    return "data:video/x-matroska;base64," + base64.b64encode(path.read_bytes()).decode()


def test_video_frame_and_pixel_bounds(tmp_path: Path) -> None:
    url = _clip_url(tmp_path, frames=8)
    frames, _ = _media(ServerLimits(max_video_frames=8), url, kind="video_url")["video"][0]
    assert frames.shape == (8, 24, 32, 3)
    message = _refusal(ServerLimits(max_video_frames=7), url, kind="video_url")
    assert "more than the 7 frames allowed" in message
    message = _refusal(ServerLimits(max_image_pixels=32 * 24 - 1), url, kind="video_url")
    assert "a frame of video" in message and "32x24" in message


# ---- the HTTP layer: body size, n, batches -----------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models: Any, one_torch_thread: None) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_models["llama"]), dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


BODY_LIMIT = 16384


@pytest.fixture(scope="module")
def server(engine: AsyncLLM) -> Iterator[ServerThread]:
    state = ServerState(
        engine=engine,
        model_names=[MODEL],
        model_path=engine.engine.config.model.model_path,
        limits=ServerLimits(max_request_body_bytes=BODY_LIMIT),
    )
    with ServerThread(build_app(state)) as running:
        yield running


def _post(server: ServerThread, body: bytes, chunked: bool = False) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:  # no Content-Length: the bound must hold while the body streams in
            pieces = (body[i : i + 1000] for i in range(0, len(body), 1000))
            conn.request("POST", "/v1/completions", pieces, headers, encode_chunked=True)
        else:
            conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _completion_body(prompt_chars: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "a" * prompt_chars, "max_tokens": 1}).encode()


@pytest.mark.parametrize("chunked", [False, True])
def test_request_body_limit(server: ServerThread, chunked: bool) -> None:
    status, body = _post(server, _completion_body(BODY_LIMIT), chunked)
    assert status == 413, body
    assert body["error"]["type"] == "RequestTooLargeError"
    assert f"limit of {BODY_LIMIT} bytes" in body["error"]["message"]
    assert "--max-request-body-bytes" in body["error"]["message"]
    # Just under the limit is served.
    status, body = _post(server, _completion_body(100), chunked)
    assert status == 200 and body["choices"][0]["text"] is not None


def test_n_and_batch_bounds(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=f"n must be at most {MAX_N}, got 129"):
        client.completions.create(model=MODEL, prompt="hi", n=MAX_N + 1, max_tokens=1)
    # A batch of token-id prompts stays under the body limit but not under the count bound.
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_BATCH} per request"):
        client.completions.create(model=MODEL, prompt=[[1]] * (MAX_BATCH + 1), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="would start 2064 sequences"):
        client.completions.create(model=MODEL, prompt=[[1]] * 24, n=86, max_tokens=1)
    out = client.completions.create(model=MODEL, prompt=[[1]] * 2, n=2, max_tokens=1)
    assert len(out.choices) == 4


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"prompt_logprobs": 10**6}, "prompt_logprobs must be in [0, 20], got 1000000"),
        ({"stop": ["x"] * 17}, "stop holds 17 strings; at most 16"),
        ({"stop": "y" * 257}, "at most 256 characters, got one of 257"),
    ],
)
def test_sampling_bounds(server: ServerThread, extra: dict[str, Any], needle: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=re.escape(needle)):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=extra)


def test_max_tokens_is_bounded_by_the_context(server: ServerThread) -> None:
    """A huge max_tokens costs nothing up front and ends at the context's end."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = client.completions.create(
        model=MODEL, prompt=[1, 2], max_tokens=10**12, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == MAX_MODEL_LEN
