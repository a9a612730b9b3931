"""The perception testbed: a tiny Qwen2-VL warm-started to *see*, on a task split by vision dependency.

Each item is a black 56x56 image (4x4 cells of 14 px, one vision patch each) with one coloured square filling
one random cell, and one of two questions:

- vision-dependent, "What colour is the square?": only the image answers it; text alone gives chance (1/4);
- text-answerable, "What colour is the <c> circle?": the question names the answer; the image shows an
  unrelated square of a random colour, a distractor.

Two of every three items are vision-dependent, as the paper splits benchmarks by vision dependency.

The square fills exactly one 14x14 cell, aligned with the official PAPO mask (14x14 squares of the raw image,
``papo_nb.testbed.raw_masks``) and with the trainer's patch mask: at mask ratio 0.6 the square is hidden on 60%
of items, and at 1.0 always.

Two testbeds share the task and differ in their warm start (``TESTBED_RECIPES``):

- ``shapes`` answers ``<answer>colour</answer>`` and stops between 40% and 70% greedy vision accuracy, so RL has
  room (the method study's policy);
- ``shapes_boxed`` also learns to answer ``\\boxed{colour}`` when the question asks for it (``BOXED_INSTRUCTION``),
  the format the official reward grades, and stops later, between 60% and 90%: the smoke workbook's policy, whose
  every notebook then has a number above chance to show, notebook 05 included.

A third, ``shapes_prior``, gives its task a *language prior*, the regime PAPO is motivated by: each vision-dependent
question names a square by number ("What colour is square 3?", ``PRIOR_QUESTION``), and in training the square has
its number's colour (``PRIOR_COLOURS``) on ``prior_rate`` = 75% of items, so a policy that ignores the image still
earns 75% there. Its held-out items break the prior: the square never has its number's colour, so only reading the
image scores, and a policy that follows the text scores 0 (below a guesser's 25%). Its warm start learns to read
first (a shown square's colour says nothing of its number) and learns the prior from items that show no square, so it
reads when it sees and follows the number when blind. Its card reports prior-consistent and prior-breaking items
apart.

``papo_nb.testbed.policy.build_testbed`` makes the policy (it scores with the workbook's generation and
masks, so it lives a layer up): the offline tiny Qwen2-VL of ``papo_nb.testbed.models`` (about 200k
parameters) trained by plain cross-entropy on the answer tokens, on a curriculum whose squares shrink from the
whole image to one cell (``curriculum_side``), and stopped on purpose while validation accuracy with images is
between chance and ceiling, so that RL can move it. The batch, optimizer and learning rate follow the supervised
pass in STACK_FACTS.md ("A short supervised pass makes a tiny VLM see": batch 16, AdamW lr 3e-3, one thread); the
curriculum is what makes it reach its goal on every floating-point path. Workbook parameters name it
``testbed:shapes``.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field, replace

import datasets
import torch
from PIL import Image, ImageDraw

from papo_nb.testbed import shapes
from papo_nb.testbed.shapes import ANSWER_INSTRUCTION, COLOURS

TESTBED_PREFIX = "testbed:"
# Bump when the task or the warm-start code changes, so old caches are not reused (a recipe's own change renames its
# cache by itself: ``TestbedRecipe.digest``).
TESTBED_VERSION = 3  # 2: the shapes_prior testbed; 3: the shrinking-square curriculum and the stop band
CARD_FILE = "testbed_card.json"

IMAGE_SIZE = 56  # the processor's minimum: 4x4 patches of 14 px, 4 merged image tokens
CELL = 14  # one vision patch = one official mask square
GRID = IMAGE_SIZE // CELL
VISION_QUESTION = "What colour is the square?"
TEXT_QUESTION = "What colour is the {colour} circle?"
KINDS = ("vision", "vision", "text")  # two vision-dependent items for each text-answerable one
CHANCE_VISION = 1 / len(COLOURS)
PRIOR_QUESTION = "What colour is square {tag}?"
PRIOR_COLOURS = {str(tag): colour for tag, colour in enumerate(COLOURS, start=1)}  # "1" -> red, ... "4" -> yellow
PRIOR_PATTERN = re.compile(re.escape(PRIOR_QUESTION).replace(re.escape("{tag}"), "([0-9]+)"))

MERGE = 2  # the testbed processor's merge size: its pixel_values rows come in 2x2 blocks of patches
# the column of the patch units that show the square (``square_units``): a placebo mask excludes them
SQUARE_UNITS = "square_units"
# the shapes task's columns plus the vision-dependency flag and the square's patch units
FEATURES = datasets.Features(
    {
        **shapes.FEATURES,
        "vision_dependent": datasets.Value("bool"),
        SQUARE_UNITS: datasets.Sequence(datasets.Value("int64")),
    }
)

# The warm-start recipe: a continuation curriculum. Trained on one-cell squares from the start, the tiny model sits
# at chance for hundreds of steps and then jumps to reading, and when it jumps is chaotic in floating point (seed 0:
# step 950, 1600 or never within 2400 on the default, avx2 and avx512 kernels). Trained first on squares that fill
# the image, it reads within about 100 steps on every path; the square then shrinks a pixel at a time to one cell,
# and the reading follows it down (measured: every path and seed tried read one-cell squares perfectly once the
# curriculum reached them). One-cell accuracy so climbs from chance to the ceiling during the shrink, with flat
# stretches on the way, and the pass stops at the second validation check in a row whose one-cell accuracy lies in
# the testbed's band: between chance and ceiling, so RL has room; two in a row, so that a check's sampling noise
# alone does not stop it (the held-out card then scores what validation saw). Reading can also jump within ten steps
# from below the band to the ceiling; the weights of the last check in band are kept for that case. A pass with no
# check in its band fails loudly (``papo_nb.testbed.policy.TestbedGoalMissed``).
SFT_MAX_STEPS = 1500  # the step limit, reached only by a pass that has not met its goal
SFT_CHECK_EVERY = 10
STOP_AFTER_CHECKS = 2  # consecutive validation checks that meet the goal
SFT_BATCH = 16
SFT_LR = 3e-3
CURRICULUM_HOLD = 100  # warm-start steps on squares that fill the whole image
CURRICULUM_SHRINK = 400  # steps over which the square's side shrinks linearly from the image to one cell
VISION_BAND = (0.40, 0.70)
BLACK = (0, 0, 0)  # the background of every testbed before shapes_shortcut_grey, and PAPO-G's default mask fill
GREY = (64, 64, 64)  # shapes_shortcut_grey's: no answer colour, far from the processor's mean (about (122, 116, 104))
TEXT_FLOOR = 0.9  # a text question names its answer: a warm start that has not learned to copy it is not done
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."


def curriculum_side(step: int) -> int:
    """The square's side (pixels) at warm-start step ``step``: the whole image, then shrinking to one cell."""
    shrunk = min(max(step - CURRICULUM_HOLD, 0) / CURRICULUM_SHRINK, 1.0)
    return round(IMAGE_SIZE - (IMAGE_SIZE - CELL) * shrunk)


