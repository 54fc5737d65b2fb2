"""A tokenizer folder with a chat template, made here (no download): byte-level BPE trained
with ``tokenizers`` on a few sentences, saved by ``transformers`` with Llama 3's special
tokens, and chat templates in Llama 3's style with and without ``{% generation %}``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOT, START, END, EOS = (
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|end_of_text|>",
)

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3's template, simplified (no tools, no date): no generation markers."""

MARKED = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""The same with ``{% generation %}`` around the assistant's text."""

REWRITES = (
    "{% set last = namespace(i=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' and loop.index0 < last.i %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Qwen3's habit: earlier assistant turns lose their thinking once a user turn follows."""

TEXT = (
    "the user asks a question and the assistant answers it with care. "
    "hello world, how are you today? the answer is forty two. "
    "numbers 0 1 2 3 4 5 6 7 8 9 and more words: packing, masks, templates."
)


def tokenizer_folder(root: Path, template: str | None) -> Path:
    """A transformers tokenizer folder under ``root`` (``template`` None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[BOS, EOT, START, END, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT)
    if template is not None:
        fast.chat_template = template
    folder = root / "tokenizer"
    fast.save_pretrained(str(folder))
    return folder


def conversations() -> list[list[dict[str, Any]]]:
    """Conversations of one and several turns, with and without a system message."""
    return [
        [
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "how are you"},
        ],
        [
            {"role": "system", "content": "the assistant answers with care."},
            {"role": "user", "content": "the answer?"},
            {"role": "assistant", "content": "forty two"},
            {"role": "user", "content": "and numbers?"},
            {"role": "assistant", "content": "0 1 2 3"},
        ],
        [{"role": "user", "content": "packing, masks"}, {"role": "assistant", "content": ""}],
    ]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """``records`` one JSON object a line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
