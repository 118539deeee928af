# Launch: python recipes/train_lightning.py fit --config configs/lightning/cpu_fsdp2.yaml
"""A torchvision VisionTransformer on FakeData with Lightning and aotdist's RegionalCompile.

Without ``--config`` it trains with FSDP2 (``ModelParallelStrategy``) on 2 CPU processes,
or on every local GPU when there are any, with regional compile through the
``RegionalCompile`` callback. Lightning starts the other processes itself.

    python recipes/train_lightning.py fit                                   # the defaults
    python recipes/train_lightning.py fit --config configs/lightning/single.yaml
    python recipes/train_lightning.py fit --trainer.max_steps 20 --model.num_layers 8
    python recipes/train_lightning.py fit --print_config                    # every option

Random weights and synthetic data: nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jsonargparse import lazy_instance
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


class ViTClassifier(LightningModule):
    """torchvision's ``VisionTransformer`` (tiny by default) as a classifier."""

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 8,
        num_layers: int = 4,
        num_heads: int = 2,
        hidden_dim: int = 32,
        mlp_dim: int = 64,
        num_classes: int = 10,
        lr: float = 1e-3,
    ):
        super().__init__()
        self.save_hyperparameters()
        from torchvision.models import VisionTransformer

        self.model = VisionTransformer(
            image_size=image_size,
            patch_size=patch_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            mlp_dim=mlp_dim,
            num_classes=num_classes,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class FakeImages(LightningDataModule):
    """``torchvision.datasets.FakeData``: random images and labels, seeded."""

    def __init__(
        self,
        image_size: int = 32,
        num_classes: int = 10,
        train_size: int = 256,
        val_size: int = 64,
        batch_size: int = 16,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()

    def _loader(self, size: int, offset: int, shuffle: bool):
        from torchvision import transforms
        from torchvision.datasets import FakeData

        hp = self.hparams
        data = FakeData(
            size=size,
            image_size=(3, hp.image_size, hp.image_size),
            num_classes=hp.num_classes,
            transform=transforms.ToTensor(),
            random_offset=offset,
        )
        return torch.utils.data.DataLoader(
            data,
            batch_size=hp.batch_size,
            shuffle=shuffle,
            num_workers=hp.num_workers,
            drop_last=True,
        )

    def train_dataloader(self):
        return self._loader(self.hparams.train_size, 0, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.hparams.val_size, 10_000, shuffle=False)


def trainer_defaults() -> dict:
    """FSDP2 on every local GPU, else on 2 CPU processes (regional compile: see CLI)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    gpus = torch.cuda.device_count()
    devices = gpus or 2
    return {
        "accelerator": "gpu" if gpus else "cpu",
        "devices": devices,
        "strategy": lazy_instance(
            ModelParallelStrategy, data_parallel_size=devices, tensor_parallel_size=1
        ),
        "max_steps": 50,
        "log_every_n_steps": 5,
    }


class CLI(LightningCLI):
    """Adds ``RegionalCompile()`` when the config did not configure one."""

    def instantiate_trainer(self, **kwargs):
        from aotdist.callbacks import RegionalCompile

        trainer = super().instantiate_trainer(**kwargs)
        if not any(isinstance(c, RegionalCompile) for c in trainer.callbacks):
            trainer.callbacks.append(RegionalCompile())
        return trainer


def main(args: list[str] | None = None) -> LightningCLI:
    return CLI(
        ViTClassifier,
        FakeImages,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )


if __name__ == "__main__":
    from aotdist.launch import exit_without_teardown

    # Keep the trainer and model alive until the process ends: freeing a DDP model frees
    # its gloo process group with the GIL held, which can hang. Then exit without
    # interpreter teardown, which gloo's worker threads can abort (docs/guide/limits.md).
    cli = main()
    exit_without_teardown()
