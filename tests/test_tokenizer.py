"""Tokenizers: the built-in character vocabulary and an HF tokenizer.json with a chat template."""

import json

import pytest

from jaxrl_async.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer


def test_char_tokenizer_roundtrip_and_specials():
    tok = CharTokenizer()
    ids = tok.encode("37+85=122")
    assert min(ids) >= 3 and tok.decode(ids) == "37+85=122"
    assert tok.decode(ids + [tok.eos_id] + tok.encode("9")) == "37+85=122"  # stops at eos
    with pytest.raises(ValueError, match="'€'"):
        tok.encode("1€")
    assert isinstance(load_tokenizer("char"), CharTokenizer)


def test_hf_tokenizer_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": template})
    )
    hf = load_tokenizer(str(tmp_path))
    assert isinstance(hf, HFTokenizer)
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (1, 2, 0)
    assert hf.encode("hello world") == [3, 4]
    assert hf.decode([3, 4, 2, 3]) == "hello world"
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_char_tokenizer_exports_a_hugging_face_tokenizer_with_our_ids(tmp_path):
    """transformers loads `CharTokenizer.save_hf`'s files and encodes and decodes to exactly our ids, every
    character of the vocabulary included (space and newline too); our HFTokenizer reads them back alike."""
    transformers = pytest.importorskip("transformers")
    ours = CharTokenizer()
    ours.save_hf(str(tmp_path))
    text = ours.chars + "37+85=122"
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (ours.pad_id, ours.bos_id, ours.eos_id)
    assert hf.decode(ours.encode(text)) == text and len(hf) == ours.vocab_size
    back = HFTokenizer(str(tmp_path))
    assert back.encode(text) == ours.encode(text)
    assert back.decode([*ours.encode("12"), ours.eos_id, 5]) == "12"
