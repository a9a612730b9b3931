"""One rank of ``tests/test_prefix_sharing_ranks.py``'s torchrun job: ``PAPOGTrainer.train()`` over 2 gloo processes
(DDP) three times in this process from the same seed: prefix sharing on; the plain forward with the same whole-group
shuffle (the reference); TRL's own run (sharing off, its row shuffle). A float64 tiny Qwen-VL with a LoRA adapter,
TRL's default gradient checkpointing, the in-training gamma-zero probe on, two SGD steps of one generation round seen
twice (old and reference log-probs too). Then, FSDP2: one micro-batch's loss and gradient through ``_compute_loss``
on the model sharded by ``fully_shard``, sharing on and off, and the ranks' agreement on a call.

    torchrun --nproc_per_node 2 tests/sharing_worker.py --model FOLDER --out DIR

Each rank writes ``rank{r}.json``: per run the parameters' largest move and digest, each micro-batch's group sizes,
the round's advantages, the probe's evidence, the prefix-sharing flags logged, the forward plan at the end and the
plan lines this rank logged; the largest difference between the shared and the reference parameters; the FSDP2
numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peft import get_peft_model  # noqa: E402
from tiny_trainers import unit_params  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from papo_nb.papo import PAPOGConfig, PAPOGTrainer  # noqa: E402
from papo_nb.prefix_sharing import ranks  # noqa: E402
from papo_nb.prefix_sharing import sharing as prefix_sharing  # noqa: E402
from papo_nb.prefix_sharing.prompt_identity import group_samples  # noqa: E402
from papo_nb.testbed.models import load_vlm, vision_special_token_ids  # noqa: E402
from papo_nb.testbed.rewards import accuracy_reward, format_reward  # noqa: E402
from papo_nb.testbed.shapes import make_shapes_dataset  # noqa: E402
from papo_nb.workbook.training.builder import lora_config  # noqa: E402

GENERATIONS = 4


class Recording(PAPOGTrainer):
    """The trainer under test, recording each round's advantages and each micro-batch's prompt-group sizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.advantages, self.group_sizes = [], []

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.advantages.append(batch["advantages"].tolist())
        return batch

    def _prepare_inputs(self, generation_batch):
        batch = super()._prepare_inputs(generation_batch)
        if self.model.training:
            self.group_sizes.append(sorted(len(group) for group in group_samples(batch)))
        return batch


class PlainWholeGroups(Recording):
    """The reference: the whole-group shuffle of prefix sharing, TRL's plain forward."""

    def _logps_and_entropies(self, *args, **kwargs):
        return GRPOTrainer._get_per_token_logps_and_entropies(self, *args, **kwargs)


class TrlShuffle(Recording):
    """TRL's own run (prefix sharing off): its row-by-row shuffle of each rank's round."""


class PlanLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(trainer_cls, folder: str, out: Path, sharing=True) -> dict:
    model, processor = load_vlm(folder)
    torch.manual_seed(0)
    model = get_peft_model(model.to(torch.float64), lora_config(unit_params()))
    args = config(out, processor, sharing)
    assert args.gradient_checkpointing, "TRL's default"
    handler = PlanLines()
    logging.getLogger("papo_nb.papo").addHandler(handler)
    logging.getLogger("papo_nb.papo").setLevel(logging.INFO)
    trainer = trainer_cls(model=model, processing_class=processor, reward_funcs=[accuracy_reward, format_reward],
                          args=args, train_dataset=make_shapes_dataset(24, seed=0))  # fmt: skip
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    logging.getLogger("papo_nb.papo").removeHandler(handler)
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    flags = [h[prefix_sharing.METRIC] for h in trainer.state.log_history if prefix_sharing.METRIC in h]
    evidence = trainer.probe.evidence.to_dict() if trainer.probe.evidence is not None else None
    return dict(
        after=after,
        moved=max((after[n] - start[n]).abs().max().item() for n in start),
        digest=sum(p.double().sum().item() for p in after.values()),
        group_sizes=trainer.group_sizes,
        advantages=trainer.advantages,
        probe=evidence,
        shared_flags=flags,
        plan=trainer.forward_plan.describe(),
        log_prob_forward=trainer.forward_plan.log_prob_forward,
        plan_lines=[line for line in handler.lines if "forward plan" in line or "prefix sharing" in line],
        processes=trainer.accelerator.num_processes,
        distributed_type=trainer.accelerator.distributed_type.value,
    )


