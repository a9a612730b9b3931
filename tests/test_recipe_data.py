"""Official-schema data: local datasets saved the two ways the loader reads, pixel bounds, format prompt,
several images per row, over-long filtering, and the benchmark loader and summary."""

import json

import datasets
import pytest
from PIL import Image

from papo_nb.testbed.models import build_tiny_processor
from papo_nb.testbed.official_schema import make_official_schema_dataset
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY
from papo_nb.workbook.evaluation import benchmarks as be
from papo_nb.workbook.recipe import data as rd

SMALL, LARGE = 28 * 28 * 4, 28 * 28 * 16  # the tiny recipe's bounds (56x56 .. 112x112)


@pytest.fixture(scope="module")
def official():
    return make_official_schema_dataset(9, seed=3)


@pytest.fixture(scope="module")
def processor():
    p = build_tiny_processor("qwen2_vl")
    rd.set_processor_pixel_bounds(p, SMALL, LARGE)
    return p


def test_local_dataset_has_the_official_columns_and_types(official):
    assert official.column_names == ["problem", "answer", "images"]
    assert official.features["problem"] == datasets.Value("string")
    assert official.features["answer"] == datasets.Value("string")
    assert official.features["images"] == datasets.List(datasets.Image())
    counts = {len(row["images"]) for row in official}
    assert counts == {1, 2}  # several images per row where the data has them
    for row in official:
        assert row["problem"].count("<image>") == len(row["images"])


@pytest.mark.parametrize("how", ["save_to_disk", "parquet", "parquet_folder"])
def test_loader_reads_local_copies_through_datasets(official, tmp_path, how):
    if how == "save_to_disk":
        official.save_to_disk(str(tmp_path / "ds"))
        source = str(tmp_path / "ds")
    elif how == "parquet":
        official.to_parquet(str(tmp_path / "train.parquet"))
        source = str(tmp_path / "train.parquet")
    else:
        (tmp_path / "folder").mkdir()
        official.to_parquet(str(tmp_path / "folder" / "train-00000.parquet"))
        source = str(tmp_path / "folder")
    loaded = rd.load_official_dataset(source)
    assert loaded.column_names == official.column_names
    assert loaded["answer"] == official["answer"]
    assert [len(x) for x in loaded["images"]] == [len(x) for x in official["images"]]


def test_loader_names_the_parameter_on_missing_columns_or_paths(tmp_path):
    datasets.Dataset.from_dict({"prompt": ["q"], "answer": ["1"]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(rd.RecipeDataError, match=r"parameter 'dataset'.*lacks column\(s\) \['problem', 'images'\]"):
        rd.load_official_dataset(str(tmp_path / "bad"))
    with pytest.raises(rd.RecipeDataError, match="parameter 'eval_dataset'.*no such file"):
        rd.load_official_dataset(str(tmp_path / "absent"), parameter="eval_dataset")


def test_pixel_bounds_resize_like_the_official_process_image():
    big = rd.resize_to_pixel_bounds(Image.new("L", (300, 200)), SMALL, LARGE)
    small = rd.resize_to_pixel_bounds(Image.new("RGB", (20, 30)), SMALL, LARGE)
    assert big.mode == "RGB" and big.width * big.height <= LARGE
    assert (big.width, big.height) == (int(300 * (LARGE / 60000) ** 0.5), int(200 * (LARGE / 60000) ** 0.5))
    assert small.width * small.height >= SMALL * 0.95  # int() truncation, as upstream
    middle = Image.new("RGB", (70, 70))
    assert rd.resize_to_pixel_bounds(middle, SMALL, LARGE).size == (70, 70)


def test_processor_bounds_hold_for_the_image_tokens(processor):
    assert rd.processor_pixel_bounds(processor) == (SMALL, LARGE)
    grid = processor.image_processor(images=[Image.new("RGB", (400, 300))], return_tensors="pt")["image_grid_thw"]
    assert int(grid.prod()) * 14 * 14 <= LARGE
    with pytest.raises(rd.RecipeDataError, match="min_pixels"):
        rd.set_processor_pixel_bounds(processor, LARGE, SMALL)


def test_trl_rows_apply_the_format_prompt_and_keep_image_order(official):
    rows = rd.to_trl_rows(official, "math_perception", SMALL, LARGE)
    assert sorted(rows.column_names) == ["answer", "images", "prompt"]
    two = next(r for r in rows if len(r["images"]) == 2)
    parts = two["prompt"][0]["content"]
    assert [p["type"] for p in parts] == ["image", "image", "text"]
    text = parts[-1]["text"]
    assert text.startswith("How many shapes are there in the two figures together?\n\nYou first think")
    assert text.endswith(
        "enclosed within <think> </think> tags. Then, provide your final answer enclosed within \\boxed{}."
    )
    for images in rows["images"]:
        assert all(SMALL * 0.95 <= im.width * im.height <= LARGE for im in images)


def test_format_prompt_from_a_jinja_file(tmp_path):
    path = tmp_path / "p.jinja"
    path.write_text("Q: {{ content | trim }}\nA:\n")
    assert rd.format_template(str(path)).render(content=" 2+2 ") == "Q: 2+2\nA:"
    with pytest.raises(rd.RecipeDataError, match="parameter 'format_prompt'"):
        rd.format_template("no_such_prompt")


def test_placeholder_rules():
    assert [p["type"] for p in rd.user_message("What is shown?", 2)[0]["content"]] == ["image", "image", "text"]
    assert [p["type"] for p in rd.user_message("A <image> then B", 1)[0]["content"]] == ["text", "image", "text"]
    with pytest.raises(rd.RecipeDataError, match="2 '<image>' placeholders but 1 images"):
        rd.user_message("<image><image>x", 1)


def test_overlong_prompts_are_dropped_and_counted(official, processor):
    rows = rd.to_trl_rows(official, "math_perception", SMALL, LARGE)
    lengths = [rd.prompt_length(processor, r) for r in rows]
    one = max(n for n, r in zip(lengths, rows) if len(r["images"]) == 1)
    two = min(n for n, r in zip(lengths, rows) if len(r["images"]) == 2)
    assert one < two  # two figures cost more image tokens, so a limit between them drops exactly those rows
    kept, report = rd.filter_overlong_prompts(rows, processor, one)
    assert report.dropped == 3 and report.kept == 6 and len(kept) == 6
    assert all(len(r["images"]) == 1 for r in kept)
    assert report.longest_kept == one


def test_benchmark_loader_reads_sharegpt_rows_with_image_paths(tmp_path):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (60, 60), "red").save(tmp_path / "images" / "a.png")
    rows = [{"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
             "images": ["a.png"]}]  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps(rows))
    dd = datasets.DatasetDict(
        {"my_bench": datasets.load_dataset("json", data_files=str(tmp_path / "b.json"))["train"]}
    )
    dd.save_to_disk(str(tmp_path / "suite"))
    loaded = be.load_benchmark(str(tmp_path / "suite"), "my_bench", image_dir=str(tmp_path / "images"))
    assert loaded[0]["problem"] == "<image>Colour?" and loaded[0]["answer"] == "red"
    assert loaded[0]["images"][0].size == (60, 60)