@dataclass(frozen=True)
class TestbedRecipe:
    """How one testbed's warm start differs from the others (same task, model, curriculum, batch and learning rate)."""

    # the validation accuracy on one-cell vision items (prior-breaking ones if a prior) that stops the pass
    vision_band: tuple[float, float]
    boxed_every: int = 0  # every n-th warm-start item asks for \boxed{} instead of <answer>; 0: none
    prior_rate: float | None = None  # share of training vision items with their number's colour; None: no prior
    text_floor: float = TEXT_FLOOR  # validation accuracy on text items the stop also needs
    # every n-th warm-start vision item shows no square (0: none): the curriculum's squares are always easy to read,
    # so without them the reading leaves the prior nothing to teach, and a blind policy would guess
    blank_every: int = 0
    # validation accuracy on prior-consistent items with the image all black (the prior alone) the stop also needs
    blind_prior_floor: float | None = None
    kinds: tuple[str, ...] = KINDS  # the question kinds items cycle through, in the warm start and the task
    # the prior rate of the warm start's items when it differs from the task's (None: the task's, ``prior_rate``)
    warm_start_prior_rate: float | None = None
    # the prior rate of blank warm-start items (None: ``warm_start_prior``): what a policy learns to answer blind
    blank_prior_rate: float | None = None
    decoy_share: tuple[float, float] | None = None  # a decoy colour's share of each square's pixels (``overpaint``)
    # the held-out items' decoys: the number's colour where it is not the answer (True, as the RL task's), or drawn
    # from the other colours apart from the number (False). The warm start, its validation and card never read it.
    held_out_prior_decoy: bool = True
    # every pixel outside the square (RGB), wherever the recipe's items are drawn; out of repr so that the recipes on
    # black keep their digests (their pinned builds' cache names): ``digest`` adds it where it is not black
    background: tuple[int, int, int] = field(default=BLACK, repr=False)

    @property
    def warm_start_prior(self) -> float | None:
        return self.prior_rate if self.warm_start_prior_rate is None else self.warm_start_prior_rate

    @property
    def blank_prior(self) -> float | None:
        return self.warm_start_prior if self.blank_prior_rate is None else self.blank_prior_rate

    @property
    def digest(self) -> str:
        """A short hash of every field: a build cached under it is one of this recipe, not of an earlier one."""
        drawn_on = "" if self.background == BLACK else f"background={self.background!r}"
        return hashlib.sha256((repr(self) + drawn_on).encode()).hexdigest()[:8]


