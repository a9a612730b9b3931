"""One rank of ``tests/test_sharded.py``'s torchrun jobs: the real PAPOGTrainer on the tiny Qwen2-VL, its LoRA model
sharded with FSDP2 (``fully_shard`` per transformer block, then the root) over gloo.

accelerate 1.15 does not shard on the CPU (its FSDP config runs as MULTI_CPU DDP there; see test_sharded.py), so
this drives ``fully_shard`` directly, with the trainer's own ``papo_loss_parts``, ``_compute_loss`` (the probe
inside), the gamma-zero probe and torch.distributed.checkpoint for the sharded state.

    torchrun --nproc_per_node 2 tests/sharded_worker.py --setup SETUP.pt --out DIR [--steps N --save-every K
        --kill-after S --resume --bf16 --ddp]

``--ddp`` leaves the model unsharded (plain data parallel: the probe all-reduces its gradients to the rank mean)
and stops after the probe.

SETUP.pt (written by the test in one process) holds the model folder, the rollout batch and the adapter's initial
weights, so both ranks and the single-process reference see the same batch and the same adapter. Each rank writes
``rank{r}.json``: the probe evidence (real and leaking assemble), the per-step losses and the final adapter norm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_trainers import tiny_trainer, unit_params  # noqa: E402

from papo_nb.papo import PAPOGTrainer  # noqa: E402
from papo_nb.papo.probe import GammaZeroProbe, ProbeFailure  # noqa: E402
from papo_nb.papo.probe.reduce import local_piece  # noqa: E402
from papo_nb.testbed.models import load_vlm  # noqa: E402
from papo_nb.testbed.shapes import make_shapes_dataset  # noqa: E402
from papo_nb.train.distributed import fully_shard_blocks  # noqa: E402
from papo_nb.workbook.training.builder import lora_config  # noqa: E402

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")


def leaky_assemble(parent_loss, terms, gamma, eta1, eta2):
    """tests/test_probe.py's leak: right value at gamma = 0, but the perception gradient still flows."""
    leak = terms.perception_kl - terms.perception_kl.detach()
    return PAPOGTrainer.assemble_loss(parent_loss, terms, gamma, eta1, eta2) + leak


def build(setup: dict, output_dir: Path, **overrides):
    """The trainer on the setup's model and adapter weights, its masking RNG at the single-process seed."""
    from peft import get_peft_model

    model, processor = load_vlm(setup["model"])
    model = get_peft_model(model, lora_config(unit_params()))
    missing = set(setup["adapter"]) - {n for n, _ in model.named_parameters()}
    assert not missing, missing
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in setup["adapter"]:
                p.copy_(setup["adapter"][name])
    trainer = tiny_trainer(model, processor, make_shapes_dataset(24, seed=0), output_dir, **overrides)
    reset_masks(trainer)
    return trainer


def reset_masks(trainer) -> None:
    """Every rank draws the single-process masks (the trainer seeds mask_seed + rank), so both ranks compute the
    single process's gradient and FSDP's rank mean equals it."""
    trainer.masks.restart(trainer.args.mask_seed)


def probe_once(trainer, batch, assemble=None) -> dict:
    model = trainer.model
    parent, terms = trainer.papo_loss_parts(model, batch)
    probe = GammaZeroProbe()
    with contextlib.suppress(ProbeFailure):  # the evidence holds the failed verdict
        probe.observe(trainer, model, parent, terms, assemble=assemble)
    return probe.evidence.to_dict()


