"""The on-disk cache of what transformers derives from a GGUF (engine/models/gguf_cache.py): a
tokenizer loaded from it is the conversion's twin (encodings, decodings, chat template, special
tokens); an unusable entry is converted again and replaced; a config comes back as parsed, a fresh
object per resolve. Every test uses its own cache folder, never the user's."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from engine.kernels import cached_build
from engine.models import gguf_cache
from engine.models.loader import default_gguf_path, resolve_model

TEXTS = [
    "",
    "Hello, world!",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "Unicode: héllo naïve café — 日本語のテキスト, 中文, русский, العربية, 🎉🚀👍🏽",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>inline<|im_end|>special<|im_start|>tokens",
    "def f(x):\n    return x ** 2  # code, numbers 3.14159 and 1,000,000",
    "a" * 300,
    "<|im_start",  # a special token's prefix is ordinary text
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer briefly. ☃"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "日本語で?"},
    ],
]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def converted():
    """transformers' own conversion of the default GGUF's vocabulary (seconds: once per module)."""
    return gguf_cache.convert_gguf_tokenizer(default_gguf_path())


@pytest.fixture
def conversions(monkeypatch, converted) -> list[Path]:
    """The GGUFs converted; each conversion returns the module's converted tokenizer at once."""
    calls: list[Path] = []

    def convert(gguf: Path):
        calls.append(gguf)
        return converted

    monkeypatch.setattr(gguf_cache, "convert_gguf_tokenizer", convert)
    return calls


def _entry(cache_dir: Path) -> Path:
    (entry,) = (cache_dir / "tokenizers").iterdir()
    return entry


def test_cached_tokenizer_is_the_conversions_twin(cache_dir, conversions, converted):
    gguf = default_gguf_path()
    assert gguf_cache.load_gguf_tokenizer(gguf) is converted  # converted, then saved
    cached = gguf_cache.load_gguf_tokenizer(gguf)  # what a later process gets
    assert cached is not converted and len(conversions) == 1
    assert _entry(cache_dir).name.startswith(gguf.stem)

    for text in TEXTS:
        for special in (True, False):
            ids = converted.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, text
        for skip in (True, False):
            assert cached.decode(ids, skip_special_tokens=skip) == converted.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    ids = [rng.randrange(len(converted)) for _ in range(2000)]
    assert cached.decode(ids) == converted.decode(ids)
    assert cached.convert_ids_to_tokens(ids) == converted.convert_ids_to_tokens(ids)
    for chat in CHATS:
        for gen in (True, False):
            want = converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want
            assert cached.encode(want, add_special_tokens=False) == converted.encode(want, add_special_tokens=False)

    assert cached.chat_template == converted.chat_template
    assert cached.all_special_ids == converted.all_special_ids
    assert cached.all_special_tokens == converted.all_special_tokens
    assert cached.special_tokens_map == converted.special_tokens_map
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "name_or_path", "padding_side"):
        assert getattr(cached, attr) == getattr(converted, attr), attr
    assert cached.clean_up_tokenization_spaces == converted.clean_up_tokenization_spaces
    assert len(cached) == len(converted) and cached.get_vocab() == converted.get_vocab()
    assert cached.added_tokens_decoder == converted.added_tokens_decoder
    assert cached.backend_tokenizer.to_str() == converted.backend_tokenizer.to_str()


def _garbage(entry: Path) -> None:
    (entry / "tokenizer.json").write_text("{not json")


def _truncated(entry: Path) -> None:
    data = (entry / "tokenizer.json").read_bytes()
    (entry / "tokenizer.json").write_bytes(data[: len(data) // 2])


def _no_config(entry: Path) -> None:  # loads, but without the special tokens and chat template
    (entry / "tokenizer_config.json").unlink()
    (entry / "chat_template.jinja").unlink(missing_ok=True)


def _no_fingerprint(entry: Path) -> None:
    (entry / gguf_cache.FINGERPRINT_FILE).unlink()


def _other_fingerprint(entry: Path) -> None:
    file = entry / gguf_cache.FINGERPRINT_FILE
    fingerprint = json.loads(file.read_text())
    fingerprint["probe"] = fingerprint["probe"][:-1]
    file.write_text(json.dumps(fingerprint))


@pytest.mark.parametrize("damage", [_garbage, _truncated, _no_config, _no_fingerprint, _other_fingerprint])
def test_an_unusable_entry_is_converted_again_and_replaced(cache_dir, conversions, converted, damage):
    gguf = default_gguf_path()
    gguf_cache.load_gguf_tokenizer(gguf)
    damage(_entry(cache_dir))
    assert gguf_cache.load_gguf_tokenizer(gguf) is converted and len(conversions) == 2  # fell back
    again = gguf_cache.load_gguf_tokenizer(gguf)  # from the replaced entry
    assert again is not converted and len(conversions) == 2
    assert again.encode(TEXTS[4]) == converted.encode(TEXTS[4]) and again.chat_template == converted.chat_template
    assert [p.name for p in (cache_dir / "tokenizers").iterdir()] == [_entry(cache_dir).name]  # no temp left


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch, conversions, converted):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_cache.ENV, str(blocker / "cache"))  # below a file: cannot be created
    assert gguf_cache.load_gguf_tokenizer(default_gguf_path()) is converted


