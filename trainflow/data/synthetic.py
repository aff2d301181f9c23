"""Small deterministic datasets shipped in `data/` (regenerate with `scripts/make_data.py`).

- Instructions for SFT: short tasks with one exact answer each (reverse a word, add two digits,
  next letter, upper-case a word), so exact match of generated answers shows real learning by a
  tiny model.
- User-item interactions for a two-tower recommender: clicks drawn from hidden user and item
  factors, so a model that learns embeddings beats the click-rate baseline.
"""

import csv
import json
import math
import random
import string
from pathlib import Path

LETTERS = "abcdefghij"
# <u, v> has a standard deviation of about 0.5, so click logits spread about +-3: preferences
# strong enough for a small model to learn from the shipped interactions.
CLICK_SCALE = 6.0


def _instruction(rng: random.Random) -> tuple[str, str, str]:
    task = rng.choice(["reverse", "add", "next", "upper"])
    if task == "reverse":
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        return task, f"reverse {word}", word[::-1]
    if task == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return task, f"add {a} {b}", str(a + b)
    if task == "next":
        letter = rng.choice(string.ascii_lowercase[:-1])
        return task, f"next {letter}", chr(ord(letter) + 1)
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
    return task, f"upper {word}", word.upper()


def instruction_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """Rows `{id, task, messages: [user, assistant]}` for the chat transform."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        task, prompt, answer = _instruction(rng)
        rows.append(
            {
                "id": i,
                "task": task,
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
    return rows


def interaction_rows(
    num_rows: int, num_users: int = 200, num_items: int = 100, dim: int = 4, seed: int = 0
) -> list[dict]:
    """Rows `{id, user_id, item_id, item_category, clicked}` with latent-factor structure.

    A click happens with probability sigmoid(CLICK_SCALE * <u, v>) for hidden unit-scale factors
    u, v; an item's category is the index of its largest factor, so it carries signal too.
    """
    rng = random.Random(seed)

    def factor() -> list[float]:
        return [rng.gauss(0.0, 1.0 / math.sqrt(dim)) for _ in range(dim)]

    users = [factor() for _ in range(num_users)]
    items = [factor() for _ in range(num_items)]
    rows = []
    for i in range(num_rows):
        user, item = rng.randrange(num_users), rng.randrange(num_items)
        score = CLICK_SCALE * sum(a * b for a, b in zip(users[user], items[item], strict=True))
        clicked = int(rng.random() < 1.0 / (1.0 + math.exp(-score)))
        category = max(range(dim), key=lambda k: items[item][k])
        rows.append(
            {
                "id": i,
                "user_id": user,
                "item_id": item,
                "item_category": category,
                "clicked": clicked,
            }
        )
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write rows as JSON lines (stable key order, trailing newline)."""
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def write_csv(rows: list[dict], path: Path) -> None:
    """Write rows as CSV with a header, in the rows' key order."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def tokenizer_corpus(rows: list[dict]) -> list[str]:
    """Texts the shipped tokenizer is trained on: every message of the instruction rows."""
    return [m["content"] for row in rows for m in row["messages"]]
