"""Loading images (Pillow) and video files (PyAV) for multimodal prompts."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tinyvllm.multimodal.media import decode_video, load_image, load_video


def _png_bytes(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (7, 5), color).save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_from_every_source(tmp_path: Path) -> None:
    data = _png_bytes((10, 20, 30))
    path = tmp_path / "a b.png"  # a space: file:// URLs percent-encode it
    path.write_bytes(data)
    sources = [
        path,
        str(path),
        path.as_uri(),
        data,
        "data:image/png;base64," + base64.b64encode(data).decode(),
    ]
    for source in sources:
        image = load_image(source)
        assert image.size == (7, 5)
        assert np.asarray(image.convert("RGB"))[0, 0].tolist() == [10, 20, 30]


def test_load_image_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.png"):
        load_image(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="remote URLs are not fetched"):
        load_image("https://example.com/cat.png")
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"could not decode image .*notes\.txt"):
        load_image(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="invalid base64"):
        load_image("data:image/png;base64,@@@")


def _write_video(path: Path, values: list[int], codec: str, pix_fmt: str) -> None:
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 24, pix_fmt
        for value in values:
            frame = av.VideoFrame.from_ndarray(np.full((24, 32, 3), value, np.uint8), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


# Lossless codecs; Matroska does not store the frame count (frames are sampled after decoding),
# QuickTime does (only the sampled frames are converted).
@pytest.mark.parametrize(
    ("name", "codec", "pix_fmt"),
    [("clip.mkv", "ffv1", "yuv444p"), ("clip.mov", "png", "rgb24")],
)
def test_load_video(tmp_path: Path, name: str, codec: str, pix_fmt: str) -> None:
    path = tmp_path / name
    values = [0, 40, 80, 120, 160, 200, 240]
    _write_video(path, values, codec, pix_fmt)
    frames = load_video(path.as_uri())
    assert frames.shape == (7, 24, 32, 3) and frames.dtype == np.uint8
    assert frames[:, 0, 0, 0].tolist() == values
    clip = decode_video(path, num_frames=3)
    assert clip.frames[:, 0, 0, 0].tolist() == [0, 120, 240]  # first, middle, last
    assert clip.fps == pytest.approx(10 * 3 / 7)
    assert load_video(path.read_bytes()).shape[0] == 7


def test_load_video_errors(tmp_path: Path) -> None:
    pytest.importorskip("av")
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"could not decode video .*bad\.mp4"):
        load_video(tmp_path / "bad.mp4")
    with pytest.raises(FileNotFoundError, match=r"nope\.mp4"):
        load_video(tmp_path / "nope.mp4")
    with pytest.raises(ValueError, match="num_frames=0"):
        load_video(tmp_path / "bad.mp4", num_frames=0)


def test_missing_pyav_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'tinyvllm\[video\]'"):
        load_video(tmp_path / "clip.mp4")
