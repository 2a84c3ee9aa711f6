"""A GGUF model's tokenizer, reloaded without transformers.

transformers converts a GGUF vocabulary into a fast tokenizer once (see
`gguf.tokenizer_cache.load_gguf_tokenizer`); importing transformers to reload that conversion
costs more than loading the model. So next to the converted tokenizer we save a snapshot of what
the loaded transformers tokenizer *is*: its `tokenizers` backend as transformers left it (post-
processor, added tokens and all), its special tokens and its chat template. `SnapshotTokenizer`
answers from that snapshot with the `tokenizers` library alone, giving transformers' results by
construction: encode and decode are the backend's own calls, as in transformers'
`TokenizersBackend`. A tokenizer class that changes encoding or decoding in Python gets no
snapshot and keeps loading through transformers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tinyvllm.utils.memory import release_free_heap

logger = logging.getLogger(__name__)

SNAPSHOT_FILE = "tinyvllm_tokenizer.json"
# The backend as transformers left it, in the `tokenizers` library's own format (a file of its
# own: `Tokenizer.from_file` parses it without a second JSON decode of a multi-MB string).
BACKEND_FILE = "tinyvllm_backend.json"
_FORMAT = 4  # 4: merges as "a b" strings where they can be
_NAMED = ("bos", "eos", "unk", "pad")
# transformers methods whose behaviour the snapshot reproduces only as TokenizersBackend has it.
_BACKEND_METHODS = (
    "encode",
    "decode",
    "_encode_plus",
    "_decode",
    "convert_ids_to_tokens",
    "_convert_token_to_id_with_added_voc",
    "get_chat_template",
    "clean_up_tokenization",
)
# transformers' decode clean-up (spaces a WordPiece detokenizer leaves before punctuation and
# contractions), applied in this order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class SnapshotTokenizer:
    """The parts of a transformers fast tokenizer that tinyvllm uses, from a snapshot."""

    is_fast = True

    def __init__(self, backend: Any, info: Mapping[str, Any], name_or_path: str) -> None:
        self._tokenizer = backend
        self._info = info
        self.name_or_path = name_or_path
        self.chat_template: str | dict[str, str] | None = info["chat_template"]
        self.model_max_length: int = info["model_max_length"]
        self.clean_up_tokenization_spaces: bool = info["clean_up_tokenization_spaces"]

    @classmethod
    def load(cls, directory: Path) -> SnapshotTokenizer | None:
        """The snapshot saved in `directory`, or None when there is none (or it is stale)."""
        from tokenizers import Tokenizer

        try:
            info = json.loads((directory / SNAPSHOT_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        if not isinstance(info, dict) or info.get("format") != _FORMAT:
            return None
        backend = Tokenizer.from_file(str(directory / BACKEND_FILE))
        release_free_heap()  # the parse's temporaries (see there)
        backend.encode_special_tokens = info["split_special_tokens"]
        return cls(backend, info, str(directory))

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    # --- special tokens ---------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, Any]:
        return dict(self._info["special_tokens_map"])

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._info["all_special_ids"])

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._info["all_special_tokens"])

    @property
    def bos_token(self) -> str | None:
        return self._info["tokens"]["bos"]

    @property
    def eos_token(self) -> str | None:
        return self._info["tokens"]["eos"]

    @property
    def unk_token(self) -> str | None:
        return self._info["tokens"]["unk"]

    @property
    def pad_token(self) -> str | None:
        return self._info["tokens"]["pad"]

    @property
    def bos_token_id(self) -> int | None:
        return self._info["ids"]["bos"]

    @property
    def eos_token_id(self) -> int | None:
        return self._info["ids"]["eos"]

    @property
    def unk_token_id(self) -> int | None:
        return self._info["ids"]["unk"]

    @property
    def pad_token_id(self) -> int | None:
        return self._info["ids"]["pad"]

    # --- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(token) for token in tokens]

    def _token_to_id(self, token: str) -> int | None:
        index = self._tokenizer.token_to_id(token)
        return self.unk_token_id if index is None else index

    # --- text -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """`input_ids` and `attention_mask` of a text (or a list of texts), unpadded."""
        if isinstance(text, str):
            ids: Any = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        rows = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE models (it would eat real spaces).
        if clean_up_tokenization_spaces and self._info["clean_up_applies"]:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    # --- chat -------------------------------------------------------------------------------
    def get_chat_template(
        self, chat_template: str | None = None, tools: list[Any] | None = None
    ) -> str:
        """The template `apply_chat_template` renders: a named one, the tool-use one when tools
        are given, the default one, or the tokenizer's only one (transformers' order)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(
                    "this tokenizer has several chat templates and none is named 'default'; "
                    f"pass chat_template= one of {sorted(templates)}"
                )
            return chat_template
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        return templates

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> str | list[int] | dict[str, Any]:
        """transformers' `apply_chat_template` for one conversation."""
        from tinyvllm.utils.chat_template import render_chat_template

        text = render_chat_template(
            self,
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def snapshot_info(tokenizer: Any) -> dict[str, Any] | None:
    """What `SnapshotTokenizer` needs from a loaded transformers tokenizer, or None when the
    snapshot could not give the same results (a class with its own encoding or decoding)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - transformers without the v5 backend
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or any(
        getattr(cls, name, None) is not getattr(TokenizersBackend, name, None)
        for name in _BACKEND_METHODS
    ):
        return None
    bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    template = tokenizer.chat_template
    return {
        "format": _FORMAT,
        "chat_template": dict(template) if isinstance(template, Mapping) else template,
        "special_tokens_map": tokenizer.special_tokens_map,
        "all_special_ids": list(tokenizer.all_special_ids),
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "tokens": {k: _plain(getattr(tokenizer, f"{k}_token")) for k in _NAMED},
        "ids": {k: getattr(tokenizer, f"{k}_token_id") for k in _NAMED},
        "split_special_tokens": bool(tokenizer.split_special_tokens),
        "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
        "clean_up_applies": not bpe or bool(getattr(tokenizer, force, False)),
        "model_max_length": int(tokenizer.model_max_length),
    }


def _plain(token: Any) -> str | None:
    return None if token is None else str(token)


def _merges_as_strings(backend: str) -> str:
    """The backend's JSON with a BPE model's merges as "a b" strings instead of ["a", "b"]
    pairs: the same merges in the same order, which `tokenizers` parses ~25% faster (Gemma 3:
    515k merges, 1.5 -> 1.15 s of the tokenizer's load). Unchanged when a merged piece holds
    a space, which only the pair form can say."""
    data = json.loads(backend)
    model = data.get("model")
    merges = model.get("merges") if isinstance(model, dict) else None
    if model is None or model.get("type") != "BPE" or not isinstance(merges, list):
        return backend
    if not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return backend
    if any(" " in piece for merge in merges for piece in merge):
        return backend
    model["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False)


def save_snapshot(tokenizer: Any, directory: Path) -> None:
    """Write the snapshot of `tokenizer` into `directory` (nothing when it cannot be exact)."""
    info = snapshot_info(tokenizer)
    if info is None:
        return
    try:
        # Each file written whole, then renamed (another process may be reading the
        # directory); the backend first, as the info file says the snapshot is complete.
        texts = (
            (BACKEND_FILE, _merges_as_strings(tokenizer.backend_tokenizer.to_str())),
            (SNAPSHOT_FILE, json.dumps(info)),
        )
        for name, text in texts:
            tmp = directory / f".{name}.{os.getpid()}"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, directory / name)
    except (TypeError, ValueError, OSError) as exc:  # an exotic token map, a read-only cache
        logger.info("no tokenizer snapshot in %s: %s", directory, exc)