TESTBED_RECIPES = {
    "shapes": TestbedRecipe(vision_band=VISION_BAND),
    # Stopped higher, where a few RL steps, sampling at temperature 1 and the collapse arm's gamma still leave it
    # above chance: the smoke workbook's policy.
    "shapes_boxed": TestbedRecipe(vision_band=(0.60, 0.90), boxed_every=2),
    # Reading first, by design: the number says nothing about a square that is shown (rate 1/4, chance), so the
    # warm start learns to read as shapes' does; the prior comes from the blank items, whose answer is the number's
    # colour, always. Trained with the prior on shown squares too (0.75), the prior won the race against reading on
    # one kernel path (seed 0, avx2: prior-breaking accuracy 0 for 1500 steps) and was late on others; with blank
    # items that follow it only at the task's 0.75, the blind prior reached its floor only after reading had passed
    # the band, on two paths of three (seed 0: at the step limit vision 1.00, blind prior 0.69-0.80).
    "shapes_prior": TestbedRecipe(
        vision_band=(0.35, 0.70),
        prior_rate=0.75,
        blank_every=2,
        blind_prior_floor=0.6,
        warm_start_prior_rate=CHANCE_VISION,
        blank_prior_rate=1.0,
    ),  # fmt: skip
    # A reader that leans on a prior a little, trained on data that pays for leaning on it a lot. A decoy colour
    # covers 10-70% of each square, so on a third of items the majority colour is wrong and a majority reader scores
    # about 2/3; where the number's colour is not the answer it is the decoy, so the image never rules the prior out.
    # The warm start's numbers name the colour on half its items (its decoys drawn apart from them), as a pretrained
    # model carries priors; it stops as an imperfect reader that already follows the number blind on some items. The
    # RL task's number names the colour on 90% of items, so following it earns 0.9 a question against about 2/3 for
    # reading. Every item is vision-dependent: no distractor-image text questions.
    "shapes_shortcut": TestbedRecipe(
        vision_band=(0.40, 0.65),
        prior_rate=0.9,
        kinds=("vision",),
        warm_start_prior_rate=0.5,
        decoy_share=(0.1, 0.7),
        blind_prior_floor=0.4,
        # with the decoy apart from the number, a held-out error tells the prior (a colour not shown) from
        # the decoy (a colour shown); tied, the two were one colour. Training keeps them tied (docs/study.md: drawn
        # apart there too, GRPO learnt the number as a tiebreaker between shown colours and drifted 4 points, not 11)
        held_out_prior_decoy=False,
    ),
}
# grey background: PAPO-G's black fill changes it, so a black-fill placebo differs only in where the mask goes
TESTBED_RECIPES["shapes_shortcut_grey"] = replace(TESTBED_RECIPES["shapes_shortcut"], background=GREY)
TESTBEDS = tuple(TESTBED_RECIPES)
VALIDATION_ITEMS = 192  # 128 vision items: a check's binomial sd about 0.04, so one lucky check cannot stop it
VALIDATION_SEED = 77_777
CARD_ITEMS = 192  # held-out items scored greedily at build time (the card)
CARD_SEED = 99_999  # a stream neither the warm-start, the validation nor the study's data use


