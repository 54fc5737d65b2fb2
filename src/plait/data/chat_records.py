"""The samples of a chat or instruction JSONL file, checked record by record.

A record is one of:

* ``{"messages": [{"role": ROLE, "content": TEXT}, ...]}`` (ROLE one of :data:`ROLES`);
* ``{"prompt": TEXT, "completion": TEXT}``: the conversation ``[user: prompt,
  assistant: completion]``;
* ``{"prompt": [messages], "completion": [messages]}`` (TRL's conversational form): the
  two lists joined.

Every problem (not JSON, a missing field, an unknown role, content that is not text) is a
:class:`~plait.errors.DataError` naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plait.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a message may have."""

Message = dict[str, Any]


def is_chat_record(obj: object) -> bool:
    """Whether a JSON value looks like a chat or prompt/completion record."""
    return isinstance(obj, dict) and ("messages" in obj or "prompt" in obj)


def _messages(value: object, where: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: 'messages' must be a non-empty list of messages.")
    out = []
    for n, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {n} has no 'role' or no 'content' field.")
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: message {n} has the unknown role {m['role']!r} "
                f"(roles: {', '.join(ROLES)})."
            )
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {n}'s content is not text.")
        out.append(dict(m))
    return out


def record_messages(obj: object, where: str) -> list[Message]:
    """The conversation of one record (``where`` is ``file:line`` for errors)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: not a JSON object.")
    if "messages" in obj:
        return _messages(obj["messages"], where)
    if "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        if isinstance(p, list) and isinstance(c, list):
            return _messages(p + c, where)
        raise DataError(f"{where}: 'prompt' and 'completion' must both be text or both lists.")
    missing = "completion" if "prompt" in obj else "messages"
    raise DataError(
        f'{where}: no {missing!r} field; a chat record is {{"messages": [...]}} or '
        '{"prompt": ..., "completion": ...}.'
    )


def iter_conversations(files: list[Path]) -> Iterator[list[Message]]:
    """Every record's conversation, in file and line order (blank lines skipped)."""
    for path in files:
        with path.open("rb") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{where}: not a JSON object ({exc}).") from exc
                yield record_messages(obj, where)


def first_record(path: Path) -> object:
    """The first record of a JSONL file (None when it is empty or not JSON)."""
    with path.open("rb") as fh:
        for line in fh:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None