def test_benchmark_groups_and_summary():
    assert be.parse_benchmarks(["hiyouga_geometry3k", "x:vision_dependent"]) == {
        "hiyouga_geometry3k": "general",
        "x": "vision_dependent",
    }
    assert sorted(set(be.OFFICIAL_BENCHMARKS.values())) == sorted(be.GROUPS) and len(be.OFFICIAL_BENCHMARKS) == 8
    with pytest.raises(rd.RecipeDataError, match="eval_benchmarks"):
        be.parse_benchmarks(["unknown_split"])
    scores = dict.fromkeys(be.SCORE_KEYS, 0.0)
    per = {"a": {**scores, "avg_at_k": 0.5}, "b": {**scores, "avg_at_k": 0.1}, "c": {**scores, "avg_at_k": 0.3}}
    table = be.summarise(per, {"a": "general", "b": "general", "c": "vision_dependent"})
    by_name = {r["name"]: r for r in table}
    assert by_name["general"]["avg_at_k"] == pytest.approx(0.3)
    assert by_name["vision_dependent"]["avg_at_k"] == pytest.approx(0.3)
    assert by_name["overall"]["avg_at_k"] == pytest.approx(0.3)  # mean over benchmarks, not over groups
    assert be.mlflow_metrics(table)["eval/overall/avg_at_k"] == pytest.approx(0.3)
    # The overall greedy score is also the held-out accuracy every run logs under one name (03, 04's arms, 05).
    per["a"]["greedy"], per["c"]["greedy"] = 0.9, 0.6
    metrics = be.mlflow_metrics(be.summarise(per, {"a": "general", "b": "general", "c": "vision_dependent"}))
    assert metrics[HELDOUT_ACCURACY] == metrics["eval/overall/greedy"] == pytest.approx(0.5)


def test_format_prompt_is_the_official_file_byte_for_byte():
    import hashlib

    text = rd.FORMAT_PROMPTS["math_perception"]
    assert hashlib.sha256(text.encode()).hexdigest() == rd.FORMAT_PROMPT_SHA256


@pytest.mark.slow
def test_hub_ids_go_to_the_hub_through_datasets():
    """A hub id (with @split) reaches datasets.load_dataset for real: offline, datasets itself refuses it by name."""
    import os
    import subprocess
    import sys

    code = (
        "from papo_nb.workbook.recipe.data import load_official_dataset\n"
        "load_official_dataset('PAPOGalaxy/PAPO_ViRL39K_train@train')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "Couldn't reach 'PAPOGalaxy/PAPO_ViRL39K_train' on the Hub" in done.stderr
