"""The checks of a valid params set that need this machine (local paths, CUDA devices, known testbeds and tiny
families) and the batch arithmetic TRL would refuse later: run before any notebook or training starts, apart from
the schema (params.py) so that a GPU params file still validates on a laptop."""

from __future__ import annotations

from pathlib import Path

from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.config.vllm_params import vllm_problems

# Every `tiny:<family>` name, spelled out so these checks need not import the model classes; tests/test_families.py
# keeps it equal to papo_nb.testbed.models.TINY_FAMILIES.
TINY_FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "idefics3",
    "idefics3_tiled",
    "smolvlm",
    "smolvlm_tiled",
    "gemma3",
    "gemma4",
    "lfm2_vl",
    "lfm2_vl_tiled",
    "llava",
    "mistral3",
    "llava_next",
    "llava_onevision",
)


def _looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or Path(value).expanduser().exists()


def preflight_problems(params: WorkbookParams, root: Path | None = None) -> list[str]:
    """Checks that need this machine (paths, CUDA), run before any notebook starts; schema checks are separate
    so that a GPU params file still validates on a laptop. ``root``: the project folder a relative
    ``accelerate_config`` is looked up in after the cwd, as the launcher does."""
    from papo_nb.workbook.recipe.check import parameter_problems
    from papo_nb.workbook.training.rewards import reward_import_problems

    # One pass of the preflight's parameter checks (papo_nb.workbook.recipe.check): the batches TRL would refuse
    # and, on device cuda, the memory forecast with the plan that makes the run fit, before any weight loads.
    problems = _model_name_problems(params) + _path_problems(params) + parameter_problems(params, root)
    problems += _device_problems(params) + reward_import_problems(params) + vllm_problems(params)
    return problems


def _model_name_problems(params: WorkbookParams) -> list[str]:
    """Unknown testbeds (model or dataset) and unknown tiny families."""
    from papo_nb.testbed.perception import TESTBED_PREFIX, TESTBEDS

    problems = []
    model = params.model_name_or_path
    for key in ("model_name_or_path", "dataset"):
        value = getattr(params, key)
        if value.startswith(TESTBED_PREFIX) and value[len(TESTBED_PREFIX) :] not in TESTBEDS:
            problems.append(
                f"parameter {key!r} = {value!r}: unknown testbed; allowed: "
                + ", ".join(TESTBED_PREFIX + t for t in TESTBEDS)
            )
    if model.startswith("tiny:") and model[len("tiny:") :] not in TINY_FAMILIES:
        problems.append(
            f"parameter 'model_name_or_path' = {model!r}: unknown tiny family; allowed: "
            + ", ".join(f"tiny:{f}" for f in TINY_FAMILIES)
            + ", a hub id or a local folder"
        )
    return problems


def _path_problems(params: WorkbookParams) -> list[str]:
    """Local paths that do not exist (a value that does not look local may be a hub id)."""
    problems = []
    for key in (
        "model_name_or_path",
        "dataset",
        "init_adapter",
        "phase2_checkpoint",
        "upstream_wheel",
        "accelerate_config",
    ):
        value = getattr(params, key)
        if (
            value
            and value != "synthetic"
            and not value.startswith("tiny:")
            and _looks_local(value)
            and not Path(value).expanduser().exists()
        ):
            problems.append(
                f"parameter {key!r} = {value!r}: no such file or folder; allowed: an existing local path"
                + (" or a hub id" if key in ("model_name_or_path", "dataset") else "")
                + ", or ''"
            )
    return problems


def _device_problems(params: WorkbookParams) -> list[str]:
    """``device = 'cuda'`` without CUDA, or more processes than CUDA devices."""
    if params.device != "cuda":
        return []
    import torch

    if not torch.cuda.is_available():
        return ["parameter 'device' = 'cuda': no CUDA device on this machine; allowed here: 'auto' or 'cpu'"]
    if params.num_processes > torch.cuda.device_count():
        return [
            f"parameter 'num_processes' = {params.num_processes}: only {torch.cuda.device_count()} CUDA "
            f"device(s) on this machine; allowed here: 1..{torch.cuda.device_count()}"
        ]
    return []
