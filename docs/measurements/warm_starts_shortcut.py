"""The controls page's whole design on more than one warm start (issue 41, item 3): ``params/study_controls.yaml``
(40 steps, LoRA, 5 seeds, the same held-out set) on fresh builds of ``testbed:shapes_shortcut`` from other build
seeds, beside the page's own runs on the pinned seed-0 build.

    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/warm_starts_shortcut.py train BUILD OUT [PARAMS]
    .venv/bin/python docs/measurements/warm_starts_shortcut.py page OUT [OUT ...]
    .venv/bin/python docs/measurements/warm_starts_shortcut.py full-page OUT [OUT ...]


``full-page`` writes the ``OUT``s trained with ``params/study_controls_full.yaml`` (full fine-tuning) as
``docs/study/shortcut_controls_full/``.

``train`` builds the warm start of build seed ``BUILD`` (``papo_nb.testbed.policy.build_testbed``: a build that misses
its card's goal raises) and runs notebook 04's calibrated study on it (``papo_nb.workbook.study.arms.run_study``: the
warm start scored before RL, the collapse check on the search seed, PAPO-G at the recipe's gamma and at half the
collapse gamma, GRPO held back by beta and by the learning rate, each matched on this warm start's search seed), then
the placebo arms as ``docs/measurements/placebo_shortcut.py`` trains them on the seed-0 page: the placebo at the
strongest PAPO-G gamma, and at the gamma that matches its starting perception KL to PAPO-G's on this warm start, with
PAPO-G under the placebo's fill at that gamma. ``OUT/results.json`` holds the warm start (its card with the weights'
SHA-256, start scores, collapse gamma, control searches) and every run. ``page`` pools those builds with the page's
seed-0 runs into ``docs/study/shortcut_warm_starts/`` (``papo_nb.workbook.study.warm_starts``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROLS_PAGE = ROOT / "docs" / "study" / "shortcut_controls_lora"
PAGE = ROOT / "docs" / "study" / "shortcut_warm_starts"
FULL_PAGE = ROOT / "docs" / "study" / "shortcut_controls_full"
PARAMS = "params/study_controls.yaml"
TESTBED = "shapes_shortcut"
PAPO_ARM = "papo_g_half"


def train(build: int, out: Path, params_file: str = PARAMS) -> None:
    from papo_nb.testbed.policy import build_testbed, pinned_testbed
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study import placebo
    from papo_nb.workbook.study.warm_start_runs import train_warm_start

    # build 0: the shipped (pinned) weights every page of this testbed ran; another build seed: a fresh build
    folder = pinned_testbed(TESTBED) if build == 0 else build_testbed(TESTBED, seed=build)
    params = load_params(ROOT / params_file, [] if build == 0 else [f"model_name_or_path={folder}"])
    placebos = (placebo.PLACEBO, placebo.PLACEBO_KL_MATCHED, placebo.MEAN_FILL_KL_MATCHED)
    train_warm_start(
        params, params_file, build, folder, out, PAPO_ARM, placebos, f"warm-start-{build}-shortcut-controls"
    )


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        train(int(rest[0]), Path(rest[1]), *rest[2:])
    elif command in ("page", "full-page"):
        from papo_nb.workbook.study.warm_starts import write_page

        if command == "page":
            write_page(PAGE, [Path(p) for p in rest], CONTROLS_PAGE)
        else:
            write_page(FULL_PAGE, [Path(p) for p in rest])
    else:
        raise SystemExit(f"command={command!r} is unknown; allowed: train, page, full-page")
