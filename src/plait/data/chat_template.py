"""A tokenizer folder's chat template, rendered as ``transformers`` renders it, and the
assistant spans that become the loss mask of ``plait data prepare``.

The template is the folder's (``chat_template.jinja``, which ``transformers`` 5 writes, or
``tokenizer_config.json``'s ``chat_template``), or a file given with ``--chat-template``;
a tokenizer without one is refused. Rendering goes through ``transformers``' own jinja
environment (:func:`transformers.utils.chat_template_utils.render_jinja_template`, with
the tokenizer's special tokens as variables, as ``apply_chat_template`` passes them), and
the text is tokenized as ``apply_chat_template(tokenize=True)`` does (no special tokens
added: the template writes them).

The assistant spans (character ranges of the rendering, one per assistant turn):

* a template with ``{% generation %}`` markers: the marked ranges (what
  ``return_assistant_tokens_mask`` marks);
* a template without them (Llama 3's, Qwen's and most others): the conversation is
  rendered turn by turn; assistant turn ``i``'s span is what rendering ``messages[:i+1]``
  adds to ``messages[:i]`` rendered with the generation prompt — the text the model
  would generate after the prompt, its end-of-turn token included. This needs the
  *prefix property*: each of those renderings is a prefix of the next and of the whole
  conversation's. A template that rewrites earlier turns when later ones come (Qwen3's
  drops the thinking blocks of earlier assistant turns) breaks it and is refused by
  name (:class:`~plait.errors.DataError`): give a template with ``{% generation %}``
  markers with ``--chat-template``.

A token is in a span when its characters overlap it (``transformers``' rule).

Every conversation is followed by a *separator* (:meth:`ChatTemplate.separator`, mask 0):
a special token of the tokenizer that the template never writes (Llama 3's
``<|end_of_text|>`` where turns end with ``<|eot_id|>``), recorded as the prepared
folder's end-of-document id. So, as for text, every sample ends with that id and no
sample holds it elsewhere, and the document ids that ``data.mask_documents`` derives
from it mark the samples, not the turns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.tokenizers import EOS_NAMES
from plait.errors import DataError, install_hint

GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
"""A ``{% generation %}`` marker in a template."""

TRAIN_ON = ("all", "assistant", "last")
"""``--train-on`` choices: every token, every assistant turn, the last assistant turn."""

Message = dict[str, Any]


def tokenizer_folder(spec: str) -> Path:
    """The folder of an ``hf:PATH`` tokenizer spec (PATH a folder or its tokenizer.json)."""
    if not spec.startswith("hf:"):
        raise DataError(
            f"chat data needs a Hugging Face tokenizer folder with a chat template "
            f"(--tokenizer hf:DIR); {spec!r} has no chat template."
        )
    p = Path(spec[3:]).expanduser()
    return p.parent if p.is_file() else p


class ChatTemplate:
    """A tokenizer and its chat template (see the module's docstring)."""

    def __init__(self, spec: str, template_file: str | None = None) -> None:
        folder = tokenizer_folder(spec)
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError as exc:
            raise DataError(
                f"chat data needs transformers to render the chat template; install it with "
                f"{install_hint('hf', 'transformers')}."
            ) from exc
        self._render_jinja = render_jinja_template
        try:
            self.tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
        except Exception as exc:  # transformers raises OSError, ValueError ...
            raise DataError(f"{folder}: not a readable tokenizer folder ({exc}).") from exc
        if template_file is not None:
            path = Path(template_file).expanduser()
            try:
                template = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise DataError(f"--chat-template {path}: cannot read it ({exc}).") from exc
            self.source = str(path)
        else:
            if not self.tok.chat_template:
                raise DataError(
                    f"{folder}: the tokenizer has no chat template (no chat_template.jinja and "
                    "no chat_template in tokenizer_config.json); give one with "
                    "--chat-template FILE."
                )
            template = self.tok.get_chat_template()
            self.source = str(folder)
        self.template: str = template
        self.markers = GENERATION.search(template) is not None
        """Whether the template marks the assistant's text with ``{% generation %}``."""
        self.variables = dict(self.tok.special_tokens_map)

    def _render(self, messages: Sequence[Message], prompt: bool = False) -> tuple[str, list]:
        out, spans = self._render_jinja(  # type: ignore[str-unpack]  # returns a pair
            conversations=[list(messages)],
            chat_template=self.template,
            return_assistant_tokens_mask=self.markers,
            add_generation_prompt=prompt,
            **self.variables,
        )
        return str(out[0]), list(spans[0]) if spans else []

    def separator(self) -> int:
        """The id of a special token the template does not write in a probe conversation:
        the tokenizer's eos, the usual end-of-text names, its pad token, then its other
        special tokens, the first unused (DataError when every one is used)."""
        probe = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        try:
            used = set(self.encode(probe, "all")[0].tolist())
        except Exception:  # a template may refuse a system turn
            used = set(self.encode(probe[1:], "all")[0].tolist())
        tok = self.tok
        names = [tok.eos_token, *EOS_NAMES, tok.pad_token, *tok.all_special_tokens]
        for name in names:
            if not isinstance(name, str):
                continue
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid not in used:
                return tid
        raise DataError(
            f"{self.source}: the chat template writes every special token of the tokenizer, "
            "so none is free to end each sample (its eos, <|end_of_text|>, <|endoftext|>, "
            "the pad token ...); add one to the tokenizer."
        )

    def _opening(self) -> str:
        """What the template writes before a conversation's first turn when that turn is
        the assistant's (the empty conversation with the generation prompt; "" when the
        template cannot render an empty conversation)."""
        try:
            return self._render([], prompt=True)[0]
        except Exception:  # a template may index messages[0]
            return ""

    def render(self, messages: Sequence[Message]) -> str:
        """The conversation's text, as ``apply_chat_template(tokenize=False)`` gives it."""
        return self._render(messages)[0]

    def spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendering and the character span of every assistant turn."""
        text, marked = self._render(messages)
        if self.markers:
            return text, [(int(a), int(b)) for a, b in marked]
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], prompt=True)[0] if i else self._opening()
            upto = self._render(messages[: i + 1])[0]
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(
                    f"the chat template of {self.source} rewrites earlier turns when later ones "
                    "are added (as Qwen3's does with thinking blocks), so the assistant turns "
                    "cannot be found by rendering turn by turn; give a template with "
                    "{% generation %} markers with --chat-template FILE."
                )
            spans.append((len(before), len(upto)))
        return text, spans

    def encode(self, messages: Sequence[Message], train_on: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)``: the conversation's token ids ``(n,)`` uint32 and which tokens are
        trained ``(n,)`` uint8 (``train_on`` one of :data:`TRAIN_ON`; the first token is
        never trained: nothing of the sample predicts it)."""
        text, spans = self.spans(messages)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.uint32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        if train_on == "all":
            mask[:] = 1
        else:
            off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # (n, 2)
            for a, b in spans[-1:] if train_on == "last" else spans:
                mask[(off[:, 1] > a) & (off[:, 0] < b)] = 1
        if len(mask):
            mask[0] = 0
        return ids, mask