def adapter_norm(model) -> float:
    """The 2-norm of the whole (gathered) trainable adapter: equal on every rank."""
    from papo_nb.papo.probe.reduce import global_norms, local_piece

    pieces = [local_piece(p.detach()).reshape(-1).double() for p in model.parameters() if p.requires_grad]
    return global_norms([torch.cat(pieces)])[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--probe", action="store_true", help="run the probe (real and leaking) before training")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--kill-after", type=int, default=0, help="rank 0 SIGKILLs itself after this step")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="FSDP mixed precision: bf16 compute, fp32 reduce")
    parser.add_argument("--ddp", action="store_true", help="no sharding: plain data parallel (the probe all-reduces)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = torch.load(a.setup, weights_only=False)
    trainer = build(setup, out / "trainer", require_gpu_contract_probe=a.steps > 0)
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    assert dist.is_initialized() and world == dist.get_world_size() == 2, (world, dist.is_initialized())
    model = trainer.model
    options = {}
    if a.bf16:  # what fsdp.yaml's mixed_precision: bf16 asks of FSDP2 (accelerate's default reduce dtype is fp32)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [] if a.ddp else fully_shard_blocks(model, **options)
    model.train()
    batch = setup["batch"]
    record = {"rank": rank, "world": world, "sharded_blocks": blocks, "backend": dist.get_backend()}
    if a.probe:
        # a gradient being accumulated (a micro-batch before this one) must come out of the probe untouched
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.grad = torch.full_like(p, 0.25)
        record["probe"] = probe_once(trainer, batch)
        record["accumulated_grads_kept"] = all(
            torch.equal(local_piece(p.grad), torch.full_like(local_piece(p), 0.25)) for p in trainable
        )
        for p in trainable:
            p.grad = None
        reset_masks(trainer)
        record["leaky_probe"] = probe_once(trainer, batch, leaky_assemble)
        reset_masks(trainer)
        # one rank text-only, the other with images: refused on every rank (the vision all-gathers would not pair)
        if a.ddp:  # nothing is gathered without sharding
            (out / f"probe-rank{rank}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
            dist.barrier()
            dist.destroy_process_group()
            return
        text_only = {k: v for k, v in batch.items() if k not in IMAGE_KEYS}
        text_only["prompt_ids"], text_only["prompt_mask"] = batch["prompt_ids"][:, -4:], batch["prompt_mask"][:, -4:]
        try:
            trainer.papo_loss_parts(model, text_only if rank == 1 else batch)
            record["mixed_batch_error"] = None
        except RuntimeError as exc:
            record["mixed_batch_error"] = str(exc)
        reset_masks(trainer)
        (out / f"probe-rank{rank}.json").write_text(json.dumps(record, indent=1, sort_keys=True))

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    start, losses = 0, {}
    folder = out / "checkpoints"
    torch.manual_seed(trainer.args.seed + rank)  # LoRA dropout draws from it: saved and restored with the shards
    if a.resume:
        start = max(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / "done").is_file())
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder / f"step-{start}"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng = torch.load(folder / f"step-{start}" / f"rng_{rank}.pt")
        trainer.mask_generator.set_state(rng["mask"])
        torch.set_rng_state(rng["torch"])
        trainer.probe = None  # it passed before the checkpoint
        record["resumed_from"] = start
    for step in range(start + 1, a.steps + 1):
        # what Trainer.train and GRPOTrainer.training_step advance: gamma's schedule and the mask round (_step)
        trainer.state.global_step = trainer._step = step - 1
        loss = trainer._compute_loss(model, batch)  # the probe runs inside, on the first step, as in training
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step == 1 and trainer.probe is not None:  # the probe's verdict inside a sharded training step
            (out / f"train-probe-rank{rank}.json").write_text(json.dumps(trainer.probe.evidence.to_dict()))
        if a.save_every and step % a.save_every == 0:
            path = folder / f"step-{step}"
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
            torch.save(
                {"mask": trainer.mask_generator.get_state(), "torch": torch.get_rng_state()}, path / f"rng_{rank}.pt"
            )
            dist.barrier()
            if rank == 0:
                (path / "done").write_text(str(step))
        if rank == 0:
            print(f"sharded step {step}/{a.steps} loss {loss.item()!r}", flush=True)
        if step == a.kill_after and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    if trainer.probe is not None and trainer.probe.evidence is not None:
        record["training_probe"] = trainer.probe.evidence.to_dict()
    record["losses"] = losses
    if a.steps:
        record["adapter_norm"] = adapter_norm(model)
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
