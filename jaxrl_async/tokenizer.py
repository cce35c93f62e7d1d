"""Tokenizers: Hugging Face `tokenizer.json` (with chat template) and a built-in character vocabulary."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol

from jaxrl_async import storage


class Tokenizer(Protocol):
    """What the rest of the stack needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


# Characters the synthetic tasks need (arithmetic, countdown); id 0 = pad, 1 = bos, 2 = eos.
CHAR_VOCAB = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ<>#\n"


class CharTokenizer:
    """A tiny character-level tokenizer for synthetic tasks; ids 0/1/2 are pad/bos/eos."""

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self, chars: str = CHAR_VOCAB):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: duplicate characters in vocabulary")
        self.chars = chars
        self._to_id = {c: i + 3 for i, c in enumerate(chars)}
        self.vocab_size = len(chars) + 3
        self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if (
                3 <= i < self.vocab_size
            ):  # ids past the vocabulary (a padded embedding table) decode to nothing
                out.append(self.chars[i - 3])
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        # No chat format for synthetic tasks: the prompt is the last user message verbatim.
        return messages[-1]["content"]

    def save_hf(self, path: str) -> None:
        """Writes `tokenizer.json` + `tokenizer_config.json` to `path`: a Hugging Face fast tokenizer with
        exactly these ids (a word-level vocabulary of single characters, every character its own word), so
        that transformers, TRL or Tunix encode a prompt to the ids this run trained on."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _Tok

        # "|" is outside the vocabulary, so no text this tokenizer encodes can spell a special token.
        specials = ("<|pad|>", "<|bos|>", "<|eos|>")  # ids PAD, BOS, EOS
        vocab = {**{t: i for i, t in enumerate(specials)}, **{c: i + 3 for i, c in enumerate(self.chars)}}
        tok = _Tok(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()  # characters join without spaces
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        os.makedirs(path, exist_ok=True)
        tok.save(os.path.join(path, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": specials[self.PAD],
                  "bos_token": specials[self.BOS], "eos_token": specials[self.EOS]}  # fmt: skip
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)


class HFTokenizer:
    """A Hugging Face fast tokenizer read from `tokenizer.json`, with the chat template if present."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        path = storage.local_dir(path)  # a gs:// directory: this host's copy of its files
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = _Tok.from_file(tok_file)
        cfg = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        self.chat_template = cfg.get("chat_template")
        if self.chat_template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                self.chat_template = f.read()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if eos is None:
            eos = _eos_from_generation_config(path)
        if eos is None:
            raise ValueError(f"{path}: cannot find the eos token (tokenizer_config.json 'eos_token')")
        self.eos_id = int(eos)
        pad = _token_str(cfg.get("pad_token"))
        pad_id = self._tok.token_to_id(pad) if pad else None
        self.pad_id = int(pad_id) if pad_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            text = "\n".join(m["content"] for m in messages)
            return (self.bos_token or "") + text
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        tmpl = env.from_string(self.chat_template)
        return tmpl.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _eos_from_generation_config(path: str) -> int | None:
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(path, name)
        if os.path.exists(p):
            with open(p) as f:
                eos = json.load(f).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None


def load_tokenizer(path: str | None) -> Tokenizer:
    """Loads `path`'s HF tokenizer; `None` or "char" gives the built-in character tokenizer."""
    if path is None or path == "char":
        return CharTokenizer()
    return HFTokenizer(path)
