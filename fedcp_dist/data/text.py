"""Word-level tokeniser, vocabulary and fixed-length id encoding for text sources (AG News).

* :func:`tokenize`: lower-case, then every maximal run of ``[a-z0-9]`` is a token; everything else
  (punctuation, whitespace, accented or non-Latin letters) separates tokens.
* :func:`build_vocab`: built from the training texts only.  Id 0 is the padding token ``<pad>``,
  id 1 the unknown token ``<unk>``; then every token seen at least ``min_freq`` times, by
  descending count and, among equal counts, in code-point order, cut so that the whole vocabulary
  (both special ids included) holds at most ``vocab_size`` entries.
* :func:`encode_texts`: each text's first ``max_len`` token ids (tokens outside the vocabulary
  map to ``<unk>``), right-padded with id 0, plus the number of real (non-padding) positions.

The functions take an optional ``progress`` wrapper (``progress(iterable, total=, desc=)``, e.g. a
tqdm bar) so that long passes can show their progress; this module itself prints nothing.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

PAD_ID = 0
UNK_ID = 1
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
#: the ids every vocabulary starts with
SPECIALS = (PAD_TOKEN, UNK_TOKEN)

DEFAULT_MAX_LEN = 200
DEFAULT_VOCAB_SIZE = 50000
DEFAULT_MIN_FREQ = 1

_TOKEN = re.compile(r"[a-z0-9]+")

Progress = Callable[..., Iterable]


def _no_progress(iterable, total=None, desc=None):
    return iterable


def tokenize(text: str) -> list[str]:
    """The tokens of ``text``: runs of ``[a-z0-9]`` in its lower-cased form."""
    return _TOKEN.findall(text.lower())


def check_text_options(max_len: int, vocab_size: int, min_freq: int) -> None:
    """Raise ``ValueError`` unless the text options are usable."""
    if int(max_len) != max_len or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1, got {max_len}")
    if int(vocab_size) != vocab_size or vocab_size < len(SPECIALS) + 1:
        raise ValueError(f"vocab_size must be an integer >= {len(SPECIALS) + 1} (it counts the "
                         f"padding and unknown ids), got {vocab_size}")
    if int(min_freq) != min_freq or min_freq < 1:
        raise ValueError(f"min_freq must be an integer >= 1, got {min_freq}")


def build_vocab(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                min_freq: int = DEFAULT_MIN_FREQ, progress: Optional[Progress] = None,
                total: Optional[int] = None) -> list[str]:
    """The vocabulary of ``texts`` as a list of tokens in id order (``<pad>``, ``<unk>``, ...)."""
    check_text_options(1, vocab_size, min_freq)
    progress = progress or _no_progress
    counts: Counter = Counter()
    for text in progress(texts, total=total, desc="counting tokens"):
        counts.update(_TOKEN.findall(text.lower()))
    kept = sorted((item for item in counts.items() if item[1] >= min_freq),
                  key=lambda item: (-item[1], item[0]))
    room = int(vocab_size) - len(SPECIALS)
    return list(SPECIALS) + [token for token, _ in kept[:room]]


def token_index(vocab: Sequence[str]) -> dict[str, int]:
    """Map each token of ``vocab`` to its id."""
    return {token: i for i, token in enumerate(vocab)}


def encode(tokens: Sequence[str], index: dict[str, int], max_len: int) -> tuple[np.ndarray, int]:
    """Ids (int32, length ``max_len``, padded with 0) and the number of real positions."""
    ids = np.zeros(int(max_len), dtype=np.int32)
    head = tokens[:max_len]
    ids[:len(head)] = [index.get(token, UNK_ID) for token in head]
    return ids, len(head)


def encode_texts(texts: Sequence[str], vocab: Sequence[str], max_len: int = DEFAULT_MAX_LEN,
                 progress: Optional[Progress] = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts``: ids int32 (n, max_len) and lengths int32 (n,)."""
    check_text_options(max_len, max(len(vocab), len(SPECIALS) + 1), 1)
    if list(vocab[:len(SPECIALS)]) != list(SPECIALS):
        raise ValueError(f"a vocabulary must start with {', '.join(SPECIALS)}")
    progress = progress or _no_progress
    index = token_index(vocab)
    n = len(texts)
    ids = np.zeros((n, int(max_len)), dtype=np.int32)
    lengths = np.zeros(n, dtype=np.int32)
    for i, text in enumerate(progress(texts, total=n, desc="encoding texts")):
        ids[i], lengths[i] = encode(tokenize(text), index, max_len)
    return ids, lengths
