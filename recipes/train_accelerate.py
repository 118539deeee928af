# Launch: accelerate launch --config_file configs/accelerate/cpu_2proc.yaml recipes/train_accelerate.py --aotdist-config configs/aotdist/fsdp2.yaml
"""A torchvision VisionTransformer on FakeData with Accelerate and aotdist.

``aotdist.callbacks.prepare`` applies the aotdist config (FSDP2, Float8, activation
checkpointing, regional compile) and then ``accelerator.prepare``. Gradient accumulation
goes through ``accelerator.accumulate``; ``--save-dir`` writes ``accelerator.save_state``
at the end and ``--resume-from`` loads one before training. Each optimizer step prints
one JSON line on the main process: ``{"step": ..., "loss": ...}`` (loss averaged over
processes).

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml recipes/train_accelerate.py
    python recipes/train_accelerate.py --aotdist-config none            # one process, eager
    python recipes/train_accelerate.py --size vit_b_16 --steps 100      # ViT-B/16 shapes

Random weights and synthetic data: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# the shipped configs: configs/ beside recipes/ in a clone, aotdist/configs when installed
CONFIGS = Path(__file__).resolve().parent.parent / "configs"

SIZES = {  # image, patch, layers, heads, hidden, mlp, classes
    "tiny": (32, 8, 4, 2, 32, 64, 10),
    "vit_b_16": (224, 16, 12, 12, 768, 3072, 1000),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--aotdist-config",
        default=str(CONFIGS / "aotdist" / "regional_compile.yaml"),
        help="aotdist YAML (configs/aotdist/*.yaml), or 'none' for plain eager",
    )
    p.add_argument("--backend", default=None, help="override compile.backend (e.g. aot_eager)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--num-layers", type=int, default=None, help="override the size's depth")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="per process and micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default=None, help="accelerator.save_state here at the end")
    p.add_argument("--resume-from", default=None, help="accelerator.load_state from here")
    p.add_argument(
        "--skip-batches",
        type=int,
        default=0,
        help="batches to skip (resuming mid-run with the same data order)",
    )
    return p.parse_args(argv)


def build_model(size: str, num_layers: int | None, seed: int) -> torch.nn.Module:
    from torchvision.models import VisionTransformer

    image, patch, layers, heads, hidden, mlp, classes = SIZES[size]
    torch.manual_seed(seed)
    return VisionTransformer(
        image_size=image,
        patch_size=patch,
        num_layers=num_layers or layers,
        num_heads=heads,
        hidden_dim=hidden,
        mlp_dim=mlp,
        num_classes=classes,
    )


def build_loader(size: str, batch_size: int, samples: int) -> torch.utils.data.DataLoader:
    from torchvision import transforms
    from torchvision.datasets import FakeData

    image, *_, classes = SIZES[size]
    data = FakeData(
        size=samples,
        image_size=(3, image, image),
        num_classes=classes,
        transform=transforms.ToTensor(),
    )
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, drop_last=True)


def main(argv: list[str] | None = None) -> list[float]:
    """Trains and returns the per-step losses."""
    return train(argv)[0]


def train(argv: list[str] | None = None) -> tuple[list[float], tuple]:
    """Trains; returns the losses and the prepared (accelerator, model, optimizer, loader)."""
    from accelerate import Accelerator
    from accelerate.utils import DynamoBackend
    from aotdist.callbacks import prepare

    args = parse_args(argv)
    # cpu=True without GPUs: several CPU processes (gloo) under the torchrun launcher.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        dynamo_backend=DynamoBackend.NO,
        cpu=not torch.cuda.is_available(),
    )
    model = build_model(args.size, args.num_layers, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    micro_steps = (args.steps + args.skip_batches // args.grad_accum) * args.grad_accum
    loader = build_loader(
        args.size,
        args.batch_size,
        samples=micro_steps * args.batch_size * accelerator.num_processes,
    )
    if args.aotdist_config.lower() == "none":
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        overrides = {"compile": {"backend": args.backend}} if args.backend else {}
        from aotdist import AOTDistConfig

        config = AOTDistConfig.from_yaml(args.aotdist_config)
        config = config.replace(**overrides) if overrides else config
        model, optimizer, loader = prepare(accelerator, model, optimizer, loader, config=config)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
    if args.skip_batches:
        loader = accelerator.skip_first_batches(loader, args.skip_batches)

    losses: list[float] = []
    model.train()
    step_loss = torch.zeros((), device=accelerator.device)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        step_loss += loss.detach() / args.grad_accum
        if accelerator.sync_gradients:
            mean = accelerator.reduce(step_loss, reduction="mean").item()
            losses.append(mean)
            step_loss.zero_()
            if accelerator.is_main_process:
                print(json.dumps({"step": len(losses), "loss": mean}), flush=True)
        if len(losses) == args.steps:
            break
    if args.save_dir:
        accelerator.save_state(args.save_dir)
    accelerator.end_training()
    return losses, (accelerator, model, optimizer, loader)


if __name__ == "__main__":
    from aotdist.launch import exit_without_teardown

    # Keep what trained alive until the process ends: freeing a DDP model frees its gloo
    # process group with the GIL held, which can hang. Then exit without interpreter
    # teardown, which gloo's worker threads can abort (docs/guide/limits.md).
    losses, prepared = train()
    exit_without_teardown()
