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
from fixtures import build_tiny_checkpoint
from gguf_writer import write_tiny_gguf
from transformers import AutoTokenizer

import tinyvllm.gguf.config as gguf_config
from tinyvllm.gguf.bundled import catalog_gguf_path, smollm2_gguf_path
from tinyvllm.gguf.config import load_gguf_config
from tinyvllm.gguf.model_config import GGUFGemma3Config, GGUFModelConfig
from tinyvllm.gguf.tokenizer import BACKEND_FILE, SNAPSHOT_FILE, SnapshotTokenizer
from tinyvllm.gguf.tokenizer_cache import load_gguf_tokenizer, tokenizer_cache_dir
from tinyvllm.utils import chat_template as chat_template_module

FAMILIES = ("llama", "qwen2", "qwen3")
SMOLLM2 = smollm2_gguf_path()
GEMMA3 = catalog_gguf_path("Gemma-3-270M")  # on disk already (never fetched by these tests)
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
# Gemma's SentencePiece-style BPE: turn and other added tokens, spaces as "▁" (runs of them,
# a literal "▁"), byte fallback for what the vocabulary lacks (rare CJK, emoji ZWJ sequences,
# control characters).
GEMMA_TEXTS = (
    *TEXTS,
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\n  spaced   out\t\tand\n\n\nnewlines <end_of_turn>",
    "▁literal ▁▁ markers and     five spaces",
    "Ünïcödé façade — naïve café; Ελληνικά, Русский, עברית, العربية, हिन्दी",
    "𠀋𪚥 rare CJK 龘 and 👩\u200d👩\u200d👧\u200d👦 family 🏳️\u200d🌈",
    "ctrl \x00\x01\x7f bell\x07 <unused0><mask>[multimodal]<pad><eos>",
    "<start_of_image><end_of_image> not images, just text <unk>",
    " " * 40 + "indented" + "\n" * 5,
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
    if GEMMA3 is not None:
        files["gemma3-270m"] = GEMMA3
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


# Gemma's turn format (as its instruction-tuned models' template writes it, system folded into
# the first user turn) for a base model, whose file has no template.
GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}{% if m.role != 'system' %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content | trim }}<end_of_turn>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# Every config attribute tinyvllm reads from a Gemma 3 config (the models probe some with
# `getattr` defaults, so an attribute HF's class lacks must be absent from ours too).
GEMMA3_FIELDS = (
    *CONFIG_FIELDS,
    "hidden_activation",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
    "rope_theta",
    "text_config",
    "vision_config",
    "attention_dropout",
)
_ABSENT = object()


def _gemma3_gguf(root: Path, tokenizer_dir: Path, name: str) -> Path:
    """A tiny Gemma 3 GGUF with what a file can say: llama.cpp's period-6 layer pattern and a
    query scale of head_dim; variants add rope scaling or soft-caps."""
    import gguf

    checkpoint = build_tiny_checkpoint(
        "gemma3",
        root / name,
        tokenizer_dir,
        num_hidden_layers=7,
        layer_types=None,
        sliding_window_pattern=6,
        query_pre_attn_scalar=16,
    )
    f32, string = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    metadata = {
        "gemma3": {},
        "gemma3-softcap": {
            "{arch}.final_logit_softcapping": (30.0, f32),
            "{arch}.attn_logit_softcapping": (50.0, f32),
        },
        "gemma3-linear": {"{arch}.rope.scaling.type": ("linear", string), **_factor(8.0)},
        "gemma3-yarn": {
            "{arch}.rope.scaling.type": ("yarn", string),
            **_factor(4.0),
            "{arch}.rope.scaling.original_context_length": (64, gguf.GGUFValueType.UINT32),
        },
    }[name]
    return write_tiny_gguf(checkpoint, root / f"{name}.gguf", metadata=metadata)


