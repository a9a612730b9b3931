"""Answer extraction, accuracy and the shaped format reward."""

import pytest

from papo_nb.testbed.rewards import accuracy_reward, extract_answer, format_reward, normalise_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>red</answer>", "red"),
        ("I think <answer> Red. </answer>", "red"),
        ("<answer>three</answer>", "3"),
        ("<answer>Ten</answer>", "10"),
        ("<answer>the colour blue</answer>", "blue"),
        ("<answer>blue color</answer>", "blue"),
        ("<answer>LEFT!</answer>", "left"),
        ("<answer>red</answer> wait, <answer>green</answer>", "green"),  # the last block wins
        ("<answer>red</answer> then <answer>green", "red"),  # a trailing unclosed tag is ignored
        ("<answer><answer>4</answer>", "4"),  # innermost block
        ("<answer>\nright\n</answer>", "right"),
        ("<answer></answer>", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text", ["red", "", "<answer>red", "red</answer>", "</answer>red<answer>", "<ANSWER>red</ANSWER>"]
)
def test_missing_or_unclosed_tags_give_no_answer(text):
    assert extract_answer(text) is None


def test_normalise_answer():
    assert normalise_answer("  Yellow.\n") == "yellow"
    assert normalise_answer("Two") == "2"
    assert normalise_answer("'right'") == "right"


def test_accuracy_reward_plain_strings():
    completions = ["<answer>red</answer>", "<answer>blue</answer>", "red", "<answer>Three</answer>"]
    assert accuracy_reward(completions, answer=["red", "red", "red", "3"]) == [1.0, 0.0, 0.0, 1.0]


def test_accuracy_reward_conversational_completions():
    completions = [
        [{"role": "assistant", "content": "<answer>left</answer>"}],
        [{"role": "assistant", "content": "left"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>4</answer>"}]}],
    ]
    # TRL passes every dataset column as a keyword; extra ones must be accepted.
    kinds = ["side", "side", "count"]
    rewards = accuracy_reward(completions, answer=["left", "left", "four"], kind=kinds, prompts=None)
    assert rewards == [1.0, 0.0, 1.0]


def test_accuracy_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        accuracy_reward(["<answer>red</answer>"], answer=["red", "blue"])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", 0.0),
        ("xyz", 0.0),
        ("xqleftz", 0.1),  # a task word glued into noise still earns the on-topic credit
        ("answer", 0.1),
        ("<answer>", 0.2),
        ("<answer>zz", 0.2),
        ("<answer>zz</answer> more", 0.4),
        ("<answer></answer>", 0.4),  # empty content is not a full answer
        ("<answer>zz</answer>", 0.9),
        ("<answer>red</answer>", 1.0),
        ("  <answer>red</answer>\n", 1.0),
        ("<answer>red</answer><answer>blue</answer>", 0.5),  # two blocks: not the single-block credit
        ("blah <answer>red</answer>", 0.5),
        ("<ANSWER>red</ANSWER>", 0.2),  # tags are case-sensitive, as in extract_answer
    ],
)
def test_format_reward_ladder(text, expected):
    assert format_reward([text]) == [pytest.approx(expected)]


def test_format_reward_accepts_conversational_and_is_bounded():
    completions = [[{"role": "assistant", "content": "<answer>2</answer>"}], "noise", "<answer>"]
    rewards = format_reward(completions, answer=["2", "1", "1"])
    assert rewards == [pytest.approx(1.0), 0.0, pytest.approx(0.2)]
    assert all(0.0 <= r <= 1.0 for r in rewards)


def test_format_reward_varies_on_random_text():
    """The point of shaping: random byte soup gets non-zero, varied format rewards."""
    import random

    from papo_nb.testbed.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    rng = random.Random(0)
    vocab_ids = list(range(len(tokenizer)))
    texts = [tokenizer.decode([rng.choice(vocab_ids) for _ in range(16)], skip_special_tokens=True) for _ in range(64)]
    rewards = format_reward(texts)
    assert len(set(rewards)) >= 2 and sum(r > 0 for r in rewards) >= 8
    assert accuracy_reward(texts, answer=["red"] * 64) == [0.0] * 64
