"""A transformers fast tokenizer's behaviour from its saved files, with `tokenizers` and jinja2 only.

Why: `AutoTokenizer.from_pretrained` imports transformers (a second or more) on every start, and
fw's serving path needs only encode, decode, the vocabulary, the special tokens and the chat
template. The first load of a tokenizer goes through transformers, and `save_snapshot` keeps what
it built: its backend as tokenizer.json (after transformers' own adjustments), and the attributes
fw reads (special tokens, clean-up rule, chat template) in fw-tokenizer.json. Later starts load
that with `tokenizers` directly (`FastTokenizer`). Only the plain fast tokenizer class is kept this
way: a subclass that overrides how text is encoded, decoded or rendered stays with transformers.

Whatever `FastTokenizer` does not implement itself (an unusual keyword, an attribute fw does not
read) goes to the transformers tokenizer, loaded on first use from the same files, so callers of
`LLM.tokenizer` still get transformers' full interface; `transformers_tokenizer()` hands it out
for libraries that need the real object (xgrammar). tests/test_fast_tokenizer.py checks equality
with transformers on a corpus of tricky strings and chat templates."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer


logger = logging.getLogger("fw.tokenizer")

SNAPSHOT_FILE = "fw-tokenizer.json"  # the attributes; written last, so its presence means a whole snapshot
BACKEND_FILE = "fw-tokenizer-backend.json"  # the `tokenizers` backend as transformers left it
SNAPSHOT_VERSION = 1

# The tokenizer methods transformers' plain fast tokenizer class defines and FastTokenizer reproduces:
# a subclass that overrides one of them behaves differently, so it is not snapshotted.
_REPRODUCED = ("__call__", "encode", "decode", "batch_decode", "_decode", "_encode_plus", "_batch_encode_plus",
               "apply_chat_template", "get_chat_template", "convert_tokens_to_string", "clean_up_tokenization",
               "get_vocab", "convert_tokens_to_ids", "convert_ids_to_tokens")


class Encoding(dict):
    """What `tokenizer(text)` returns: `input_ids` and `attention_mask`, as keys and as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def snapshot_supported(tok: Any) -> bool:
    """True for transformers' plain fast tokenizer (TokenizersBackend), or a subclass that changes none
    of the behaviour FastTokenizer reproduces."""
    try:
        # here: transformers costs start-up time
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tok)
    if not isinstance(tok, TokenizersBackend) or getattr(tok, "_tokenizer", None) is None:
        return False
    return all(getattr(cls, name, None) is getattr(TokenizersBackend, name, None) for name in _REPRODUCED)


def _decode_cleans_up(tok: Any) -> bool:
    """Whether transformers' decode applies clean_up_tokenization (it skips it for BPE models unless forced)."""
    if not tok.clean_up_tokenization_spaces:
        return False
    return not (type(tok.backend_tokenizer.model).__name__ == "BPE" and getattr(
        tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))


def save_snapshot(tok: Any, folder: Path) -> None:
    """Write `tok` (a transformers tokenizer for which `snapshot_supported` holds) to `folder`, beside
    whatever else is there; the attributes file goes last, by rename."""
    backend = folder / (BACKEND_FILE + f".{os.getpid()}.tmp")
    tok.backend_tokenizer.save(str(backend))
    os.replace(backend, folder / BACKEND_FILE)
    template = tok.chat_template
    meta = {
        "version": SNAPSHOT_VERSION,
        "class": type(tok).__name__,
        "name_or_path": str(tok.name_or_path),
        "special_tokens_map": {k: v if isinstance(v, (str, list)) else str(v) for k, v in tok.special_tokens_map.items()},
        "special_token_ids": {k: getattr(tok, k + "_id", None) for k in tok.special_tokens_map
                              if isinstance(tok.special_tokens_map[k], str)},
        "all_special_ids": list(tok.all_special_ids),
        "all_special_tokens": list(tok.all_special_tokens),
        "added_tokens": {str(i): [t.content, bool(t.special)] for i, t in tok.added_tokens_decoder.items()},
        "clean_up": _decode_cleans_up(tok),
        "chat_template": template if isinstance(template, (str, dict)) or template is None else str(template),
        "padding_side": tok.padding_side,
        "truncation_side": tok.truncation_side,
        "model_max_length": tok.model_max_length,
    }
    tmp = folder / (SNAPSHOT_FILE + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, folder / SNAPSHOT_FILE)