@pytest.mark.parametrize(
    "name", ["gemma3", "gemma3-softcap", "gemma3-linear", "gemma3-yarn", "gemma3-270m"]
)
def test_gemma3_config_equals_transformers_config(
    name: str, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name == "gemma3-270m" and GEMMA3 is None:
        pytest.skip("Gemma 3 270M GGUF not on disk (tinyvllm chat -m Gemma-3-270M fetches it)")
    path = GEMMA3 if name == "gemma3-270m" else _gemma3_gguf(tmp_path, tokenizer_dir, name)
    assert path is not None
    ours = load_gguf_config(path)
    assert isinstance(ours, GGUFGemma3Config)
    monkeypatch.setattr(gguf_config, "MODEL_TYPES", ())  # transformers' config class instead
    reference = load_gguf_config(path)
    assert type(reference).__name__ == "Gemma3TextConfig"
    for field in GEMMA3_FIELDS:
        mine = _value(ours, field) if hasattr(ours, field) else _ABSENT
        theirs = _value(reference, field) if hasattr(reference, field) else _ABSENT
        assert mine == theirs, field
    assert str(reference.dtype).removeprefix("torch.") == ours.dtype


def _snapshot_and_reference(gguf_path: Path) -> tuple[SnapshotTokenizer, Any]:
    load_gguf_tokenizer(gguf_path)  # converts (once) and writes the snapshot
    cached = tokenizer_cache_dir(gguf_path.resolve())
    ours = load_gguf_tokenizer(gguf_path)
    assert isinstance(ours, SnapshotTokenizer), "the snapshot was not used"
    # Merges stored as "a b" strings (the faster form to parse; none of these has a space).
    merges = json.loads((cached / BACKEND_FILE).read_text(encoding="utf-8"))["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    return ours, AutoTokenizer.from_pretrained(str(cached))


@pytest.mark.parametrize(
    "name",
    # transformers loads Gemma's 262k-token vocabulary in seconds, the checks take ~25 s.
    ["llama", "qwen2", "smollm2", pytest.param("gemma3-270m", marks=pytest.mark.slow)],
)
def test_snapshot_tokenizer_equals_transformers(name: str, ggufs: dict) -> None:
    if name not in ggufs:
        pytest.skip(f"{name} GGUF not on disk")
    ours, ref = _snapshot_and_reference(ggufs[name])
    texts = GEMMA_TEXTS if name.startswith("gemma") else TEXTS
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(
                text, add_special_tokens=add
            ), (text, add)
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    # Every token id alone too (a lone byte-fallback piece decodes to U+FFFD), and ids from
    # across the whole vocabulary (added tokens sit in the first thousands for Gemma).
    spread = range(0, len(ref), max(1, len(ref) // 2000))
    for i in [*range(0, min(len(ref), 300)), *spread]:
        assert ours.decode([i]) == ref.decode([i]), i
    ids = [i for t in texts for i in ref.encode(t)] + list(range(0, min(len(ref), 600), 7))
    ids += list(spread)
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
        kwargs: dict[str, Any] = {"add_generation_prompt": gen}
        if ref.chat_template is None:  # a base model (Gemma 3 270M): the user passes one
            with pytest.raises(ValueError, match="no chat template"):
                ours.apply_chat_template(chat, **kwargs)
            kwargs["chat_template"] = GEMMA_TURNS
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


# Peak RSS of the Gemma 3 270M process below (max_model_len=64): ~610 MiB, of it torch ~220,
# the tokenizer ~100 and the weights 242; 909 MiB before the lean load (transformers' config
# import, the embedding held twice, the tokenizer parse's freed heap kept).
GEMMA3_PEAK_RSS_MIB = 800


@pytest.mark.parametrize("name", ["llama", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_gguf_engine_runs_without_importing_transformers(
    name: str, ggufs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM(<GGUF>) + generate + chat in a fresh process leaves transformers unimported (the
    tokenizer was converted once before, as on any start after the first)."""
    if name not in ggufs:
        pytest.skip(f"{name} GGUF not on disk (tinyvllm chat -m Gemma-3-270M fetches it)")
    path = ggufs[name]
    template = None
    if name == "llama":
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        converted = load_gguf_tokenizer(path)  # the first start's conversion, in this process
    else:  # converting Gemma's 262k vocabulary takes minutes: the user's cache keeps it
        load_gguf_tokenizer(path)
        converted = AutoTokenizer.from_pretrained(str(tokenizer_cache_dir(path.resolve())))
        template = GEMMA_TURNS  # a base model: no template in the file
    chat = [{"role": "user", "content": "hi"}]
    expected = converted.apply_chat_template(
        chat, chat_template=template, add_generation_prompt=True, return_dict=False
    )
    script = textwrap.dedent(
        f"""
        import json, sys
        from tinyvllm import LLM, SamplingParams
        llm = LLM({str(path)!r}, max_model_len=64, max_num_seqs=2)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate(["hello there"], params)[0].outputs[0]
        chat = llm.chat({chat!r}, params, chat_template={template!r})[0]
        loaded = sorted(m for m in sys.modules if m.startswith("transformers"))
        # VmHWM, not ru_maxrss: that one carries over the forking pytest process's peak.
        status = open("/proc/self/status").read().split("VmHWM:")[1]
        rss = int(status.split()[0]) / 1024
        print(json.dumps({{"n": len(out.token_ids), "chat": chat.prompt_token_ids,
                          "loaded": loaded, "rss": rss}}))
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
    if name == "llama":
        snapshot = next((tmp_path / "cache").rglob(SNAPSHOT_FILE))
        assert json.loads(snapshot.read_text())["format"] == 4
    else:
        assert result["rss"] < GEMMA3_PEAK_RSS_MIB, result["rss"]


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


def test_merges_as_strings_only_where_no_piece_holds_a_space() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from tinyvllm.gguf.tokenizer import _merges_as_strings

    vocab = {"a": 0, "b": 1, " ": 2, "ab": 3, "a ": 4, "a b": 5, "abb": 6}
    plain = Tokenizer(BPE(vocab, [("a", "b"), ("ab", "b")])).to_str()
    spaced = Tokenizer(BPE(vocab, [("a", " "), ("a ", "b")])).to_str()
    assert _merges_as_strings(spaced) == spaced  # only the pair form can say "a " + "b"
    compact = _merges_as_strings(plain)
    assert json.loads(compact)["model"]["merges"] == ["a b", "ab b"]
    for text in ("abb", "ab", "babba"):
        expected = Tokenizer.from_str(plain).encode(text).ids
        assert Tokenizer.from_str(compact).encode(text).ids == expected, text
