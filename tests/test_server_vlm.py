"""Chat completions with image and video content parts on a tiny random Qwen2.5-VL, served as
`tinyvllm serve MODEL --video-pruning-rate 0.5` serves it: data: and file:// URLs give the
greedy text `LLM.chat` gives for the same content; remote URLs and bad media are 400s."""

from __future__ import annotations

import base64
import io
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_helpers import ServerThread, served_state  # noqa: E402
from vlm_fixtures import build_tiny_vlm, moving_clip, random_image  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.server.app import build_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 8
PRUNING = 0.5
ENGINE_FLAGS = {
    "--dtype": "float32",
    "--max-model-len": "512",
    "--kv-cache-memory-bytes": str(2**24),
    "--seed": "0",
    "--video-pruning-rate": str(PRUNING),
}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"), tokenizer_dir)


@pytest.fixture(scope="module")
def llm(vlm_dir: Path, one_torch_thread: None) -> LLM:
    """The in-process reference, with the engine arguments the server gets from its flags."""
    return LLM(
        str(vlm_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=2**24,
        seed=0,
        video_pruning_rate=PRUNING,
        device="cpu",
        enforce_eager=True,
    )


@pytest.fixture(scope="module")
def state(vlm_dir: Path, one_torch_thread: None) -> Iterator[Any]:
    flags = [item for pair in ENGINE_FLAGS.items() for item in pair]
    served = served_state([str(vlm_dir), "--served-model-name", "vlm", "--enforce-eager", *flags])
    yield served
    served.engine.shutdown()


@pytest.fixture(scope="module")
def client(state: Any) -> Iterator[Any]:
    with ServerThread(build_app(state)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _png_data_url(seed: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(random_image(56, 84, seed)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _reference(llm: LLM, content: list[dict[str, Any]]) -> Any:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]


def _ask(client: Any, content: list[dict[str, Any]], stream: bool = False) -> Any:
    return client.chat.completions.create(
        model="vlm",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )


def test_data_url_image_matches_llm_chat(client: Any, llm: LLM) -> None:
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": _png_data_url(seed=1)}},
        {"type": "text", "text": " this picture?"},
    ]
    reference = _reference(llm, content)
    out = _ask(client, content)
    assert out.choices[0].message.content == reference.outputs[0].text
    # The placeholder was expanded to the image's tokens, as in-process.
    assert out.usage.prompt_tokens == len(reference.prompt_token_ids) > 20
    streamed = "".join(c.choices[0].delta.content or "" for c in _ask(client, content, True))
    assert streamed == reference.outputs[0].text
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}]}
    tokenize = urllib.request.Request(
        str(client.base_url).replace("/v1/", "/tokenize"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(tokenize) as response:
        assert json.load(response)["tokens"] == reference.prompt_token_ids


def test_file_url_image_and_data_url_video(
    client: Any, llm: LLM, state: Any, tmp_path: Path
) -> None:
    """A file:// image and an inline video (a lossless clip), pruned at --video-pruning-rate."""
    av = pytest.importorskip("av")
    from PIL import Image

    png = tmp_path / "picture.png"
    Image.fromarray(random_image(56, 56, seed=2)).save(png)
    clip = tmp_path / "clip.mkv"
    with av.open(str(clip), "w") as container:
        stream = container.add_stream("ffv1", rate=4)
        stream.width, stream.height, stream.pix_fmt = 196, 56, "yuv444p"
        for frame in moving_clip(8, 56, 196, seed=3):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, "rgb24")))
        container.mux(stream.encode())
    video_url = "data:video/x-matroska;base64," + base64.b64encode(clip.read_bytes()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": png.as_uri()}},
        {"type": "text", "text": " then "},
        {"type": "video_url", "video_url": {"url": video_url}},
    ]
    reference = _reference(llm, content)
    out = _ask(client, content)
    assert out.choices[0].message.content == reference.outputs[0].text
    assert out.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert state.engine.engine.config.model.video_pruning_rate == PRUNING


@pytest.mark.parametrize(
    ("part", "needle"),
    [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            "not fetched by this server; send the file inline as a data: URL",
        ),
        ({"type": "image_url", "image_url": {"url": "/etc/hostname"}}, "data: or file://"),
        ({"type": "image_url", "image_url": {"url": "file:///no/such.png"}}, "does not exist"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "decode"),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            "could not decode video",
        ),
        ({"type": "image", "image": "/etc/hostname"}, "unsupported content part type 'image'"),
        ({"type": "image_url", "image_url": {}}, '"url"'),
    ],
)
def test_bad_media_parts_are_400s(client: Any, part: dict[str, Any], needle: str) -> None:
    with pytest.raises(openai.BadRequestError, match=needle):
        _ask(client, [{"type": "text", "text": "look"}, part])
    # The server keeps serving.
    assert _ask(client, [{"type": "text", "text": "ok"}]).choices[0].message.content is not None
