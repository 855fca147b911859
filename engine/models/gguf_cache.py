"""A per-machine cache of what transformers derives from a GGUF file: its config and its tokenizer.

transformers builds both by parsing the whole file (the GGUF reader walks every vocabulary entry
through numpy) and, for the tokenizer, converting the vocabulary into a fast tokenizer: seconds each,
paid by every process that starts an engine (each server, test process and benchmark). Both results
are saved once, in transformers' own format, and loaded from there by later processes.

Layout under the cache root ($ASYNCLLM_GGUF_CACHE, else $XDG_CACHE_HOME/asyncllm, else
~/.cache/asyncllm: beside the compiled kernels' `kernels/`; `ASYNCLLM_GGUF_CACHE=off` turns it off):

    configs/<stem>_<key>/config.json                 `PretrainedConfig.save_pretrained`
    tokenizers/<stem>_<key>/tokenizer*.json, ...     `save_pretrained`, plus `asyncllm.json`
    <kind>/.<stem>_<key>.building-<pid>-<random>/    an entry being written, or one left by a killed process

Why this shape:
- The key hashes the GGUF's resolved path, size and modification time and the transformers and
  tokenizers versions: a changed file or a library upgrade (whose conversion may differ) gets a new
  entry, never a stale one.
- An entry is written in a temporary folder and renamed into place when complete (atomic within one
  filesystem), so a process killed mid-write leaves no half entry under the final name. Processes
  that start together (the test suite starts many) may each convert once; the first rename wins and
  the others keep what they built in memory. No lock: a conversion costs seconds, not minutes.
- A tokenizer entry carries a fingerprint of the converted tokenizer (size, special-token ids, chat
  template, the encoding of a probe text): an entry that loads but differs (a file lost or edited
  under it) is treated like one that does not load: converted again and replaced.
- Nothing here can fail a start: an unwritable or corrupt cache only means converting, as before.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.kernels.cached_build import user_cache_home

log = logging.getLogger(__name__)

ENV = "ASYNCLLM_GGUF_CACHE"
# Bumped when an entry's contents change meaning, so an old entry is never read as a new one.
KEY_FORMAT = 1
FINGERPRINT_FILE = "asyncllm.json"
_BUILDING = ".building-"
_STALE_BUILD_S = 3600.0  # a temp folder this old belongs to a killed process
# Text whose encoding the fingerprint records: special tokens, unicode, whitespace runs.
_PROBE = "<|im_start|>user\nHé, 日本語 🎉\t  x=1;<|im_end|>\n<|endoftext|> The end.  "


def cache_root() -> Path | None:
    """Where entries live, or None when the cache is turned off."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0") else Path(env).expanduser()
    return user_cache_home()


def entry_name(gguf: Path) -> str:
    """`<stem>_<key>` for this file as it is now (see the module docstring for what the key covers)."""
    real = gguf.resolve()
    st = real.stat()
    inputs = [KEY_FORMAT, str(real), st.st_size, st.st_mtime_ns, transformers.__version__, tokenizers.__version__]
    return f"{real.stem}_{hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:20]}"


def load_gguf_config(gguf: Path) -> PretrainedConfig:
    """The transformers config of a GGUF file, a fresh object per call (callers may change it)."""
    root = cache_root()
    return copy.deepcopy(_config(str(gguf.resolve()), entry_name(gguf), root and str(root)))


@functools.lru_cache(maxsize=8)
def _config(path: str, name: str, root: str | None) -> PretrainedConfig:
    """Per process too, keyed by the entry's name (the file's size and mtime) and the cache root."""
    gguf = Path(path)
    entry = Path(root) / "configs" / name if root is not None else None
    if entry is not None and entry.is_dir():
        try:
            config = AutoConfig.from_pretrained(str(entry))
            config.name_or_path = str(gguf.parent)  # what transformers records when it parses the GGUF
            return config
        except Exception as e:  # any unreadable entry is rebuilt below
            log.warning("GGUF config cache entry %s unreadable (%s): reading the GGUF again", entry, e)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if entry is not None:
        _publish(entry, config.save_pretrained, replace=entry.exists())
    return config


def convert_gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """transformers' own conversion of the GGUF's vocabulary (what the cache stores)."""
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def load_gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer: from the cache when an entry for this file matches, else converted (and
    saved for the next process)."""
    root = cache_root()
    if root is None:
        return convert_gguf_tokenizer(gguf)
    entry = root / "tokenizers" / entry_name(gguf)
    if entry.is_dir():
        cached = _read_tokenizer(entry, gguf)
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    tokenizer = convert_gguf_tokenizer(gguf)

    def write(folder: Path) -> None:
        tokenizer.save_pretrained(str(folder))
        (folder / FINGERPRINT_FILE).write_text(json.dumps(tokenizer_fingerprint(tokenizer)))

    saved = _publish(entry, write, replace=entry.exists())
    log.info(
        "tokenizer: converted from %s in %.1f s%s",
        gguf.name,
        time.perf_counter() - t0,
        f", cached in {entry}" if saved else "",
    )
    return tokenizer


def _read_tokenizer(entry: Path, gguf: Path) -> PreTrainedTokenizerBase | None:
    try:
        expected = json.loads((entry / FINGERPRINT_FILE).read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(entry))
        tokenizer.name_or_path = str(gguf.parent)  # as the conversion names it
        if tokenizer_fingerprint(tokenizer) == expected:
            log.debug("tokenizer: %s from the cache %s", gguf.name, entry)
            return tokenizer
        reason = "it differs from the conversion it was saved from"
    except Exception as e:  # a missing, truncated or edited file: any of them means convert again
        reason = f"{type(e).__name__}: {e}"
    log.warning("tokenizer cache entry %s unusable (%s): converting the GGUF again", entry, reason)
    return None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What must survive a save and load unchanged, cheap enough to check on every load."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    probe = tokenizer.encode(_PROBE, add_special_tokens=True)
    return {
        "len": len(tokenizer),
        "special_ids": sorted(tokenizer.all_special_ids),
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
        "chat_template": hashlib.sha256(template.encode()).hexdigest() if template is not None else None,
        "probe": probe,
        "decoded": tokenizer.decode(probe),
    }


def _publish(final: Path, write: Callable[[Path], Any], replace: bool) -> bool:
    """Write an entry in a temp folder beside `final`, then rename it into place; True when this
    process's entry is the one in place. `replace`: `final` holds an unusable entry, moved aside
    first (a rename does not replace a non-empty folder)."""
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _sweep(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_BUILDING}{os.getpid()}-", dir=final.parent))
        write(tmp)
        if replace:
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=final.parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.rename(final, stale / "entry")
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
        tmp = None
        return True
    except Exception as e:  # another process's entry won the rename, or the cache is not writable
        log.debug("cache entry %s not written: %s", final, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _sweep(folder: Path) -> None:
    """Delete temp folders left by killed processes (old enough that no live writer owns them)."""
    now = time.time()
    for child in folder.iterdir():
        if child.name.startswith(".") and (_BUILDING in child.name or ".stale-" in child.name):
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime > _STALE_BUILD_S:
                    shutil.rmtree(child, ignore_errors=True)
