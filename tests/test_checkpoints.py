"""latest_checkpoint finds the newest checkpoint holding a policy: a LoRA adapter, or a whole model after full
fine-tuning (one safetensors file or shards with their index), written by the real save_pretrained."""

import pytest
from peft import LoraConfig, get_peft_model

from papo_nb.testbed.models import build_tiny_vlm, load_vlm
from papo_nb.workbook.training.checkpoints import latest_checkpoint


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_vlm("qwen2_vl", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture
def tiny(tiny_folder):
    return load_vlm(tiny_folder)[0]  # a fresh model per test: get_peft_model below changes its model in place


def test_no_checkpoint_is_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint-3").mkdir()  # a save cut short: no weights yet
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.model
def test_full_model_checkpoints_are_found_single_file_and_sharded(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    tiny.save_pretrained(tmp_path / "checkpoint-10", max_shard_size="100KB")
    assert (tmp_path / "checkpoint-10" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "checkpoint-10" / "model.safetensors").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"  # by step, not by name order
    (tmp_path / "checkpoint-12").mkdir()  # newer but empty: passed over
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


@pytest.mark.model
def test_adapter_checkpoints_are_still_found(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "checkpoint-1")
    peft_model = get_peft_model(tiny, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "checkpoint-5")
    assert (tmp_path / "checkpoint-5" / "adapter_model.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"


def resumable_full_model_checkpoint(model, folder, step: int, **save_kwargs):
    """A full fine-tuning checkpoint as the Trainer writes it: weights, optimizer, scheduler, trainer_state last."""
    import json

    import torch

    model.save_pretrained(folder, **save_kwargs)
    torch.save({"state": {}}, folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


@pytest.mark.model
@pytest.mark.parametrize("shards", [False, True])
def test_full_model_checkpoints_can_be_resumed_and_damage_is_named(tiny, tmp_path, shards):
    from papo_nb.train.integrity import checkpoint_problems, find_resume_checkpoint

    save = {"max_shard_size": "100KB"} if shards else {}
    older = resumable_full_model_checkpoint(tiny, tmp_path / "checkpoint-2", 2, **save)
    newer = resumable_full_model_checkpoint(tiny, tmp_path / "checkpoint-4", 4, **save)
    assert checkpoint_problems(newer) == []
    assert find_resume_checkpoint(tmp_path, warn=False) == (newer, [])
    weights = sorted(newer.glob("model*.safetensors"))[-1]
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a save cut short in the middle of the weights
    checkpoint, skipped = find_resume_checkpoint(tmp_path, warn=False)
    assert checkpoint == older and skipped[0][0] == newer
    assert any(f"{weights.name} has {len(data) // 2} bytes where" in problem for problem in skipped[0][1]), skipped
    weights.unlink()
    expected = f"missing {weights.name} (listed in model.safetensors.index.json)" if shards else "missing adapter"
    assert any(expected in problem for problem in checkpoint_problems(newer)), checkpoint_problems(newer)


def test_a_folder_without_any_policy_weights_is_not_resumable(tmp_path):
    from papo_nb.train.integrity import checkpoint_problems

    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "trainer_state.json").write_text('{"global_step": 1}')
    problems = checkpoint_problems(folder)
    assert problems[0] == (
        "missing adapter_model.safetensors (LoRA) or model.safetensors / model.safetensors.index.json"
        " (full fine-tuning)"
    )
