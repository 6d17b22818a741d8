"""Writes the agentic example's data (deterministic): train.jsonl and eval.jsonl (tasks: prompt, name,
word; no (name, word) pair of a held-out task appears in training or in the demonstrations) and
sft.jsonl (demonstrations in TRL's conversational SFT format, for the warm start: call the tool, read the
word, answer it).

    python examples/agentic/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from codebook import NAMES, WORDS, CodeBook  # type: ignore[import-not-found]

HERE = Path(__file__).resolve().parent
WORDINGS = [
    "What is the secret word of {}?",
    "Tell me {}'s secret word.",
    "Find the secret word of {}.",
    "Which word is {}'s secret?",
    "Look up {} and give me the word.",
]


def tasks(rng: random.Random, count: int, pairs: set[tuple[str, str]]) -> list[dict[str, str]]:
    """`count` tasks whose (name, word) pairs are in `pairs`."""
    chosen = sorted(pairs)
    rows = []
    for _ in range(count):
        name, word = rng.choice(chosen)
        rows.append({"prompt": rng.choice(WORDINGS).format(name.capitalize()), "name": name, "word": word})
    return rows


def tools_json() -> str:
    """The tools column of the demonstrations: `lookup`'s schema as TRL and rlfabric make it for the chat
    template (transformers' get_json_schema; rlfabric shows no return entry), as JSON text."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(CodeBook().lookup)
    schema["function"].pop("return", None)
    return json.dumps([schema])


def demonstration(task: dict[str, str], tools: str) -> dict[str, object]:
    call = json.dumps({"name": "lookup", "arguments": {"name": task["name"].capitalize()}})
    return {
        "tools": tools,
        "messages": [
            {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": task["word"]},
            {"role": "assistant", "content": task["word"]},
        ],
    }


def write(name: str, rows: list[dict[str, object]]) -> None:
    (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    rng = random.Random(0)
    pairs = [(name, word) for name in NAMES for word in WORDS]
    rng.shuffle(pairs)
    held_out, seen = set(pairs[:64]), set(pairs[64:])
    write("train.jsonl", tasks(rng, 1024, seen))
    write("eval.jsonl", tasks(rng, 64, held_out))
    tools = tools_json()
    write("sft.jsonl", [demonstration(t, tools) for t in tasks(rng, 1024, seen)])


if __name__ == "__main__":
    main()
