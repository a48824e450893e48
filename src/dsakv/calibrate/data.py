"""Calibration sequences: a JSONL file of texts or token-id lists, or a built-in default.

Only positions past `index_topk` can see a different top-k, so sequences are cut to
`max_seq_len` (by default twice `index_topk`) and at least one must be longer than
`index_topk`, or no pattern could change anything.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from dsakv.config import ModelConfig
from dsakv.errors import DsakvError, is_int, load_json

DEFAULT_NUM_SEQUENCES = 4

# Deterministic prose for the default data; sentences are shuffled per sequence (seeded) and
# repeated until a sequence is long enough.
_SENTENCES = (
    "The river rose slowly through the night, and by morning the lower fields were a lake.",
    "A compiler turns source text into tokens, then into a tree, then into instructions.",
    "She counted the coins twice before writing the total in the ledger.",
    "Photosynthesis stores the energy of sunlight in the chemical bonds of sugar.",
    "The committee postponed its decision until the auditors had finished their report.",
    "In 1869 the first transcontinental railroad in North America was completed.",
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n",
    "Prices fell for the third quarter in a row as inventories kept growing.",
    "The cat watched the birds from the window, its tail twitching now and then.",
    "Water boils at a lower temperature at altitude because the air pressure is lower.",
    "Please send the signed contract back by Friday so we can schedule the kickoff.",
    "A prime number has exactly two divisors: one and itself.",
    "The orchestra tuned to the oboe's A before the conductor walked on stage.",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC LIMIT 10;",
    "He had not expected the small village to have such a large library.",
    "Glaciers carve U-shaped valleys; rivers carve V-shaped ones.",
    "The patch fixes an off-by-one error in the page allocator's free list.",
    "Bread dough needs time to rise; rushing it gives a dense, heavy loaf.",
    "Two trains leave the station at noon, one heading east at eighty kilometres an hour.",
    "The museum's new wing displays tools found at a Bronze Age settlement.",
    "Light from the nearest star other than the Sun takes over four years to reach us.",
    "Q: What is the capital of Australia? A: Canberra.",
    "Every morning the baker opened at six, and every morning the queue was already there.",
    "The proof proceeds by induction on the length of the sequence.",
)


def default_texts(seed: int, num: int = DEFAULT_NUM_SEQUENCES, min_chars: int = 2048) -> list[str]:
    """`num` texts of at least `min_chars` characters, the same for the same seed."""
    texts = []
    for i in range(num):
        rng = random.Random(seed * 1000 + i)
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < min_chars:
            order = list(_SENTENCES)
            rng.shuffle(order)
            parts.extend(order)
        texts.append(" ".join(parts))
    return texts


def read_jsonl(path: str | Path) -> list[str | list[int]]:
    """Each non-blank line is `{"text": str}` or `{"token_ids": [int, ...]}`."""
    path = Path(path)
    # Read whatever is there, not only regular files: `--data <(...)` and /dev/stdin are pipes.
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # e.g. a binary file given by mistake
        raise DsakvError(
            f"calibration data {path} is not UTF-8 text (byte {e.start}); give a JSONL file"
        ) from None
    except FileNotFoundError:
        raise DsakvError(f"calibration data {path}: no such file") from None
    except IsADirectoryError:
        raise DsakvError(f"calibration data {path} is a directory; give a JSONL file") from None
    except OSError as e:
        raise DsakvError(f"cannot read calibration data {path}: {e.strerror or e}") from None
    items: list[str | list[int]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        obj: Any = load_json(line, f"{path}:{n}: not valid JSON")
        if not isinstance(obj, dict) or ("text" in obj) == ("token_ids" in obj):
            raise DsakvError(f'{path}:{n}: expected an object with "text" or "token_ids"')
        value = obj.get("text", obj.get("token_ids"))
        if "text" in obj and not isinstance(value, str):
            raise DsakvError(f'{path}:{n}: "text" must be a string')
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON may escape a lone surrogate: \ud800
                raise DsakvError(
                    f'{path}:{n}: "text" holds U+{ord(value[e.start]):04X} at character '
                    f"{e.start}, a lone surrogate that is not text"
                ) from None
        if "token_ids" in obj and not (isinstance(value, list) and all(is_int(t) for t in value)):
            raise DsakvError(f'{path}:{n}: "token_ids" must be a list of integers')
        if not value:
            raise DsakvError(f"{path}:{n}: empty sequence")
        items.append(value)
    if not items:
        raise DsakvError(f"calibration data {path} holds no sequences")
    return items


def calibration_sequences(
    model_dir: str | Path,
    config: ModelConfig,
    data: str | Path | None = None,
    *,
    max_seq_len: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Token-id sequences to calibrate on, each cut to `max_seq_len` tokens."""
    limit = max_seq_len or 2 * config.index_topk
    if limit < 2:
        raise DsakvError(f"max_seq_len must be >= 2, got {limit}")
    limit = min(limit, config.max_position_embeddings)
    items = read_jsonl(data) if data is not None else default_texts(seed, min_chars=4 * limit)
    tokenizer = _tokenizer(model_dir) if any(isinstance(i, str) for i in items) else None
    seqs = []
    for n, item in enumerate(items, 1):
        try:
            ids = tokenizer.encode(item) if isinstance(item, str) else item
        except (TypeError, ValueError) as e:  # text the tokenizer refuses
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DsakvError(
                f"sequence {n}: the tokenizer cannot encode the text ({first})"
            ) from None
        bad = next((t for t in ids if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise DsakvError(
                f"sequence {n}: token id {bad} is outside the vocabulary "
                f"(0..{config.vocab_size - 1})"
            )
        if not ids:
            raise DsakvError(f"sequence {n}: the text has no tokens")
        seqs.append(list(ids[:limit]))
    if max(len(s) for s in seqs) <= config.index_topk:
        raise DsakvError(
            f"every calibration sequence has at most index_topk ({config.index_topk}) tokens "
            f"(longest: {max(len(s) for s in seqs)}, cut at {limit}): every position is "
            "selected in full, so no pattern changes anything; give longer sequences"
        )
    return seqs


def _tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise DsakvError(
            f"cannot load the tokenizer of {model_dir} ({str(e).splitlines()[0]}); "
            'give token ids ({"token_ids": [...]} lines) instead of texts'
        ) from None
