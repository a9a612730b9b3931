"""The adapter lifts: ``papo/`` without its probe subpackage and ``prefix_sharing/`` (which it builds on), copied as
two sibling folders of a package of the user's (``lifted``) into an environment where ``papo_nb`` cannot be imported,
build a trainer and train one step on a tiny model; asking that copy for the in-training probe fails with a message
that names the missing subpackage and what is allowed instead. ``prefix_sharing/`` copied alone trains TRL's plain
GRPOTrainer with prefix sharing on.

Both run in a fresh interpreter (``python -I``: no PYTHONPATH, no user site) that refuses to import ``papo_nb``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys

    class NoWorkbook:  # the bare environment: the adapter's copy and its four libraries, never papo_nb
        def find_spec(self, name, path=None, target=None):
            if name == "papo_nb" or name.startswith("papo_nb."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: bare environment)", name=name)
            return None

    sys.meta_path.insert(0, NoWorkbook())
    sys.path.insert(0, sys.argv[1])
    import datasets
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration
    from peft import LoraConfig
    from trl import GRPOTrainer

    model_path, data_path, out, mode = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_path)
    processor = AutoProcessor.from_pretrained(model_path)
    fields = dict(
        output_dir=out, max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        learning_rate=1e-3, beta=0.0, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
    )
    if mode == "grpo":  # prefix sharing alone, on TRL's plain GRPOTrainer
        from lifted.prefix_sharing import PrefixSharingConfig, PrefixSharingMixin

        trainer_cls = type("SharedGRPOTrainer", (PrefixSharingMixin, GRPOTrainer), {})
        args = PrefixSharingConfig(**fields, prefix_sharing=True)
    else:
        from lifted.papo import PAPOGConfig, PAPOGTrainer
        from lifted.papo.contract import validate_trl_parent_contract

        validate_trl_parent_contract(GRPOTrainer)
        trainer_cls, args = PAPOGTrainer, PAPOGConfig(**fields, require_gpu_contract_probe=mode == "probe")
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=model, processing_class=processor, args=args, train_dataset=datasets.load_from_disk(data_path),
        reward_funcs=lambda completions, **kw: [float(len(str(c))) for c in completions],
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    assert trainer.state.global_step == 1, trainer.state.global_step
    assert "papo_nb" not in sys.modules and "lifted.papo.probe" not in sys.modules
    assert trainer.prefix_sharing.enabled and trainer.prefix_sharing.reason is None, trainer.prefix_sharing.reason
    print("TRAINED", trainer.state.log_history[-1]["train_loss"])
    """
)


def lifted_copy(root: Path, folders: tuple[str, ...], dataset) -> Path:
    """``root`` holding ``lib/lifted/<folder>`` for each of ``folders`` (``papo/`` without ``probe/``), the
    dataset on disk and the training script."""
    package = root / "lib" / "lifted"
    for folder in folders:
        shutil.copytree(ROOT / "papo_nb" / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(package / "papo" / "probe", ignore_errors=True)
    (package / "__init__.py").write_text("")
    dataset.select(range(4)).save_to_disk(root / "data")
    (root / "train.py").write_text(SCRIPT)
    return root


@pytest.fixture(scope="module")
def bare_copy(tmp_path_factory, tiny_vlm_path, shapes_dataset):
    """``(folder holding papo/ without probe/ and prefix_sharing/, the tiny model)``."""
    return lifted_copy(tmp_path_factory.mktemp("bare"), ("papo", "prefix_sharing"), shapes_dataset), tiny_vlm_path


def run_bare(root: Path, model: Path, mode: str, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-I", str(root / "train.py"), str(root / "lib"), str(model), str(root / "data")]
    return subprocess.run([*command, str(out), mode], capture_output=True, text=True, timeout=600)


@pytest.mark.model
def test_the_adapter_without_its_probe_trains_one_step_in_a_bare_environment(bare_copy, tmp_path):
    root, model = bare_copy
    assert not (root / "lib" / "lifted" / "papo" / "probe").exists()
    result = run_bare(root, model, "no-probe", out=tmp_path / "out")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "TRAINED" in result.stdout


@pytest.mark.model
def test_asking_the_bare_adapter_for_the_probe_fails_clearly(bare_copy, tmp_path):
    root, model = bare_copy
    result = run_bare(root, model, "probe", out=tmp_path / "out")
    assert result.returncode != 0 and "TRAINED" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: PAPOGConfig.require_gpu_contract_probe=True"), last
    assert "lifted.papo.probe is not here" in last and "allowed without it: require_gpu_contract_probe=False" in last


@pytest.mark.model
def test_prefix_sharing_alone_trains_plain_grpo_in_a_bare_environment(tiny_vlm_path, shapes_dataset, tmp_path):
    root = lifted_copy(tmp_path / "bare", ("prefix_sharing",), shapes_dataset)
    assert sorted(p.name for p in (root / "lib" / "lifted").iterdir()) == ["__init__.py", "prefix_sharing"]
    result = run_bare(root, tiny_vlm_path, "grpo", out=tmp_path / "out")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "TRAINED" in result.stdout
