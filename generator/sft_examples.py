"""How a real turn becomes an SFT example: the role-flipped prompt the simulator sees at sampling time and the turn
as its completion (with END_MARKER on a conversation's last turn), fitted to the token budget without cutting the
turn; and the tokenization TRL's SFTTrainer applies to it (for the length check and the perplexity)."""

from __future__ import annotations

import logging
from typing import Sequence

from conversations import TurnRecord
from conversations.schema import DataError
from generator.prompts import fit_messages, target_text

log = logging.getLogger("generator.sft")

# room left for the template tokens around the completion (`<|im_start|>assistant\n`, `<|im_end|>\n`)
_TEMPLATE_SLACK = 8
_MIN_PROMPT_TOKENS = 64


def sft_example(
    record: TurnRecord, tokenizer, *, max_context_tokens: int = 256, max_length: int | None = None
) -> dict[str, list[dict[str, str]]]:
    """One conversational prompt-completion example. The prompt budget shrinks when the turn is long, so prompt and
    completion fit `max_length` and the turn (and its end marker) is never cut."""
    target = target_text(record)
    budget = max_context_tokens
    if max_length is not None:
        n_target = len(tokenizer(target, add_special_tokens=False)["input_ids"]) + _TEMPLATE_SLACK
        budget = max(_MIN_PROMPT_TOKENS, min(budget, max_length - n_target))
    prompt = fit_messages(
        tokenizer, record.context, record.meta.get("persona"), record.meta.get("goal"), max_context_tokens=budget
    )
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": target}]}


def sft_examples(
    records: Sequence[TurnRecord], tokenizer, *, max_context_tokens: int = 256, max_length: int | None = None
) -> tuple[list[dict], int]:
    """(examples, number left out). An example still longer than `max_length` after the prompt has shrunk (a turn
    longer than the budget allows) is left out rather than cut: a cut would drop its end marker and end-of-turn."""
    out, dropped = [], 0
    for r in records:
        ex = sft_example(r, tokenizer, max_context_tokens=max_context_tokens, max_length=max_length)
        if max_length is not None and len(encode_example(tokenizer, ex)[0]) > max_length:
            dropped += 1
            continue
        out.append(ex)
    if dropped:
        log.warning("%d of %d turns left out: longer than max_length=%s tokens", dropped, len(records), max_length)
    return out, dropped


def build_sft_dataset(records: Sequence[TurnRecord], tokenizer, *, max_context_tokens: int = 256, max_length: int | None = None):
    """A `datasets.Dataset` of conversational prompt-completion examples (columns `prompt`, `completion`) that TRL's
    SFTTrainer tokenizes with the chat template, masking the prompt out of the loss. Turns that cannot fit
    `max_length` whole are left out."""
    from datasets import Dataset

    rows, _ = sft_examples(records, tokenizer, max_context_tokens=max_context_tokens, max_length=max_length)
    if not rows:
        raise DataError(f"no turn fits max_length={max_length} tokens; raise max_length or lower max_turn_chars")
    return Dataset.from_list(rows)


def encode_example(tokenizer, example: dict) -> tuple[list[int], list[int]]:
    """(input_ids, completion_mask) the way TRL's SFTTrainer tokenizes a conversational prompt-completion example:
    the completion starts where the tokenized prompt and prompt+completion first differ."""
    prompt_ids = tokenizer.apply_chat_template(
        example["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True
    )["input_ids"]
    ids = tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=True, return_dict=True)[
        "input_ids"
    ]
    n = 0
    while n < min(len(prompt_ids), len(ids)) and prompt_ids[n] == ids[n]:
        n += 1
    return list(ids), [0] * n + [1] * (len(ids) - n)
