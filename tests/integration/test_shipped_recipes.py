"""Every shipped recipe with every shipped config trains without an aotdist warning.

A user who starts from the README's commands is never told to change what the project
ships. Each recipe runs in this process at tiny sizes (2 encoder blocks, one step, CPU,
``aot_eager``), as its own entry point with the shipped config, on a one-rank world where
the config shards (``aotdist.testing.one_rank_group``; Lightning starts its own), and any
warning of aotdist's categories fails it. What one process cannot show: HSDP's
replicate dimension (``hsdp.yaml`` runs on a fake world of 2, its collectives empty), the
GPU configs' devices and precision (run on CPU in fp32, their aotdist settings as
shipped), and the ``accelerate launch`` processes (the slow test at the end runs the
README's command; ``configs/accelerate/gpu_*.yaml`` launch on GPUs only).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import aotdist
import aotdist.errors
from aotdist.compile.state import STATE_ATTR
from aotdist.testing import free_port
from aotdist.testing.distributed import fake_world, one_rank_group

pytest.importorskip("torchvision")
ROOT = Path(__file__).resolve().parents[2]
AOTDIST_WARNINGS = tuple(
    c
    for c in vars(aotdist.errors).values()
    if isinstance(c, type) and issubclass(c, Warning) and c.__module__ == "aotdist.errors"
)
TINY_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "num_layers": 2,
    "num_heads": 2,
    "hidden_dim": 32,
    "mlp_dim": 64,
    "num_classes": 10,
}


@contextlib.contextmanager
def _no_aotdist_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, AOTDIST_WARNINGS)
    ]
    assert ours == [], "\n".join(ours)


def _recipe(name: str):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "recipes"))


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    import torch.distributed as dist

    if dist.is_initialized():  # Lightning leaves its process group
        dist.destroy_process_group()


# ---- recipes/train_accelerate.py with each configs/aotdist/*.yaml ------------------------

AOTDIST_CONFIGS = sorted(p.name for p in (ROOT / "configs" / "aotdist").glob("*.yaml"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", AOTDIST_CONFIGS)
def test_accelerate_recipe_with_each_shipped_aotdist_config(config):
    from accelerate.state import AcceleratorState

    path = ROOT / "configs" / "aotdist" / config
    fsdp = yaml.safe_load(path.read_text()).get("fsdp") or {}
    world = (
        fake_world(fsdp.get("replicate_degree", 1))
        if fsdp.get("replicate_degree", 1) > 1
        else one_rank_group()
        if fsdp.get("enabled")
        else contextlib.nullcontext()
    )
    AcceleratorState._reset_state(reset_partial_state=True)
    with world, _no_aotdist_warning():
        losses = _recipe("train_accelerate").main(
            [
                "--aotdist-config",
                str(path),
                "--backend",
                "aot_eager",
                "--steps",
                "1",
                "--num-layers",
                "2",
                "--batch-size",
                "2",
            ]
        )
    assert len(losses) == 1


# ---- recipes/train_lightning.py with its defaults and each configs/lightning/*.yaml ------


def _lightning_args(tmp_path: Path, config: str | None) -> list[str]:
    """The recipe's ``fit`` arguments: the shipped config with aot_eager, one rank, one step
    at tiny sizes (a config for GPUs on CPU, in fp32)."""
    cfg = yaml.safe_load((ROOT / "configs" / "lightning" / config).read_text()) if config else {}
    trainer = cfg.setdefault("trainer", {})
    for cb in trainer.get("callbacks") or []:
        cb.setdefault("init_args", {})["backend"] = "aot_eager"
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and "data_parallel_size" in strategy.get("init_args", {}):
        strategy["init_args"]["data_parallel_size"] = 1
    trainer.update(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    if strategy is None:  # the recipe's default: FSDP2 (ModelParallelStrategy) over the devices
        trainer["strategy"] = {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1},
        }
    if config is None:  # and its RegionalCompile()
        trainer["callbacks"] = [
            {
                "class_path": "aotdist.callbacks.RegionalCompile",
                "init_args": {"backend": "aot_eager"},
            }
        ]
    cfg["model"] = dict(TINY_VIT)
    cfg["data"] = {
        "image_size": 32,
        "num_classes": 10,
        "train_size": 4,
        "val_size": 4,
        "batch_size": 2,
    }
    (tmp_path / "shipped.yaml").write_text(yaml.safe_dump(cfg))
    return ["fit", "--config", str(tmp_path / "shipped.yaml")]


LIGHTNING_CONFIGS = [None, *sorted(p.name for p in (ROOT / "configs" / "lightning").glob("*.yaml"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", LIGHTNING_CONFIGS, ids=lambda c: c or "defaults")
def test_lightning_recipe_with_each_shipped_config(config, tmp_path, monkeypatch):
    from aotdist.callbacks import RegionalCompile

    monkeypatch.chdir(tmp_path)  # LightningCLI writes config.yaml where it runs
    with _no_aotdist_warning():
        cli = _recipe("train_lightning").main(_lightning_args(tmp_path, config))
    assert cli.trainer.global_step == 1
    assert sum(isinstance(c, RegionalCompile) for c in cli.trainer.callbacks) == 1
    state = vars(cli.model.model).get(STATE_ATTR)  # the encoder blocks were the region
    assert state is not None and [r.name for r in state.plan] == ["EncoderBlock"]


# ---- the README's accelerate launch command ---------------------------------------------


@pytest.mark.slow  # two processes through accelerate launch, ~30 s on a 2-core CPU machine
@pytest.mark.timeout(480)
def test_readme_accelerate_launch_recipe_warns_nothing_of_aotdist():
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    cmd = [
        accelerate,
        "launch",
        "--main_process_port",  # not 29500: another suite may run beside this one
        str(free_port()),
        "--config_file",
        "configs/accelerate/cpu_2proc.yaml",
        "recipes/train_accelerate.py",
        "--aotdist-config",
        "configs/aotdist/fsdp2.yaml",
        "--backend",
        "aot_eager",
        "--steps",
        "2",
        "--num-layers",
        "2",
    ]
    with tempfile.TemporaryDirectory() as home:  # Accelerate's default config: none of ours
        env = dict(os.environ, HF_HOME=home)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=450, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert '{"step": 2' in proc.stdout, out[-3000:]
    named = [c.__name__ for c in AOTDIST_WARNINGS if c.__name__ in out]
    assert named == [], out[-3000:]
