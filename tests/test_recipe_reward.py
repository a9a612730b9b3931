"""The official math reward: answers the grader must accept and reject, the format rule, the 0.9/0.1 weights."""

import pytest

from papo_nb.workbook.recipe.reward import (
    REWARD_WEIGHTS,
    accuracy_score,
    format_score,
    math_accuracy_reward,
    math_format_reward,
    score,
)


def wrap(answer: str) -> str:
    return f"<think>look at the figure</think>The answer is \\boxed{{{answer}}}."


@pytest.mark.parametrize(
    "predicted, gold",
    [
        ("\\frac{1}{2}", "0.5"),  # LaTeX fraction vs decimal
        ("0.50", "\\frac12"),
        ("x=3", "3"),  # an equation's right-hand side
        ("(A)", "A"),  # multiple choice with parentheses
        ("a", "A"),  # case
        ("\\text{B}", "B"),
        ("12", "12.0"),
        ("1,000", "1000"),
        ("2\\sqrt{2}", "\\sqrt{8}"),  # sympy-equal expressions
        ("30^\\circ", "30"),
    ],
)
def test_grader_accepts_equivalent_answers(predicted, gold):
    assert accuracy_score(wrap(predicted), gold) == 1.0


@pytest.mark.parametrize(
    "response, gold",
    [
        (wrap("4"), "3"),  # wrong number
        (wrap("B"), "A"),  # wrong choice
        (wrap("\\pi"), "3.14"),  # not equal, only close
        ("<think>x</think>The answer is 3.", "3"),  # right number but not boxed
        ("<think>x</think>\\boxed{}", "3"),  # empty box
        (wrap("3") + " Actually \\boxed{5}", "3"),  # the last box counts
    ],
)
def test_grader_rejects_wrong_or_unboxed_answers(response, gold):
    assert accuracy_score(response, gold) == 0.0


def test_last_box_wins_when_it_is_right():
    assert accuracy_score(wrap("5") + " Actually \\boxed{3}", "3") == 1.0


@pytest.mark.parametrize(
    "response, expected",
    [
        (wrap("3"), 1.0),
        ("<think>\nmulti\nline\n</think>\n\\boxed{3}", 1.0),  # DOTALL
        ("< think >x</ think >\\boxed{3}", 1.0),  # spaces around tag characters are normalised (math.py:38)
        ("\\boxed{3}", 0.0),  # no reasoning block
        ("<think>x</think> 3", 0.0),  # no box
        ("The answer: <think>x</think>\\boxed{3}", 0.0),  # text before <think>: fullmatch fails
        ("<think>x \\boxed{3}", 0.0),  # unclosed think
    ],
)
def test_format_rule(response, expected):
    assert format_score(response) == expected


def test_weights_and_overall_match_the_official_compute_score():
    assert REWARD_WEIGHTS == (0.9, 0.1)
    assert score(wrap("3"), "3") == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}
    assert score("\\boxed{3}", "3") == {"overall": 0.9, "format": 0.0, "accuracy": 1.0}
    assert score(wrap("4"), "3") == {"overall": pytest.approx(0.1), "format": 1.0, "accuracy": 0.0}


def test_trl_reward_functions_take_conversational_completions():
    completions = [
        [{"role": "assistant", "content": wrap("3")}],
        [{"role": "assistant", "content": "\\boxed{4}"}],
        wrap("7"),
    ]
    assert math_accuracy_reward(completions, answer=["3", "4", "8"]) == [1.0, 1.0, 0.0]
    assert math_format_reward(completions, answer=["3", "4", "8"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError):  # a length mismatch is a bug, not a zero reward
        math_accuracy_reward(completions, answer=["3"])
