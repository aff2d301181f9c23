"""Tokenizers: load a local or Hub tokenizer, fingerprint it, and build the small offline one.

The shipped tokenizer (`data/tokenizer/`) is a byte-level BPE trained deterministically on the
shipped instruction corpus, with BOS/EOS/PAD tokens and a chat template whose assistant turns
are wrapped in `{% generation %}` markers (so TRL's `assistant_only_loss` also works on raw
messages).
"""

import copy
import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from trainflow.data.errors import DataError

if TYPE_CHECKING:  # loading a tokenizer imports transformers; fingerprinting one does not
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def load_tokenizer(
    name_or_path: str, *, need_chat_template: bool = False
) -> "PreTrainedTokenizerBase":
    """Load a fast tokenizer from a local directory or a Hub model id.

    A run loads the same tokenizer several times, so each process parses it once (per local
    directory and the size and mtime of its files, so an edited tokenizer is read again; per id
    for the Hub) and every call returns its own copy, which the caller may change freely.

    Args:
        name_or_path: Local tokenizer directory or Hub id.
        need_chat_template: Raise if the tokenizer has no chat template.

    Returns:
        The tokenizer.

    Raises:
        DataError: If it cannot be loaded, is not a fast tokenizer, or lacks a needed chat
            template. The message names the tokenizer.
    """
    path = Path(name_or_path)
    try:
        if path.is_dir():
            tokenizer = _parsed_tokenizer(str(path.resolve()), _directory_stamp(path))
        else:
            tokenizer = _parsed_tokenizer(name_or_path, ())
    except Exception as err:  # transformers raises OSError, ValueError, HF hub errors...
        raise DataError(f"tokenizer {name_or_path!r} could not be loaded: {err}") from err
    if not tokenizer.is_fast:
        raise DataError(f"tokenizer {name_or_path!r} is not a fast tokenizer (offsets needed)")
    if need_chat_template and not tokenizer.chat_template:
        raise DataError(
            f"tokenizer {name_or_path!r} has no chat template; the 'chat' transform needs one "
            "(use a chat/instruct tokenizer or the 'text' transform)"
        )
    return copy.deepcopy(tokenizer)


def _directory_stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Each file's relative path, size and mtime: changes whenever the tokenizer is edited."""
    stats = sorted(
        (p.relative_to(path).as_posix(), p.stat()) for p in path.rglob("*") if p.is_file()
    )
    return tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)


@functools.lru_cache(maxsize=8)
def _parsed_tokenizer(
    name_or_path: str, _stamp: tuple[tuple[str, int, int], ...]
) -> "PreTrainedTokenizerBase":
    """The parsed tokenizer, shared within the process: `load_tokenizer` hands out copies."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def tokenizer_fingerprint(name_or_path: str) -> str:
    """Content hash of a local tokenizer directory, or the resolved commit of a Hub tokenizer."""
    path = Path(name_or_path)
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(file.relative_to(path).as_posix().encode())
            digest.update(file.read_bytes())
        return "dir:" + digest.hexdigest()
    from huggingface_hub import HfApi

    try:
        sha = HfApi().model_info(name_or_path).sha
    except Exception as err:  # no network, unknown repo, gated repo...
        raise DataError(
            f"tokenizer {name_or_path!r} is neither a local directory nor a resolvable Hub "
            f"model: {err}"
        ) from err
    return f"hub:{name_or_path}@{sha}"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> "PreTrainedTokenizerFast":
    """Train a byte-level BPE tokenizer with chat template on `texts` (deterministic).

    Args:
        texts: Training corpus.
        vocab_size: Vocabulary size including the 256 byte tokens and the special tokens.

    Returns:
        A `PreTrainedTokenizerFast` ready to `save_pretrained`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, *ROLE_TOKENS.values()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def save_tokenizer(tokenizer: "PreTrainedTokenizerFast", folder: Path) -> None:
    """Save a tokenizer `train_tokenizer` made, readable by transformers 4 and 5 alike.

    transformers 5 writes `tokenizer_config.json` as `TokenizersBackend` with
    `extra_special_tokens`, which transformers 4 (the framework environments: LLM Foundry,
    Unsloth) cannot load, and no `special_tokens_map.json`. The files written here are
    transformers 4's, which 5 reads too, so the shipped tokenizer and every environment's view
    of it stay the same.
    """
    tokenizer.save_pretrained(folder)
    specials = [PAD, BOS, EOS, *ROLE_TOKENS.values()]
    config = {
        "added_tokens_decoder": {
            str(tokenizer.convert_tokens_to_ids(token)): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token in specials
        },
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "bos_token": BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "extra_special_tokens": {},
        "model_max_length": tokenizer.model_max_length,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
    }
    (Path(folder) / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