def load_snapshot(folder: Path, transformers_loader: Callable[[], Any]) -> "FastTokenizer | None":
    """The FastTokenizer kept in `folder`, or None if it holds none (or one of another snapshot version)."""
    try:
        meta = json.loads((folder / SNAPSHOT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("version") != SNAPSHOT_VERSION:
        return None
    return FastTokenizer(Tokenizer.from_file(str(folder / BACKEND_FILE)), meta, transformers_loader)


class FastTokenizer:
    """The subset of transformers' tokenizer interface fw uses, computed with `tokenizers`; the rest
    is delegated to the transformers tokenizer (`transformers_tokenizer()`), loaded on first use."""

    def __init__(self, backend: Tokenizer, meta: dict, transformers_loader: Callable[[], Any]):
        # A tokenizer.json may carry fixed padding and truncation (sentence-transformers' files pad to 128):
        # transformers turns both off for a call that asks for neither, and so does fw.
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer = backend
        self._meta = meta
        self._load_transformers = transformers_loader
        self._transformers: Any = None
        self._lock = threading.Lock()
        self.name_or_path = meta["name_or_path"]
        self.chat_template = meta["chat_template"]
        self.special_tokens_map = dict(meta["special_tokens_map"])
        self.all_special_ids = list(meta["all_special_ids"])
        self.all_special_tokens = list(meta["all_special_tokens"])
        self.padding_side = meta["padding_side"]
        self.truncation_side = meta["truncation_side"]
        self.model_max_length = meta["model_max_length"]
        for name, token in self.special_tokens_map.items():
            if isinstance(token, str):
                setattr(self, name, token)
                setattr(self, name + "_id", meta["special_token_ids"].get(name))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if name not in self.special_tokens_map:
                setattr(self, name, None)
                setattr(self, name + "_id", None)

    # --- what the serving path uses -----------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        from tokenizers import AddedToken  # here: tokenizers loads only when a tokenizer is built

        return {int(i): AddedToken(content, special=special) for i, (content, special)
                in self._meta["added_tokens"].items()}

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> Encoding:
        if kwargs or not isinstance(text, (str, list)):
            return self.transformers_tokenizer()(text, add_special_tokens=add_special_tokens, **kwargs)
        batch = [text] if isinstance(text, str) else text
        encoded = self._tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encoded]
        masks = [e.attention_mask for e in encoded]
        if isinstance(text, str):
            return Encoding(input_ids=ids[0], attention_mask=masks[0])
        return Encoding(input_ids=ids, attention_mask=masks)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs: Any):
        if kwargs or isinstance(token_ids, dict) or not isinstance(token_ids, (int, list, tuple)):
            return self.transformers_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(list(seq), skip_special_tokens) for seq in token_ids]
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._meta["clean_up"] else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        return [self.decode(seq, skip_special_tokens=skip_special_tokens, **kwargs) for seq in sequences]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            token_id = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if token_id is None else token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        return self._template(chat_template, tools)

    def apply_chat_template(self, conversation, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any):
        """transformers' apply_chat_template for one conversation whose tools are JSON schemas, rendering to
        text (tokenize=False) or to ids; every other form goes to transformers."""
        plain = (isinstance(conversation, (list, tuple)) and conversation
                 and not isinstance(conversation[0], (list, tuple)) and not hasattr(conversation[0], "messages")
                 and all(isinstance(t, dict) for t in tools or ())
                 and not set(kwargs) & {"continue_final_message", "sanitize_control_tokens", "padding",
                                        "truncation", "max_length", "return_tensors", "return_dict",
                                        "return_assistant_tokens_mask", "tokenizer_kwargs"})
        if not plain:  # this object's template: it may be --chat-template's, not the one transformers loaded
            return self.transformers_tokenizer().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=self._template(chat_template, tools),
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
        from fw import chat_template as templates  # jinja2 only when a chat is rendered (start-up time)

        template = self._template(chat_template, tools)
        text = templates.render(template, conversation, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        return Encoding(self(text, add_special_tokens=False))  # transformers' return_dict=True default

    def _template(self, chosen: str | None, tools: list | None) -> str:
        """transformers' get_chat_template: a named template of a dict of them, the tool_use one with
        tools, else the default; a single template unless the caller passes one."""
        own = self.chat_template
        if isinstance(own, dict):
            if chosen is not None and chosen in own:
                return own[chosen]
            if chosen is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Please either "
                                 "pass a chat template or the name of the template you wish to use to the "
                                 f"`chat_template` argument. Available template names are {sorted(own)}.")
            return chosen
        if chosen is not None:
            return chosen
        if own is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed!")
        return own

    # --- everything else: transformers ---------------------------------------------------------------

    def transformers_tokenizer(self) -> Any:
        """The transformers tokenizer these files make (loaded once, on first use: about a second)."""
        with self._lock:
            if self._transformers is None:
                logger.debug("loading transformers' tokenizer for %s", self.name_or_path)
                self._transformers = self._load_transformers()
            return self._transformers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_tokenizer", "_meta", "_load_transformers", "_transformers", "_lock"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, class={self._meta['class']})"


_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and English contractions)."""
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text

