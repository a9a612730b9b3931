"""Reward functions in TRL's signature: `f(completions, **dataset_columns) -> list[float]`.

Answer rule: only text inside a complete `<answer>...</answer>` block counts, and the last complete
block wins. No complete block means no answer: `extract_answer` returns None and accuracy is 0.
"""

from __future__ import annotations

import re

from papo_nb.testbed.shapes import all_answers

# The innermost block: the content may not itself contain an opening tag.
ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
SINGLE_BLOCK_ONLY = re.compile(r"\s*<answer>((?:(?!<answer>|</answer>).)*)</answer>\s*", re.DOTALL)
NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
FILLER_WORDS = {"the", "colour", "color"}  # "the colour red" and "red" are the same answer
# Substring match on purpose: random byte-level text glues words together ("xleftq").
TASK_WORDS = re.compile("|".join(sorted(set(all_answers()) | set(NUMBER_WORDS))))

# format_reward's partial credits; they sum to 1.0.
CREDIT_ON_TOPIC = 0.1
CREDIT_TAG_WORD = 0.1
CREDIT_OPEN_TAG = 0.1
CREDIT_CLOSED_BLOCK = 0.2
CREDIT_ONLY_ONE_BLOCK = 0.5


def completion_text(completion) -> str:
    """Text of a plain-string completion or of TRL's conversational `[{"role": "assistant", ...}]`."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:
        content = message.get("content") or ""
        if isinstance(content, str):
            parts.append(content)
        else:  # structured content: [{"type": "text", "text": ...}, ...]
            parts.extend(p.get("text") or "" for p in content if p.get("type") == "text")
    return "".join(parts)


def normalise_answer(answer: str) -> str:
    """Lowercase, drop filler words and surrounding punctuation, map number words to digits."""
    text = answer.strip().lower().strip(" \t\n.,;:!?\"'`")
    words = [NUMBER_WORDS.get(w, w) for w in text.split() if w not in FILLER_WORDS]
    return " ".join(words)


def extract_answer(text: str) -> str | None:
    """Normalised content of the last complete `<answer>...</answer>` block, or None if there is none."""
    blocks = ANSWER_BLOCK.findall(text)
    if not blocks:
        return None
    return normalise_answer(blocks[-1])


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the extracted answer equals the normalised gold `answer` column, else 0.0. Under TRL it also logs
    the gold answer beside each completion (``log_extra``: TRL's and the review's completions tables)."""
    if kwargs.get("log_extra") is not None:
        kwargs["log_extra"]("answer", [str(gold) for gold in answer])
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        predicted = extract_answer(completion_text(completion))
        rewards.append(1.0 if predicted is not None and predicted == normalise_answer(str(gold)) else 0.0)
    return rewards


def format_score(text: str) -> float:
    """Partial credit for getting closer to exactly `<answer>X</answer>`.

    Pure correctness gives a random tiny policy 0 on every sample, so group advantages are 0 and
    nothing trains. The cheap credits are reached by chance often enough to vary within a group,
    and each step of the ladder is closer to the target format:
      +0.1 a task word appears anywhere, even glued into other text (colour, digit, number word, left/right)
      +0.1 the word "answer" appears anywhere
      +0.1 an opening `<answer>` tag
      +0.2 a complete `<answer>...</answer>` block
      +0.5 the whole completion is one block with non-empty content and nothing around it
    """
    # Tags are matched case-sensitively, as in `extract_answer`, so format and accuracy agree.
    lowered = text.lower()
    score = 0.0
    if TASK_WORDS.search(lowered):
        score += CREDIT_ON_TOPIC
    if "answer" in lowered:
        score += CREDIT_TAG_WORD
    if "<answer>" in text:
        score += CREDIT_OPEN_TAG
    if ANSWER_BLOCK.search(text):
        score += CREDIT_CLOSED_BLOCK
    only_block = SINGLE_BLOCK_ONLY.fullmatch(text)
    if only_block and only_block.group(1).strip():
        score += CREDIT_ONLY_ONE_BLOCK
    return round(score, 6)


def format_reward(completions, **kwargs) -> list[float]:
    """Shaped format reward in [0, 1]; see `format_score` for the credits."""
    return [format_score(completion_text(c)) for c in completions]
