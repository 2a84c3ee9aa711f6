"""A GGUF model starts without transformers: its config, tokenizer and chat template come from
tinyvllm's own code, which must give exactly what transformers gives for the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from gguf_writer import write_tiny_gguf
from transformers import AutoTokenizer

import tinyvllm.gguf.config as gguf_config
from tinyvllm.gguf.bundled import smollm2_gguf_path
from tinyvllm.gguf.config import load_gguf_config, load_gguf_tokenizer, tokenizer_cache_dir
from tinyvllm.gguf.model_config import GGUFModelConfig
from tinyvllm.gguf.tokenizer import BACKEND_FILE, SNAPSHOT_FILE, SnapshotTokenizer
from tinyvllm.utils import chat_template as chat_template_module

FAMILIES = ("llama", "qwen2", "qwen3")
SMOLLM2 = smollm2_gguf_path()
# Every config attribute tinyvllm's models, loader and engine read.
CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "max_window_layers",
    "partial_rotary_factor",
    "original_max_position_embeddings",
)
TEXTS = (
    "Hello world! ünïcödé  x",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n\treturn x ** 2  # 数学 ✓ 🤖",
    "   leading spaces, trailing tab\t",
    "<|endoftext|>special<|im_end|> glued<|im_start|>",
    "",
    "a\u00a0b\u200bc\r\nd",
)


@pytest.fixture(scope="module")
def ggufs(tiny_models: Mapping[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gguf_startup")
    files = {f: write_tiny_gguf(tiny_models[f], root / f"{f}.gguf") for f in FAMILIES}
    files["llama-linear"] = write_tiny_gguf(
        tiny_models["llama"],
        root / "llama-linear.gguf",
        skip=("rope_freqs.weight",),
        metadata={"{arch}.rope.scaling.type": ("linear", _string()), **_factor(4.0)},
    )
    if SMOLLM2 is not None:
        files["smollm2"] = SMOLLM2
    return files


def _string() -> Any:
    import gguf

    return gguf.GGUFValueType.STRING


def _factor(value: float) -> dict[str, Any]:
    import gguf

    return {"{arch}.rope.scaling.factor": (value, gguf.GGUFValueType.FLOAT32)}


def _value(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    return dict(value) if isinstance(value, Mapping) else value


@pytest.mark.parametrize("name", [*FAMILIES, "llama-linear", "smollm2"])
def test_config_equals_transformers_config(
    name: str, ggufs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name not in ggufs:
        pytest.skip("SmolLM2 GGUF not installed")
    ours = load_gguf_config(ggufs[name])
    assert isinstance(ours, GGUFModelConfig)
    monkeypatch.setattr(gguf_config, "MODEL_TYPES", ())  # transformers' config class instead
    reference = load_gguf_config(ggufs[name])
    assert not isinstance(reference, GGUFModelConfig)
    for field in CONFIG_FIELDS:
        # A field one family's class lacks (mlp_bias, the sliding window ones): unused there.
        if not hasattr(reference, field) and field not in ("partial_rotary_factor",):
            continue
        assert _value(ours, field) == _value(reference, field), field
    assert str(reference.dtype).removeprefix("torch.") == ours.dtype


def _snapshot_and_reference(gguf_path: Path) -> tuple[SnapshotTokenizer, Any]:
    load_gguf_tokenizer(gguf_path)  # converts (once) and writes the snapshot
    cached = tokenizer_cache_dir(gguf_path.resolve())
    ours = load_gguf_tokenizer(gguf_path)
    assert isinstance(ours, SnapshotTokenizer), "the snapshot was not used"
    return ours, AutoTokenizer.from_pretrained(str(cached))


@pytest.mark.parametrize("name", ["llama", "qwen2", "smollm2"])
def test_snapshot_tokenizer_equals_transformers(name: str, ggufs: dict) -> None:
    if name not in ggufs:
        pytest.skip("SmolLM2 GGUF not installed")
    ours, ref = _snapshot_and_reference(ggufs[name])
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(
                text, add_special_tokens=add
            ), (text, add)
    ids = [i for t in TEXTS for i in ref.encode(t)] + list(range(0, min(len(ref), 600), 7))
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )
        assert ours.convert_ids_to_tokens(ids, skip) == ref.convert_ids_to_tokens(ids, skip)
    assert ours.decode(ids[3]) == ref.decode(ids[3])
    for clean in (True, False):
        assert ours.decode(ids, clean_up_tokenization_spaces=clean) == ref.decode(
            ids, clean_up_tokenization_spaces=clean
        )
    tokens = [*ref.convert_ids_to_tokens(ids[:20]), "never-a-token-xyz"]
    assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)
    for attr in ("special_tokens_map", "all_special_ids", "all_special_tokens", "chat_template"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    for key in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{key}_token") == getattr(ref, f"{key}_token"), key
        assert getattr(ours, f"{key}_token_id") == getattr(ref, f"{key}_token_id"), key
    assert (len(ours), ours.vocab_size, ours.get_vocab()) == (
        len(ref),
        ref.vocab_size,
        ref.get_vocab(),
    )
    added = ours.backend_tokenizer.get_added_tokens_decoder()
    assert added == ref.backend_tokenizer.get_added_tokens_decoder()
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <b>there</b> ✓"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And now?"},
    ]
    for gen in (True, False):
        kwargs = {"add_generation_prompt": gen}
        assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == (
            ref.apply_chat_template(chat, tokenize=False, **kwargs)
        )
        assert ours.apply_chat_template(chat, return_dict=False, **kwargs) == list(
            ref.apply_chat_template(chat, return_dict=False, **kwargs)
        )


TEMPLATES = {
    "tojson-namespace": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m | tojson }}{{ m | tojson(indent=2, sort_keys=true) }}{% endfor %}{{ ns.n }}"
        "{{ tools | tojson(separators=(',', ':')) }}"
    ),
    "loopcontrols-generation": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}<{{ m.role }}>{{ m.content }}{% endgeneration %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
        "{{ dict(a=1, b='x') | tojson }}{{ bos_token }}{% if add_generation_prompt %}GO{% endif %}"
    ),
    "reasoning": (
        "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}]{{ m.content }}"
        "{% endfor %}{{ strftime_now('%Y') | length }}"
    ),
}
CHAT = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": 'quote " and <html> & ünï'},
    {"role": "assistant", "content": "ok", "reasoning": "because"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "done"},
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_own_template_environment_renders_like_transformers(
    name: str, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    kwargs = {"add_generation_prompt": True, "tools": tools}
    expected = reference.apply_chat_template(
        CHAT, chat_template=TEMPLATES[name], tokenize=False, **kwargs
    )
    borrowed = chat_template_module.render_chat_template(
        reference, CHAT, chat_template=TEMPLATES[name], **kwargs
    )
    # As in a process that never imported transformers.
    monkeypatch.delitem(sys.modules, "transformers")
    chat_template_module._compile.cache_clear()
    try:
        own = chat_template_module.render_chat_template(
            reference, CHAT, chat_template=TEMPLATES[name], **kwargs
        )
    finally:
        chat_template_module._compile.cache_clear()
    assert own == borrowed == expected


def test_own_template_environment_keeps_transformers_guards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tinyvllm.utils.chat_template import ChatTemplateError

    monkeypatch.delitem(sys.modules, "transformers")
    chat_template_module._compile.cache_clear()

    class Tok:
        special_tokens_map: Mapping[str, str] = MappingProxyType({})

        def get_chat_template(self, template: str, tools: Any) -> str:
            return template

    try:
        with pytest.raises(ChatTemplateError, match="no way"):
            chat_template_module.render_chat_template(
                Tok(), CHAT, chat_template="{{ raise_exception('no way') }}"
            )
        with pytest.raises(ChatTemplateError, match="underscore"):
            chat_template_module.render_chat_template(
                Tok(), CHAT, chat_template="{% set ns = namespace(_x=1) %}"
            )
    finally:
        chat_template_module._compile.cache_clear()


def test_gguf_engine_runs_without_importing_transformers(
    ggufs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM(<GGUF>) + generate + chat in a fresh process leaves transformers unimported (the
    tokenizer was converted once before, as on any start after the first)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = ggufs["llama"]
    converted = load_gguf_tokenizer(path)  # the first start's conversion, in this process
    chat = [{"role": "user", "content": "hi"}]
    expected = converted.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    script = textwrap.dedent(
        f"""
        import json, sys
        from tinyvllm import LLM, SamplingParams
        llm = LLM({str(path)!r}, max_model_len=64, max_num_seqs=2)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate(["hello there"], params)[0].outputs[0]
        chat = llm.chat({chat!r}, params)[0]
        loaded = sorted(m for m in sys.modules if m.startswith("transformers"))
        print(json.dumps({{"n": len(out.token_ids), "chat": chat.prompt_token_ids,
                          "loaded": loaded}}))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=os.environ, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], result["loaded"]
    assert result["n"] == 4
    assert result["chat"] == list(expected)
    snapshot = next((tmp_path / "cache").rglob(SNAPSHOT_FILE))
    assert json.loads(snapshot.read_text())["format"] == 3


def test_damaged_snapshot_is_rebuilt(
    ggufs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = ggufs["qwen3"]
    first = load_gguf_tokenizer(path)  # converts, saves, snapshots
    cached = tokenizer_cache_dir(path.resolve())
    assert isinstance(load_gguf_tokenizer(path), SnapshotTokenizer)
    (cached / BACKEND_FILE).write_text("{broken")
    again = load_gguf_tokenizer(path)  # warns, rebuilds from the GGUF file
    assert again.encode(TEXTS[2]) == first.encode(TEXTS[2])
    assert isinstance(load_gguf_tokenizer(path), SnapshotTokenizer)
