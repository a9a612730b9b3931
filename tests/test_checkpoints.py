"""latest_checkpoint finds the newest checkpoint holding a policy: a LoRA adapter, or a whole model after full
fine-tuning (one safetensors file or shards with their index), written by the real save_pretrained."""

import pytest
from peft import LoraConfig, get_peft_model

from papo_nb.testbed.models import build_tiny_vlm, load_vlm
from papo_nb.workbook.checkpoints import latest_checkpoint


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


def test_adapter_checkpoints_are_still_found(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "checkpoint-1")
    peft_model = get_peft_model(tiny, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "checkpoint-5")
    assert (tmp_path / "checkpoint-5" / "adapter_model.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"