def make_item(
    rng: random.Random, kind: str, boxed: bool = False, prior_rate: float | None = None, side: int = CELL,
    decoy_share: tuple[float, float] | None = None, prior_decoy: bool = True, background: tuple[int, int, int] = BLACK,
) -> dict:  # fmt: skip
    """One item of ``kind`` ("vision" or "text"), every choice drawn from ``rng``; ``boxed`` asks for the answer in
    ``\\boxed{}`` (``target`` is the completion the warm start teaches). ``prior_rate`` (vision items only) asks
    ``PRIOR_QUESTION`` and gives the square its number's colour with that probability, another colour otherwise.
    ``side`` (pixels) draws a larger square around the same cell, kept inside the image, for the warm start's
    curriculum; it draws nothing more from ``rng``, so an item differs from the task's only in its square's size.
    ``decoy_share`` (low, high) paints a share of the square's pixels, drawn uniformly in that range, in a decoy
    colour (``overpaint``): with ``prior_decoy``, the colour a prior question's number names where that is not the
    answer, so the image never rules the prior out; otherwise (and on items that follow the prior) another colour
    than the answer, drawn from ``rng``. ``background``: the colour of every other pixel (draws nothing)."""
    colour = rng.choice(list(COLOURS))
    if prior_rate is not None and kind == "vision":
        tag = rng.choice(list(PRIOR_COLOURS))
        others = [c for c in COLOURS if c != PRIOR_COLOURS[tag]]
        colour = PRIOR_COLOURS[tag] if rng.random() < prior_rate else rng.choice(others)
    cell = rng.randrange(GRID * GRID)
    row, col = divmod(cell, GRID)
    if not CELL <= side <= IMAGE_SIZE:
        raise ValueError(f"side={side} must be between one cell ({CELL}) and the image ({IMAGE_SIZE}) pixels")
    left, top = (min(max(at * CELL - (side - CELL) // 2, 0), IMAGE_SIZE - side) for at in (col, row))
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    ImageDraw.Draw(image).rectangle((left, top, left + side - 1, top + side - 1), fill=COLOURS[colour])
    if decoy_share is not None:
        named = PRIOR_COLOURS[tag] if prior_rate is not None and kind == "vision" else colour
        decoy = named if prior_decoy and named != colour else rng.choice([c for c in COLOURS if c != colour])
        overpaint(image, (left, top, side), decoy, rng.uniform(*decoy_share), random.Random(rng.getrandbits(32)))
    if kind == "vision":
        question, answer = VISION_QUESTION if prior_rate is None else PRIOR_QUESTION.format(tag=tag), colour
    elif kind == "text":
        answer = rng.choice(list(COLOURS))  # independent of the image's square: a distractor
        question = TEXT_QUESTION.format(colour=answer)
    else:
        raise ValueError(f"kind={kind!r} is not a testbed question kind; allowed: 'vision', 'text'")
    text = f"{question} {BOXED_INSTRUCTION if boxed else ANSWER_INSTRUCTION}"
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return {
        "prompt": prompt,
        "image": image,
        "answer": answer,
        "kind": kind,
        "vision_dependent": kind == "vision",
        "target": boxed_text(answer) if boxed else answer_text(answer),
        SQUARE_UNITS: square_units(image, background),
    }


def square_units(image: Image.Image, background: tuple[int, int, int] = BLACK) -> list[int]:
    """The patch units of the testbed's processor (Qwen2-VL: ``pixel_values`` rows, the 14 px patches in 2x2 merge
    blocks) that hold any pixel other than ``background``: the square, and any decoy paint, which lies inside it.
    Every other unit is plain background, which carries no task information; ``PAPOGConfig.mask_excluded_column`` names
    this column for a placebo mask that never covers the square. The order is pinned against the real
    processor by tests/test_masking.py."""
    raw = bytearray(image.convert("RGB").tobytes())
    pixels = torch.frombuffer(raw, dtype=torch.uint8).reshape(GRID, CELL, GRID, CELL, 3)
    shown = (pixels.int() - torch.tensor(background)).abs().amax(dim=(1, 3, 4)) > 0  # cells off the background
    blocks = GRID // MERGE
    return sorted(
        ((row // MERGE) * blocks + col // MERGE) * MERGE * MERGE + (row % MERGE) * MERGE + col % MERGE
        for row, col in shown.nonzero().tolist()
    )


def overpaint(image: Image.Image, square: tuple[int, int, int], colour: str, share: float, rng: random.Random):
    """Paint ``share`` of the pixels of ``square`` (left, top, side), picked at random, in ``colour``: where the
    share passes one half, the square's majority colour is no longer its answer, so no reader is always right."""
    left, top, side = square
    for pixel in rng.sample(range(side * side), round(share * side * side)):
        image.putpixel((left + pixel % side, top + pixel // side), COLOURS[colour])


def majority_colour(image: Image.Image) -> str | None:
    """The task colour most of the image's pixels show (None: none, an all-black image)."""
    counts = dict.fromkeys(COLOURS, 0)
    names = {rgb: colour for colour, rgb in COLOURS.items()}
    for count, rgb in image.convert("RGB").getcolors(IMAGE_SIZE * IMAGE_SIZE):
        if rgb in names:
            counts[names[rgb]] += count
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def make_perception_dataset(
    n: int, seed: int = 0, prior_rate: float | None = None, kinds: tuple[str, ...] = KINDS,
    decoy_share: tuple[float, float] | None = None, prior_decoy: bool = True, background: tuple[int, int, int] = BLACK,
) -> datasets.Dataset:  # fmt: skip
    """``n`` items in TRL's conversational VLM format, kinds cycling through ``kinds`` (vision, vision, text);
    deterministic. ``prior_rate``: the language-prior task; ``decoy_share``, ``prior_decoy``, ``background``: as
    ``make_item`` draws them."""
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    rng = random.Random(seed)
    drawn = dict(prior_rate=prior_rate, decoy_share=decoy_share, prior_decoy=prior_decoy, background=background)
    rows = [make_item(rng, kinds[i % len(kinds)], **drawn) for i in range(n)]
    return datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in FEATURES}, features=FEATURES)


def task_datasets(name: str, n_train: int, n_eval: int, seed: int, eval_seed: int):
    """(training, held-out) items of testbed ``name``'s task: with a language prior, training follows it at the
    recipe's ``prior_rate`` and the held-out items break it (rate 0)."""
    recipe = TESTBED_RECIPES[name]
    held_out_rate = None if recipe.prior_rate is None else 0.0
    training = make_perception_dataset(
        n_train, seed, recipe.prior_rate, recipe.kinds, recipe.decoy_share, background=recipe.background
    )
    return training, held_out_items(name, n_eval, eval_seed, held_out_rate)


def held_out_items(name: str, n: int, seed: int, prior_rate: float | None):
    """``n`` held-out items of testbed ``name``'s task (its kinds, its held-out decoys) at ``prior_rate``: 1.0 gives
    items where the prior is right, the in-distribution split beside the prior-breaking one."""
    recipe = TESTBED_RECIPES[name]
    return make_perception_dataset(
        n, seed, prior_rate, recipe.kinds, recipe.decoy_share, recipe.held_out_prior_decoy, recipe.background
    )


def prior_answer(question: str) -> str | None:
    """The colour a prior question's number names ("What colour is square 3?" -> "blue"), None for other text."""
    found = PRIOR_PATTERN.search(question)
    return PRIOR_COLOURS[found.group(1)] if found else None


def make_official_perception_dataset(n: int, seed: int = 0, kind: str = "vision") -> datasets.Dataset:
    """``n`` items of one ``kind`` in the official PAPO schema (``problem`` with its ``<image>`` placeholder,
    ``answer``, ``images``), asking for ``\\boxed{}``: a benchmark the ``shapes_boxed`` testbed can answer."""
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    rng = random.Random(seed)
    items = [make_item(rng, kind, boxed=True) for _ in range(n)]
    return datasets.Dataset.from_dict(
        {
            "problem": ["<image>" + it["prompt"][0]["content"][1]["text"] for it in items],
            "answer": [it["answer"] for it in items],
            "images": [[it["image"]] for it in items],
        },
        features=datasets.Features(
            {"problem": datasets.Value("string"), "answer": datasets.Value("string"), "images": [datasets.Image()]}
        ),
    )


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def boxed_text(answer: str) -> str:
    return f"\\boxed{{{answer}}}"


def testbed_name(model_name_or_path: str) -> str | None:
    """``"shapes"`` for ``"testbed:shapes"``, None for any other model name; unknown testbeds raise."""
    if not model_name_or_path.startswith(TESTBED_PREFIX):
        return None
    name = model_name_or_path[len(TESTBED_PREFIX) :]
    if name not in TESTBEDS:
        raise ValueError(
            f"model_name_or_path={model_name_or_path!r} names no testbed; allowed: "
            + ", ".join(TESTBED_PREFIX + t for t in TESTBEDS)
        )
    return name


# --------------------------------------------------------------------------------------------
# the supervised warm start
# --------------------------------------------------------------------------------------------


def _sft_batch(processor, items: list[dict]) -> dict[str, torch.Tensor]:
    """Prompt ids from the processor (left-padded, as TRL builds them) followed by the answer ids, like a
    GRPO rollout; labels cover only the answer and its end-of-turn token."""
    tokenizer = processor.tokenizer
    texts = [processor.apply_chat_template(it["prompt"], add_generation_prompt=True, tokenize=False) for it in items]
    batch = processor(text=texts, images=[[it["image"]] for it in items], return_tensors="pt", padding=True)
    answers = [tokenizer(it["target"], add_special_tokens=False)["input_ids"] for it in items]
    answers = [ids + [tokenizer.eos_token_id] for ids in answers]
    width = max(len(ids) for ids in answers)
    completion = torch.full((len(items), width), tokenizer.pad_token_id)
    completion_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, ids in enumerate(answers):
        completion[row, : len(ids)] = torch.tensor(ids)
        completion_mask[row, : len(ids)] = 1
    prompt_len = batch["input_ids"].shape[1]
    batch["input_ids"] = torch.cat([batch["input_ids"], completion], dim=1)
    batch["attention_mask"] = torch.cat([batch["attention_mask"], completion_mask], dim=1)
    # mm_token_type_ids must cover prompt and completion (transformers 5 Qwen2-VL); answers hold no image tokens
    batch["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion)], dim=1)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, prompt_len:] = completion.masked_fill(completion_mask == 0, -100)
    batch["labels"] = labels
    return batch


def warm_start_items(rng: random.Random, step: int, recipe: TestbedRecipe, batch_size: int = SFT_BATCH) -> list[dict]:
    """Warm-start step ``step``'s items, drawn from ``rng``, their squares sized by ``curriculum_side``.

    Items cycle through the recipe's kinds; every ``boxed_every``-th asks for and is taught a ``\\boxed{}`` answer;
    shown vision squares follow the prior at ``warm_start_prior``, and every ``blank_every``-th item, if a vision
    item, shows no square and follows it at ``blank_prior``."""
    items = []
    for n in range(step * batch_size, (step + 1) * batch_size):
        kind = recipe.kinds[n % len(recipe.kinds)]
        blank = bool(recipe.blank_every) and n % recipe.blank_every == recipe.blank_every - 1 and kind == "vision"
        item = make_item(
            rng, kind, boxed=bool(recipe.boxed_every) and n % recipe.boxed_every == recipe.boxed_every - 1,
            prior_rate=recipe.blank_prior if blank else recipe.warm_start_prior, side=curriculum_side(step),
            # the warm start's numbers say nothing, the decoy included: tied to the number, it would teach that the
            # number's colour is the wrong answer
            decoy_share=recipe.decoy_share, prior_decoy=False, background=recipe.background,
        )  # fmt: skip
        if blank:
            item["image"] = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), recipe.background)
        items.append(item)
    return items


def warm_start(
    model, processor, recipe: TestbedRecipe, *, steps: int, seed: int, lr: float = SFT_LR, after_step=None,
    progress=None,
) -> list:  # fmt: skip
    """Cross-entropy on the answer tokens for ``steps`` AdamW steps on fresh items (``warm_start_items``); returns
    the losses. ``after_step(step)``, if given, runs after each optimizer step; a true result stops the pass there.
    ``progress``, if given, is called with each step's loss (a progress bar's update)."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = _sft_batch(processor, warm_start_items(rng, step, recipe))
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(losses[-1])
        if after_step is not None and after_step(step + 1):
            break
    model.eval()
    return losses