def config(out: Path, processor, sharing=True, **overrides) -> PAPOGConfig:
    fields = dict(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", prefix_sharing=sharing,
        num_generations=GENERATIONS, per_device_train_batch_size=GENERATIONS, gradient_accumulation_steps=2,
        steps_per_generation=2, num_iterations=2, beta=0.01, max_steps=2, logging_steps=1, optim="sgd",
        learning_rate=0.05, max_completion_length=8, require_gpu_contract_probe=True,
        generation_kwargs={"suppress_tokens": vision_special_token_ids(processor)},
    )  # fmt: skip
    return PAPOGConfig(**{**fields, **overrides})


def under_fsdp2(folder: str, out: Path) -> dict:
    """One micro-batch's loss and gradient through the trainer's ``_compute_loss`` on the LoRA model sharded by
    FSDP2's ``fully_shard`` (per block, then the root), prefix sharing on and then off (this rank's gradient shards
    compared), after one generation round made unsharded."""
    from papo_nb.prefix_sharing.fsdp import local_piece
    from papo_nb.train.distributed import fully_shard_blocks

    model, processor = load_vlm(folder)
    torch.manual_seed(0)
    model = get_peft_model(model.to(torch.float64), lora_config(unit_params()))
    trainer = Recording(model=model, processing_class=processor, reward_funcs=[accuracy_reward, format_reward],
                        args=config(out, processor, require_gpu_contract_probe=False),
                        train_dataset=make_shapes_dataset(24, seed=0))  # fmt: skip
    model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    blocks = fully_shard_blocks(model)
    results = {}
    for name, enabled in (("shared", True), ("plain", False)):
        trainer.prefix_sharing.enabled = enabled  # the same trainer, batch and shards: its packed path on, then off
        trainer.masks.restart(trainer.args.mask_seed)
        flags = trainer._metrics["train"][prefix_sharing.METRIC]
        before = len(flags)
        loss = trainer._compute_loss(model, batch)
        loss.backward()
        grads = {n: local_piece(p.grad).detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        results[name] = dict(loss=loss.item(), grads=grads, flags=flags[before:])
    shared, plain = results["shared"], results["plain"]
    device = ranks.paired_device(model, dist.get_world_size())
    rank = dist.get_rank()
    return {
        # the ranks' agreement: one rank with a reason of its own, then ranks packing in 1 and 2 chunks
        "agreed_one_plain": ranks.agreed_reason(device, "this rank's reason" if rank == 1 else None, [None]),
        "agreed_chunks": ranks.agreed_reason(device, None, [None] * (rank + 1)),
        "agreed_check": ranks.all_ranks(device, rank == 0),
        "sharded_blocks": blocks,
        "group_sizes": sorted(len(group) for group in group_samples(batch)),
        "loss_difference": abs(shared["loss"] - plain["loss"]),
        "grad_difference": max((shared["grads"][n] - plain["grads"][n]).abs().max().item() for n in plain["grads"]),
        "grad_size": max(g.abs().max().item() for g in plain["grads"].values()),
        "shared_flags": shared["flags"],
        "plan_description": trainer.prefix_sharing.supported_description(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shared = train(Recording, a.model, out / "shared")
    plain = train(PlainWholeGroups, a.model, out / "plain")
    trl = train(TrlShuffle, a.model, out / "trl", sharing=False)
    rank = dist.get_rank()
    difference = max((shared["after"][n] - plain["after"][n]).abs().max().item() for n in shared["after"])
    record = {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(), "difference": difference}
    record["fsdp2"] = under_fsdp2(a.model, out / "fsdp2")
    for name, run in (("shared", shared), ("plain", plain), ("trl", trl)):
        record[name] = {k: v for k, v in run.items() if k != "after"}
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
