"""A synthetic shapes task whose answers need the image.

Each example is a white image with 1-4 coloured shapes, one per cell of a 2x2 grid, and one of three
questions. The text alone never determines the answer: the same question text is paired with every
possible answer across the dataset, so a policy can only score above chance by looking.
"""

from __future__ import annotations

import random

import datasets
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 30),
    "blue": (30, 60, 220),
    "yellow": (230, 200, 20),
}
KINDS = ("colour", "count", "side")
GRID_ROWS, GRID_COLS = 2, 2
MAX_SHAPES = GRID_ROWS * GRID_COLS

ANSWER_INSTRUCTION = "Answer with <answer>...</answer>."

FEATURES = datasets.Features(
    {
        "prompt": datasets.List(
            {
                "role": datasets.Value("string"),
                "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")}),
            }
        ),
        "image": datasets.Image(),
        "answer": datasets.Value("string"),
        "kind": datasets.Value("string"),
    }
)


def question_text(kind: str, shape: str | None = None) -> str:
    """The question for one kind; `shape` names the unique target shape for colour/side questions."""
    if kind == "colour":
        return f"What colour is the {shape}?"
    if kind == "count":
        return "How many shapes are there?"
    if kind == "side":
        return f"Is the {shape} on the left or the right?"
    raise ValueError(f"kind={kind!r} is not a question kind; expected one of {KINDS}")


def prompt_text(question: str) -> str:
    return f"{question} {ANSWER_INSTRUCTION}"


def all_answers() -> list[str]:
    return [*COLOURS, *(str(n) for n in range(1, MAX_SHAPES + 1)), "left", "right"]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, colour: str, cx: int, cy: int, radius: int) -> None:
    fill = COLOURS[colour]
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=fill)
    else:
        raise ValueError(f"shape={shape!r} is not a shape; expected one of {SHAPES}")


def render_shapes(placed: list[tuple[str, str, int]], image_size: int, rng: random.Random) -> Image.Image:
    """Draw (shape, colour, cell) triples; each shape stays inside its grid cell, so its half is unambiguous."""
    image = Image.new("RGB", (image_size, image_size), "white")
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = image_size // GRID_COLS, image_size // GRID_ROWS
    for shape, colour, cell in placed:
        row, col = divmod(cell, GRID_COLS)
        max_radius = min(cell_w, cell_h) // 2 - 3
        radius = rng.randint(max(3, max_radius * 2 // 3), max_radius)
        # Jitter the centre but keep a margin so no shape crosses the vertical midline.
        cx = col * cell_w + rng.randint(radius + 2, cell_w - radius - 2)
        cy = row * cell_h + rng.randint(radius + 2, cell_h - radius - 2)
        _draw_shape(draw, shape, colour, cx, cy, radius)
    return image


def make_example(rng: random.Random, kind: str, image_size: int = 112) -> dict:
    """One example of `kind`, drawn entirely from `rng`."""
    n_shapes = rng.randint(1, MAX_SHAPES)
    cells = rng.sample(range(MAX_SHAPES), n_shapes)
    target = rng.choice(SHAPES)
    # The target sits in the first cell; the other shapes avoid its type, so "the circle" is unique.
    others = [s for s in SHAPES if s != target]
    shapes = [target] + [rng.choice(others) for _ in cells[1:]]
    colours = [rng.choice(list(COLOURS)) for _ in cells]
    placed = list(zip(shapes, colours, cells))
    image = render_shapes(placed, image_size, rng)

    if kind == "colour":
        question, answer = question_text(kind, target), colours[0]
    elif kind == "count":
        question, answer = question_text(kind), str(n_shapes)
    elif kind == "side":
        question, answer = question_text(kind, target), "left" if cells[0] % GRID_COLS == 0 else "right"
    else:
        raise ValueError(f"kind={kind!r} is not a question kind; expected one of {KINDS}")

    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt_text(question)}]}]
    return {"prompt": prompt, "image": image, "answer": answer, "kind": kind}


def make_shapes_dataset(n: int, seed: int = 0, image_size: int = 112) -> datasets.Dataset:
    """`n` examples in TRL's conversational VLM format, kinds cycling colour/count/side.

    Deterministic: one `random.Random(seed)` drives every choice, so the same seed gives the same
    pixels and text.
    """
    if image_size < 28 * GRID_COLS:
        raise ValueError(f"image_size={image_size} is too small; need at least {28 * GRID_COLS} pixels")
    rng = random.Random(seed)
    rows = [make_example(rng, KINDS[i % len(KINDS)], image_size) for i in range(n)]
    columns = {key: [row[key] for row in rows] for key in FEATURES}
    return datasets.Dataset.from_dict(columns, features=FEATURES)


def task_corpus() -> list[str]:
    """Every string the task produces: each distinct prompt text and each answer wrapped in tags."""
    questions = [question_text("colour", s) for s in SHAPES]
    questions += [question_text("count")]
    questions += [question_text("side", s) for s in SHAPES]
    return [prompt_text(q) for q in questions] + [f"<answer>{a}</answer>" for a in all_answers()]
