"""Word-level tokenisers, vocabulary and fixed-length id encoding for text sources (AG News).

Two pipelines (``text_pipeline``, :data:`TEXT_PIPELINES`):

* ``reference`` (the default): the FedCP authors' AG News pipeline as it was when the paper's
  numbers were made (their FedCP repository and PFLlib's ``generate_agnews.py`` of 2023): torchtext's
  ``basic_english`` tokeniser (:func:`tokenize_basic_english`), a vocabulary of every token of the
  train *and* test texts (no cap: 98,634 tokens plus their single special for the real data set),
  no token added in front.
* ``alnum``: this project's first pipeline: :func:`tokenize` (runs of ``[a-z0-9]``), a vocabulary of
  the training texts only, capped at 50,000 ids.

Common to both:

* :func:`build_vocab`: id 0 is the padding token ``<pad>``, id 1 the unknown token ``<unk>``; then
  every token seen at least ``min_freq`` times, by descending count and, among equal counts, in
  code-point order (torchtext's order too), cut so that the whole vocabulary (both special ids
  included) holds at most ``vocab_size`` entries (``None``: no cap).  The reference pipeline's
  vocabulary has one special, ``<unk>``, at id 0, which is also its padding value; with a
  vocabulary built from every text no token is ever unknown, so its id k is this vocabulary's
  id k + 1 and id 1 is never used.
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
#: the ``alnum`` pipeline's cap (the ``reference`` pipeline has none)
DEFAULT_VOCAB_SIZE = 50000
DEFAULT_MIN_FREQ = 1

#: ``reference``: basic_english, vocabulary of train + test, no cap; ``alnum``: [a-z0-9] runs,
#: vocabulary of the training texts, 50,000 ids
TEXT_PIPELINES = ("reference", "alnum")
DEFAULT_TEXT_PIPELINE = "reference"

_TOKEN = re.compile(r"[a-z0-9]+")
# basic_english: these characters become tokens of their own; ';' and ':' only separate tokens
_SPLIT_OFF = str.maketrans({c: f" {c} " for c in ",()!?"} | {";": " ", ":": " "})

Progress = Callable[..., Iterable]


def _no_progress(iterable, total=None, desc=None):
    return iterable


def tokenize(text: str) -> list[str]:
    """The tokens of ``text``: runs of ``[a-z0-9]`` in its lower-cased form (the ``alnum`` pipeline)."""
    return _TOKEN.findall(text.lower())


def tokenize_basic_english(text: str) -> list[str]:
    """The tokens of ``text`` by torchtext's ``basic_english`` rules (the ``reference`` pipeline).

    In this order: lower-case; an apostrophe becomes a token of its own; double quotes are
    dropped; a full stop becomes a token of its own; the line break ``<br />`` separates tokens;
    each of ``, ( ) ! ?`` becomes a token of its own and ``; :`` separate tokens; then the text
    is split at whitespace.  Every other character (hyphens, backslashes, digits, ``$``, accented
    letters) stays inside its token: ``"U.S. $5-billion"`` gives ``u . s . $5-billion``.
    """
    text = text.lower().replace("'", " ' ").replace('"', "").replace(".", " . ")
    return text.replace("<br />", " ").translate(_SPLIT_OFF).split()


def tokenizer_for(pipeline: str) -> Callable[[str], list[str]]:
    """The tokeniser of a text pipeline."""
    check_pipeline(pipeline)
    return tokenize_basic_english if pipeline == "reference" else tokenize


def check_pipeline(pipeline: str) -> None:
    """Raise ``ValueError`` unless ``pipeline`` is one of :data:`TEXT_PIPELINES`."""
    if pipeline not in TEXT_PIPELINES:
        raise ValueError(f"text_pipeline must be one of {', '.join(TEXT_PIPELINES)}, got {pipeline!r}")


def check_text_options(max_len: int, vocab_size: Optional[int], min_freq: int) -> None:
    """Raise ``ValueError`` unless the text options are usable (``vocab_size`` None: no cap)."""
    if int(max_len) != max_len or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1, got {max_len}")
    if vocab_size is not None and (int(vocab_size) != vocab_size or vocab_size < len(SPECIALS) + 1):
        raise ValueError(f"vocab_size must be an integer >= {len(SPECIALS) + 1} (it counts the "
                         f"padding and unknown ids), got {vocab_size}")
    if int(min_freq) != min_freq or min_freq < 1:
        raise ValueError(f"min_freq must be an integer >= 1, got {min_freq}")


def build_vocab(texts: Iterable[str], vocab_size: Optional[int] = DEFAULT_VOCAB_SIZE,
                min_freq: int = DEFAULT_MIN_FREQ, progress: Optional[Progress] = None,
                total: Optional[int] = None, tokenizer: Callable[[str], list[str]] = tokenize) -> list[str]:
    """The vocabulary of ``texts`` as a list of tokens in id order (``<pad>``, ``<unk>``, ...).

    ``vocab_size`` None keeps every token seen ``min_freq`` times.  A token spelled like one of the
    specials is not counted (as torchtext drops its specials from the counts)."""
    check_text_options(1, vocab_size, min_freq)
    progress = progress or _no_progress
    counts: Counter = Counter()
    for text in progress(texts, total=total, desc="counting tokens"):
        counts.update(tokenizer(text))
    for special in SPECIALS:
        counts.pop(special, None)
    kept = sorted((item for item in counts.items() if item[1] >= min_freq),
                  key=lambda item: (-item[1], item[0]))
    if vocab_size is not None:
        kept = kept[:int(vocab_size) - len(SPECIALS)]
    return list(SPECIALS) + [token for token, _ in kept]


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
                 progress: Optional[Progress] = None,
                 tokenizer: Callable[[str], list[str]] = tokenize) -> tuple[np.ndarray, np.ndarray]:
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
        ids[i], lengths[i] = encode(tokenizer(text), index, max_len)
    return ids, lengths
