"""Regenerate the small datasets and tokenizer shipped in `data/` (deterministic).

python scripts/make_data.py            # rewrites data/instructions.jsonl, interactions.csv,
                                       # data/tokenizer/
python scripts/make_data.py --check    # exit 1 if data/ differs from what this generates
"""

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from trainflow.data.synthetic import (
    instruction_rows,
    interaction_rows,
    tokenizer_corpus,
    write_csv,
    write_jsonl,
)
from trainflow.data.tokenizer import save_tokenizer, train_tokenizer

NUM_INSTRUCTIONS = 3000
NUM_INTERACTIONS = 20000
VOCAB_SIZE = 280  # bytes + specials + a few merges: keeps letters and digits single tokens


def generate(out: Path) -> None:
    """Write the datasets and the tokenizer under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    instructions = instruction_rows(NUM_INSTRUCTIONS, seed=0)
    write_jsonl(instructions, out / "instructions.jsonl")
    write_csv(interaction_rows(NUM_INTERACTIONS, seed=0), out / "interactions.csv")
    tokenizer = train_tokenizer(tokenizer_corpus(instructions), VOCAB_SIZE)
    save_tokenizer(tokenizer, out / "tokenizer")


def _differences(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b)
    diffs = [str(a / n) for n in cmp.left_only + cmp.right_only + cmp.diff_files]
    for sub in cmp.common_dirs:
        diffs += _differences(a / sub, b / sub)
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        diffs = _differences(args.out, Path(tmp))
    for path in diffs:
        print(f"differs from the generator: {path}", file=sys.stderr)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
