"""PAPO-G against a placebo that differs only in where the mask goes (issue 56, item 3), on each warm start of
``testbed:shapes_shortcut_grey``: the shortcut testbed on a grey background, where PAPO-G's own black fill over
background units changes pixels.

    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/placebo_background.py train BUILD OUT
    .venv/bin/python docs/measurements/placebo_background.py page OUT [OUT ...]
    .venv/bin/python docs/measurements/placebo_background.py render

``train`` builds the warm start of build seed ``BUILD`` (0: the pinned weights; another: ``build_testbed``, which
raises on a build that misses its goal) and runs ``params/study_background_placebo.yaml`` on it
(``warm_start_runs.train_warm_start``): the warm start scored before RL, its collapse gamma
searched on seed 100, GRPO and PAPO-G at half that gamma on 5 seeds, then the black-fill background placebo
(``placebo_black``) at PAPO-G's gamma and at the gamma that matches its starting perception KL to PAPO-G's
(``placebo_black_kl_matched``). ``page`` pools the ``OUT``s into ``docs/study/shortcut_grey_placebo/``
(``background_placebo_page.py``); ``render`` rewrites that page from its own data file.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "study" / "shortcut_grey_placebo"
PARAMS = "params/study_background_placebo.yaml"
TESTBED = "shapes_shortcut_grey"
PAPO_ARM = "papo_g_half"


def train(build: int, out: Path) -> None:
    from warm_start_runs import train_warm_start

    from papo_nb.testbed.policy import build_testbed, pinned_testbed
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study import placebo

    folder = pinned_testbed(TESTBED) if build == 0 else build_testbed(TESTBED, seed=build)
    params = load_params(ROOT / PARAMS, [] if build == 0 else [f"model_name_or_path={folder}"])
    placebos = (placebo.PLACEBO_BLACK, placebo.PLACEBO_BLACK_KL_MATCHED)
    train_warm_start(params, PARAMS, build, folder, out, PAPO_ARM, placebos, f"warm-start-{build}-grey-placebo")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        train(int(rest[0]), Path(rest[1]))
    elif command == "page":
        from background_placebo_page import write_page

        print(write_page(PAGE, [Path(p) for p in rest]))
    elif command == "render":
        from background_placebo_page import rerender

        print(rerender(PAGE))
    else:
        raise SystemExit(f"command={command!r} is unknown; allowed: train, page, render")
