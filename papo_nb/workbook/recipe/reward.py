"""The official PAPO reward, as two TRL reward functions: boxed-answer accuracy (0.9) and format (0.1).

Follows MikeWangWZHL/PAPO ``examples/reward_function/math.py``:

- the response is first normalised with ``re.sub(r"\\s*(<|>|/)\\s*", r"\\1", ...)`` (math.py:38, "handle
  qwen2.5vl-32b format"), for both components;
- format is 1.0 when the whole response matches ``<think>.*</think>.*\\boxed{.*}.*`` (math.py:21-24, DOTALL);
- accuracy is 1.0 when ``mathruler.grader.grade_answer(extract_boxed_content(response), ground_truth)``
  (math.py:27-29);
- overall = 0.9 * accuracy + 0.1 * format (math.py:32,43, ``format_weight=0.1``).

Passed to TRL as ``reward_funcs=[math_accuracy_reward, math_format_reward]`` with
``reward_weights=[0.9, 0.1]``, the trainer's ``reward`` is exactly the official overall score and TRL logs each
component on its own (``rewards/math_accuracy_reward/mean``, ``rewards/math_format_reward/mean``).
"""

from __future__ import annotations

import re

from mathruler.grader import extract_boxed_content, grade_answer

from papo_nb.testbed.rewards import completion_text

FORMAT_WEIGHT = 0.1  # official compute_score(format_weight=0.1), math.py:32
ACCURACY_WEIGHT = 1.0 - FORMAT_WEIGHT
FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # math.py:22
_TAG_SPACING = re.compile(r"\s*(<|>|/)\s*")  # math.py:38


def normalise_response(response: str) -> str:
    """Remove whitespace around ``<``, ``>`` and ``/`` as the official reward does before scoring."""
    return _TAG_SPACING.sub(r"\1", response)


def format_score(response: str) -> float:
    """1.0 when the (normalised) response is ``<think>...</think>...\\boxed{...}...``, else 0.0."""
    return 1.0 if FORMAT_PATTERN.fullmatch(normalise_response(response)) else 0.0


def accuracy_score(response: str, ground_truth: str) -> float:
    """1.0 when the last ``\\boxed{}`` content grades equal to ``ground_truth`` with mathruler, else 0.0."""
    answer = extract_boxed_content(normalise_response(response))
    return 1.0 if grade_answer(answer, str(ground_truth)) else 0.0


def score(response: str, ground_truth: str) -> dict[str, float]:
    """The official ``compute_score`` entry for one response: overall, format, accuracy."""
    fmt, acc = format_score(response), accuracy_score(response, ground_truth)
    return {"overall": ACCURACY_WEIGHT * acc + FORMAT_WEIGHT * fmt, "format": fmt, "accuracy": acc}


def math_accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: boxed-answer accuracy against the dataset's ``answer`` column."""
    return [accuracy_score(completion_text(c), gold) for c, gold in zip(completions, answer, strict=True)]


def math_format_reward(completions, **kwargs) -> list[float]:
    """TRL reward function: the official ``<think>...</think>...\\boxed{}`` format check."""
    return [format_score(completion_text(c)) for c in completions]


REWARD_FUNCS = (math_accuracy_reward, math_format_reward)
REWARD_WEIGHTS = (ACCURACY_WEIGHT, FORMAT_WEIGHT)
