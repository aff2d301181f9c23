"""Held-out evaluation of a causal LM on prepared chat data: answer loss and exact match.

Each conversation's prompt is everything before its first answer token (the chat template's
generation prompt included); its reference answer is that first run of answer tokens (the
end-of-turn token included). The loss counts answer tokens only, like training; exact match
greedily generates an answer for the prompt and compares the decoded texts.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def split_prompt_answer(input_ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """The prompt before the first answer token and that first run of answer tokens."""
    start = mask.index(1)
    end = start
    while end < len(mask) and mask[end]:
        end += 1
    return input_ids[:start], input_ids[start:end]


def _pad(rows: list[list[int]], value: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        attention[i, span] = 1
    return ids, attention


@torch.no_grad()
def answer_loss(
    model: PreTrainedModel, input_ids: list[list[int]], masks: list[list[int]], pad_id: int
) -> tuple[float, int]:
    """Summed cross-entropy over answer tokens of one batch, and the number of those tokens."""
    ids, attention = _pad(input_ids, pad_id, left=False)
    labels, _ = _pad(masks, 0, left=False)
    device = model.device
    logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits.float()
    targets = ids.to(device).masked_fill(labels.to(device) == 0, -100)[:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return loss.item(), int((targets != -100).sum())


@torch.no_grad()
def exact_matches(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    answers: list[list[int]],
    max_new_tokens: int,
) -> list[bool]:
    """Whether greedy generation reproduces each reference answer exactly (decoded text)."""
    pad_id = tokenizer.pad_token_id
    ids, attention = _pad(prompts, pad_id, left=True)
    generated = model.generate(  # type: ignore[operator]
        input_ids=ids.to(model.device),
        attention_mask=attention.to(model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
    )[:, ids.shape[1] :]
    return [
        _text(tokenizer, out.tolist()).strip() == _text(tokenizer, ref).strip()
        for out, ref in zip(generated, answers, strict=True)
    ]


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """One sequence's text (transformers 5 types `decode` as text or a list of texts)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(text, str)
    return text


def evaluate_causal_lm(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: list[list[int]],
    masks: list[list[int]],
    *,
    batch_size: int,
    max_new_tokens: int,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Answer-token loss, perplexity and exact match of `model` on held-out conversations.

    Args:
        model: The model, in eval mode.
        tokenizer: Its tokenizer (pad and end-of-turn tokens, decoding).
        input_ids: Token ids per conversation.
        masks: 1 on answer tokens per conversation (`assistant_masks`).
        batch_size: Conversations per forward pass.
        max_new_tokens: Longest generated answer.
        on_batch: Called after each batch (a rank's heartbeat).

    Returns:
        `eval_loss`, `eval_perplexity` and `eval_exact_match` (share of answers reproduced).
    """
    total_loss, total_tokens, matches = 0.0, 0, 0
    for i in range(0, len(input_ids), batch_size):
        ids, mask = input_ids[i : i + batch_size], masks[i : i + batch_size]
        loss, tokens = answer_loss(model, ids, mask, tokenizer.pad_token_id)
        total_loss, total_tokens = total_loss + loss, total_tokens + tokens
        pairs = [split_prompt_answer(r, m) for r, m in zip(ids, mask, strict=True)]
        hits = exact_matches(
            model, tokenizer, [p for p, _ in pairs], [a for _, a in pairs], max_new_tokens
        )
        matches += sum(hits)
        if on_batch is not None:
            on_batch()
    mean = total_loss / max(total_tokens, 1)
    return {
        "eval_loss": mean,
        "eval_perplexity": math.exp(min(mean, 50.0)),
        "eval_exact_match": matches / max(len(input_ids), 1),
    }


def trained_vs_untrained(
    load_untrained: Callable[[], PreTrainedModel],
    load_trained: Callable[[], PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    held_out: dict[str, list[list[int]]],
    *,
    batch_size: int,
    max_new_tokens: int,
    on_batch: Callable[[], None] | None = None,
) -> tuple[dict[str, float], PreTrainedModel, str]:
    """Score the untrained model (`untrained_*`), then the trained one (`eval_*`), on the same
    held-out conversations, and their loss ratio (`eval_loss_ratio`).

    Returns the metrics, the trained model (still loaded, for registration) and the first
    held-out prompt as text (the registered model's input example).
    """
    metrics: dict[str, float] = {}
    model = None
    for prefix, load in (("untrained", load_untrained), ("eval", load_trained)):
        model = load()
        scores = evaluate_causal_lm(
            model,
            tokenizer,
            held_out["input_ids"],
            held_out["assistant_masks"],
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            on_batch=on_batch,
        )
        metrics |= {k.replace("eval", prefix, 1): v for k, v in scores.items()}
    assert model is not None
    metrics["eval_loss_ratio"] = metrics["eval_loss"] / metrics["untrained_loss"]
    prompt, _ = split_prompt_answer(held_out["input_ids"][0], held_out["assistant_masks"][0])
    text = tokenizer.decode(prompt)
    assert isinstance(text, str)
    return metrics, model, text