def test_cache_off_and_its_location(tmp_path, monkeypatch, conversions):
    monkeypatch.setenv(gguf_cache.ENV, "off")
    assert gguf_cache.cache_root() is None
    gguf_cache.load_gguf_tokenizer(default_gguf_path())
    gguf_cache.load_gguf_tokenizer(default_gguf_path())
    assert len(conversions) == 2
    monkeypatch.delenv(gguf_cache.ENV)
    monkeypatch.delenv("ASYNCLLM_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "asyncllm"
    assert cached_build.cache_root() == tmp_path / "xdg" / "asyncllm" / "kernels"  # the compiled kernels beside
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # invalid by the XDG spec: ignored
    assert gguf_cache.cache_root() == Path.home() / ".cache" / "asyncllm"
    assert cached_build.cache_root() == Path.home() / ".cache" / "asyncllm" / "kernels"


def test_leftovers_of_killed_writers_are_swept(cache_dir, conversions):
    gguf = default_gguf_path()
    name = gguf_cache.entry_name(gguf)
    old = cache_dir / "tokenizers" / f".{name}.building-999999-x"
    fresh = cache_dir / "tokenizers" / f".{name}.building-999998-y"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
    os.utime(old, (0, 0))
    gguf_cache.load_gguf_tokenizer(gguf)
    assert not old.exists() and fresh.exists()  # a recent one may belong to a live writer


def test_key_follows_the_file(tmp_path):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_gguf_path(), copy)
    first = gguf_cache.entry_name(copy)
    assert first.startswith("model_") and gguf_cache.entry_name(copy) == first
    os.utime(copy, ns=(0, 12345))
    assert gguf_cache.entry_name(copy) != first


def test_config_from_the_cache_and_a_fresh_copy_per_resolve(cache_dir, tmp_path, monkeypatch):
    a, b = resolve_model("smollm2-135m"), resolve_model("smollm2-135m")  # parsed, saved; then in memory
    assert a.hf_config is not b.hf_config and a.hf_config.to_dict() == b.hf_config.to_dict()
    a.hf_config.vocab_size = 7  # a caller's change stays its own
    assert b.hf_config.vocab_size != 7 and resolve_model("smollm2-135m").hf_config.vocab_size != 7
    assert b._gguf_index is a._gguf_index  # the header is read once per process

    # a later process: another cache root holding the same entry (a marker shows it was read)
    other = tmp_path / "other"
    shutil.copytree(cache_dir, other)
    (entry,) = (other / "configs").iterdir()
    raw = json.loads((entry / "config.json").read_text())
    (entry / "config.json").write_text(json.dumps({**raw, "asyncllm_marker": 1}))
    monkeypatch.setenv(gguf_cache.ENV, str(other))
    c = resolve_model("smollm2-135m")
    assert c.hf_config.asyncllm_marker == 1
    got, want = c.hf_config.to_dict(), b.hf_config.to_dict()
    del got["asyncllm_marker"]
    assert got == want  # name_or_path included
    assert (c.architecture, c.gguf_file) == (b.architecture, b.gguf_file)

    # an unreadable entry (in a third root, so not in this process's memory): parsed again, replaced
    third = tmp_path / "third"
    shutil.copytree(cache_dir, third)
    (entry,) = (third / "configs").iterdir()
    (entry / "config.json").write_text("{")
    monkeypatch.setenv(gguf_cache.ENV, str(third))
    assert resolve_model("smollm2-135m").hf_config.to_dict() == want
    assert json.loads((entry / "config.json").read_text())["vocab_size"] == want["vocab_size"]
