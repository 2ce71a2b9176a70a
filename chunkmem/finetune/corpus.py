"""Training text: a local .txt, .jsonl (.ndjson) or .json file, tokenised, cut into fixed-length blocks, split once.

A model directory's own tokenizer is used when it has one; otherwise bytes are the tokens (ids
0-255), which any model with a vocabulary of at least 256 can learn, so `chunkmem finetune` runs
from a bare config with no tokenizer files at all. The split is by position (the last blocks are
held out), so it is the same in every run and after a resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from chunkmem.finetune.hf import InputError

log = logging.getLogger("chunkmem")

BUNDLED_TEXT = Path(__file__).resolve().parents[1] / "data" / "alice.txt"
BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token blocks for training and evaluation. train: [n, seq_len] int64; held_out: [m, seq_len]."""

    train: torch.Tensor
    held_out: torch.Tensor
    tokenizer: str  # "bytes" or the tokenizer's class name


def read_documents(path: Path, text_field: str = "text") -> list[str]:
    """The documents of a text file (one), a JSONL file (one per line, field `text_field`) or a .json file (a JSON
    array of objects, or JSON lines, as Hugging Face's json loader takes). A byte-order mark is not text."""
    try:
        raw = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"--data {path}: no such file; pass a local .txt, .jsonl (.ndjson) or .json file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--data {path}: cannot be read as UTF-8 text ({error}); pass a readable "
                         f".txt, .jsonl (.ndjson) or .json file") from None
    suffix = path.suffix.lower()
    whole = _array(raw, path) if suffix == ".json" else None
    if whole is not None:
        documents = [_text(record, text_field, path, f"record {number}") for number, record in enumerate(whole)]
    elif suffix in JSON_LINES:
        documents = [_field(line, text_field, path, number)  # "\n" alone ends a line: JSON strings may hold U+2028
                     for number, line in enumerate(raw.split("\n"), 1) if line.strip()]
    else:
        documents = [raw]
    if not any(doc.strip() for doc in documents):
        raise InputError(f"--data {path}: the file holds no text; pass a file with some")
    return documents


JSON_LINES = (".jsonl", ".ndjson", ".json")  # files of one JSON object per line (a .json file may hold an array)
JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}


def _array(raw: str, path: Path) -> list | None:
    """A .json file's records when it holds one JSON array; None when it holds JSON lines instead."""
    try:
        whole = json.loads(raw)
    except json.JSONDecodeError as error:
        if raw.lstrip().startswith("["):
            raise InputError(f"--data {path}: not JSON at line {error.lineno}, column {error.colno} ({error.msg}); a "
                             ".json file holds an array of objects (or one object per line)") from None
        return None  # more than one value: JSON lines (each line is checked as such)
    except (ValueError, RecursionError) as error:  # a number of over 4300 digits, nesting past Python's stack
        raise InputError(f"--data {path}: cannot be read as JSON ({error})") from None
    if isinstance(whole, dict) and "\n" not in raw.strip():  # lines end at "\n" alone (U+2028 is text), as _text's
        return None  # one object on one line: JSON lines
    if not isinstance(whole, list):
        raise InputError(f"--data {path}: holds a JSON {JSON_NAMES.get(type(whole), 'value')}; a .json file holds "
                         f"an array of objects (or one object per line)")
    return whole


def _field(line: str, field: str, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"--data {path}: line {number} is not JSON ({error.msg}); "
                         f"a {path.suffix.lower()} file holds one JSON object per line") from None
    except (ValueError, RecursionError) as error:
        raise InputError(f"--data {path}: line {number} cannot be read as JSON ({error})") from None
    return _text(record, field, path, f"line {number}")


def _text(record: object, field: str, path: Path, where: str) -> str:
    if not isinstance(record, dict):
        raise InputError(f"--data {path}: {where} is a JSON {JSON_NAMES.get(type(record), 'value')}; expected an "
                         f"object with a string field {field!r}")
    if not isinstance(record.get(field), str):
        raise InputError(f"--data {path}: {where} has no string field {field!r}; name the field with --text-field")
    return record[field]


def load_tokenizer(directory: Path | None) -> Any:
    """The directory's tokenizer, or None for bytes."""
    if directory is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as error:  # noqa: BLE001  tokenizers raise many kinds; each means the files are unreadable
        raise InputError(f"--model {directory}: its tokenizer cannot be loaded ({type(error).__name__}: {error}); "
                         "install what it names if a package is missing, else replace the tokenizer files, or remove "
                         "them to train on bytes") from None


def tokenize(documents: list[str], tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """All documents as one stream of ids [n], separated by the end-of-text token (or a newline)."""
    if tokenizer is None:
        if vocab_size < BYTE_VOCAB:
            raise InputError(f"the model's vocab_size is {vocab_size} and there is no tokenizer: bytes need "
                             f"{BYTE_VOCAB}; add tokenizer files to the model directory or raise vocab_size")
        data = "\n".join(documents).encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + separator
    if ids and max(ids) >= vocab_size:  # an id past the embedding would index out of it mid-training
        raise InputError(f"the tokenizer gives the data id {max(ids)}, and the model's vocab_size is {vocab_size}: "
                         "use the model's own tokenizer, or raise vocab_size in its config.json")
    return torch.tensor(ids, dtype=torch.long)


def _byte_alphabet() -> dict[int, str]:
    """Byte -> the printable character GPT-2's byte-level tokenizers write it as (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(BYTE_VOCAB) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(BYTE_VOCAB + i) for i, b in enumerate(others)}
    return dict(sorted(chars.items()))


def byte_tokenizer(config: Any) -> Any:
    """A Hugging Face tokenizer whose ids are UTF-8 bytes, as `tokenize` reads text without a tokenizer.

    Written with a model trained on bytes, so that `AutoTokenizer.from_pretrained` and `generate`
    work on its directory. Built offline with the `tokenizers` library: a BPE model without merges
    over GPT-2's byte alphabet is exactly one token per byte. The model's end-of-text id becomes the
    eos (and bos) token when it is a byte (the bundled config's is 10, the newline `tokenize`
    separates documents with).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={char: byte for byte, char in alphabet.items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = {}
    for role in ("eos", "bos"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < BYTE_VOCAB:
            special[f"{role}_token"] = alphabet[token_id]
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=_max_length(config), **special)


def _max_length(config: Any) -> int:
    for field in ("n_positions", "max_position_embeddings"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2**30


def blocks(ids: torch.Tensor, seq_len: int, held_out_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a stream into [n, seq_len] blocks; the last `held_out_fraction` of them (at least one) are held out."""
    count = len(ids) // seq_len
    if count < 2:
        raise InputError(f"the data has {len(ids)} tokens, fewer than two blocks of --seq-len {seq_len}: "
                         f"lower --seq-len or give more text")
    cut = ids[:count * seq_len].view(count, seq_len)
    held = max(1, round(count * held_out_fraction)) if held_out_fraction > 0 else 0
    return cut[:count - held], cut[count - held:]


def load(path: Path, tokenizer_dir: Path | None, vocab_size: int, seq_len: int,
         held_out_fraction: float = 0.1, text_field: str = "text") -> Corpus:
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenize(read_documents(path, text_field), tokenizer, vocab_size)
    train, held_out = blocks(ids, seq_len, held_out_fraction)
    name = "bytes" if tokenizer is None else type(tokenizer).__name__
    log.info("data: %d tokens (%s) -> %d training and %d held-out blocks of %d", len(ids), name,
             len(train), len(held_out), seq_len)
    return Corpus(train, held_out, name)


def batch_order(count: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of training blocks in one epoch: a function of (seed, epoch) only, so resumable."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
