"""Does TRL 1.9.1's ``cast_lm_head_to_fp32`` bring the bf16 perception KL within 1e-3 of the fp32 one?

On the tiny Qwen2-VL (its head is untied: ``tie_word_embeddings`` false, as Qwen2.5-VL-7B's; 3B ties them) with a
LoRA adapter on q_proj/v_proj (the head carries no adapter, which TRL requires for the cast), one rollout batch and
one masked image: the mean bounded k3 KL over completion tokens, from the parent's own
``_get_per_token_logps_and_entropies``, in these settings:

    fp32                 fp32 weights (the reference)
    bf16                 bf16 weights
    bf16_cast            bf16 weights, ``cast_lm_head_to_fp32=True`` (TRL casts the head at construction)
    bf16_autocast        fp32 weights under bf16 autocast (mixed precision, ``bf16=True`` on fp32 weights)
    bf16_autocast_cast   the same with the cast: autocast re-casts the head's ``F.linear`` to bf16

    python -m papo_nb.bench.lm_head_precision [--batches 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

SETTINGS = {
    "fp32": dict(dtype="float32", cast=False, autocast=False),
    "bf16": dict(dtype="bfloat16", cast=False, autocast=False),
    "bf16_cast": dict(dtype="bfloat16", cast=True, autocast=False),
    "bf16_autocast": dict(dtype="float32", cast=False, autocast=True),
    "bf16_autocast_cast": dict(dtype="float32", cast=True, autocast=True),
}
TOLERANCE = 1e-3


def _trainer(model_path: Path, work: Path, name: str, dtype: str, cast: bool):
    from peft import get_peft_model

    from papo_nb.papo import PAPOGTrainer
    from papo_nb.testbed.models import load_vlm
    from papo_nb.testbed.shapes import make_shapes_dataset
    from papo_nb.workbook.config.params import WorkbookParams
    from papo_nb.workbook.training.builder import build_trainer, lora_config, papo_config

    params = WorkbookParams(
        model_name_or_path="tiny:qwen2_vl",
        beta=0.0,
        per_device_train_batch_size=8,
        num_generations=4,
        max_steps=1,
        require_gpu_contract_probe=False,
    )
    model, processor = load_vlm(str(model_path), dtype=dtype)
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(params))
    with torch.no_grad():  # a non-zero adapter, the same in every setting
        generator = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    args = papo_config(
        params, work / name, processor, save_strategy="no", cast_lm_head_to_fp32=cast, masked_branch="update",
        prefix_sharing=False,  # the head's precision through TRL's own forward, as measured
    )  # fmt: skip
    return build_trainer(params, args, model, processor, make_shapes_dataset(24, seed=0), trainer_cls=PAPOGTrainer)


def measure(batches: int = 3, cache_dir=None) -> dict:
    from trl import GRPOTrainer

    from papo_nb.papo.logp_inputs import logp_call_arguments
    from papo_nb.papo.terms import bounded_k3
    from papo_nb.testbed.models import build_tiny_vlm
    from papo_nb.workbook.rollouts import rollout_batch

    work = Path(tempfile.mkdtemp(prefix="papo_lm_head_"))
    model_path = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=cache_dir or work / "models")
    reference = _trainer(model_path, work, "reference", "float32", False)
    tied = bool(reference.model.config.tie_word_embeddings)
    inputs = []
    for b in range(batches):
        batch = rollout_batch(reference, reference.train_dataset, 2, start=2 * b, seed=b)
        inputs.append((batch, reference.masked_pixel_values(batch)))
    results = {"tie_word_embeddings": tied, "batches": batches, "kl": {}, "logp_dtype": {}}
    for name, setting in SETTINGS.items():
        trainer = _trainer(model_path, work, name, setting["dtype"], setting["cast"])
        kls = []
        for batch, masked_pixels in inputs:
            positional, vlm = logp_call_arguments(batch)
            dtype = trainer.model.dtype
            vlm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in vlm.items()}
            masked_vlm = {**vlm, "pixel_values": masked_pixels.to(dtype)}
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting["autocast"]):
                logps = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, *positional, **vlm)[0]
                masked = GRPOTrainer._get_per_token_logps_and_entropies(
                    trainer, trainer.model, *positional, **masked_vlm
                )[0]
            mask = batch["completion_mask"].bool()
            kls.append(float(bounded_k3(masked, logps)[mask].double().mean()))
            results["logp_dtype"][name] = str(logps.dtype)
        results["kl"][name] = kls
    ref = results["kl"]["fp32"]
    results["relative_error"] = {
        name: max(abs(a - b) / b for a, b in zip(kls, ref, strict=True)) for name, kls in results["kl"].items()
    }
    results["within_tolerance"] = {name: err <= TOLERANCE for name, err in results["relative_error"].items()}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.batches, args.cache_dir)
    print(f"tie_word_embeddings={results['tie_word_embeddings']}; mean k3 KL per batch, max relative error vs fp32:")
    for name, kls in results["kl"].items():
        err = results["relative_error"][name]
        print(
            f"  {name:20s} {results['logp_dtype'][name]:15s} "
            + " ".join(f"{k:.6e}" for k in kls)
            + f"   max rel. error {err:.2e} ({'within' if err <= TOLERANCE else 'NOT within'} {TOLERANCE:g})"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
