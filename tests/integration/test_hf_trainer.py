"""The Hugging Face ``Trainer`` with ``TrainerRegionalCompile``: a tiny Llama (from its
config, random weights) trains 5 steps on one process with eager's losses, aotdist's
metrics in the Trainer's logs, checkpoints with plain keys that a resumed run continues
from with the same losses, and ``torch_compile=True`` refused with the fix. The LoRA
recipe on 2 processes: DDP, and FSDP2 sharded by aotdist with a checkpoint saved and
resumed, each with eager's losses; TRL's ``SFTTrainer`` recipe under DDP with eager's
losses (TRL's fused LM head runs eager after a graph break in the outer graph)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aotdist.callbacks import TrainerRegionalCompile  # noqa: E402

from aotdist.errors import ConfigError  # noqa: E402
from aotdist.testing import free_port  # noqa: E402

STEPS = 5
VOCAB = 64


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # every Trainer makes an Accelerator: its process-wide state (torch_compile=True sets
    # a dynamo backend in it) must not reach the next test
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _data(n: int = 2 * STEPS):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(out, **kwargs):
    base = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**base, **kwargs})


def _train(out, callbacks, **kwargs):
    trainer = transformers.Trainer(
        model=_model(), args=_args(out, **kwargs), train_dataset=_data(), callbacks=callbacks
    )
    trainer.train()
    return trainer


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_as_eager_and_logs_aotdist_metrics(tmp_path):
    eager = _losses(_train(tmp_path / "eager", []))
    trainer = _train(tmp_path / "aotdist", [TrainerRegionalCompile(backend="aot_eager")])
    assert _losses(trainer) == pytest.approx(eager, rel=1e-6, abs=1e-6), (_losses(trainer), eager)
    first = next(h for h in trainer.state.log_history if "loss" in h)
    assert first["aotdist/graphs"] >= 1 and first["aotdist/compile_seconds"] > 0, first
    assert first["aotdist/LlamaDecoderLayer/call_sites"] == 3, first
    assert first["aotdist/LlamaDecoderLayer/subgraphs"] == 1, first
    keys = set(trainer.model.state_dict())
    assert keys == set(_model().state_dict()), keys ^ set(_model().state_dict())


def test_a_checkpoint_resumes_with_the_same_losses(tmp_path):
    def run(out, resume=None):
        trainer = transformers.Trainer(
            model=_model(),
            args=_args(out, save_strategy="steps", save_steps=2),
            train_dataset=_data(),
            callbacks=[TrainerRegionalCompile(backend="aot_eager")],
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert _losses(resumed)[-3:] == pytest.approx(_losses(full)[-3:], rel=1e-6, abs=1e-6)


def test_torch_compile_true_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="torch_compile=False"):
        transformers.Trainer(
            model=_model(),
            args=_args(tmp_path, torch_compile=True),
            train_dataset=_data(),
            callbacks=[TrainerRegionalCompile(backend="aot_eager")],
        )


def test_float8_and_the_trainers_own_fsdp_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="remove float8 here"):
        TrainerRegionalCompile(config={"float8": {"enabled": True}})
    # (the Trainer itself refuses fsdp on one process: call the hook it would call)
    callback = TrainerRegionalCompile(backend="aot_eager")
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    with pytest.raises(ConfigError, match="fsdp': {'enabled': True}"):
        callback.on_init_end(_args(tmp_path, fsdp="full_shard"), state, control, model=_model())


def _recipe(*args: str, recipe: str = "train_hf_lora.py") -> dict:
    recipe = Path(__file__).parents[2] / "recipes" / recipe
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",  # not 29500: another suite may run beside this one
            str(free_port()),
            str(recipe),
            "--steps",
            str(STEPS),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def eager_ddp() -> dict:
    pytest.importorskip("peft")
    return _recipe("--eager")


@pytest.mark.slow
def test_the_lora_recipe_under_ddp_on_two_processes_matches_eager(eager_ddp):
    compiled = _recipe()
    assert compiled["losses"] == pytest.approx(eager_ddp["losses"], rel=1e-6, abs=1e-6)
    stats = compiled["aotdist"]
    # the first layer inline (torch 2.14+), or its own subgraph (2.11)
    layer = (
        stats["aotdist/LlamaDecoderLayer/call_sites"],
        stats["aotdist/LlamaDecoderLayer/subgraphs"],
    )
    assert layer in ((3, 1), (4, 2)), stats


@pytest.mark.slow
def test_the_lora_recipe_sharded_with_fsdp2_matches_eager_and_resumes(eager_ddp, tmp_path):
    # aotdist shards the PeftModel with FSDP2 inside the Trainer (no DDP wrapper); the
    # Trainer's checkpoints hold the full adapter tensors, and a run resumed from step 2
    # (adapters, Adam's moments, the scheduler) goes on with the same losses
    from safetensors.torch import load_file

    out = str(tmp_path / "run")
    sharded = _recipe("--fsdp", "--out", out, "--save-steps", "2")
    assert sharded["losses"] == pytest.approx(eager_ddp["losses"], rel=1e-6, abs=1e-6)
    assert sharded["aotdist"]["aotdist/LlamaDecoderLayer/call_sites"] == 4, sharded
    saved = load_file(tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors")
    assert saved and all("lora_" in k and "_orig_mod" not in k for k in saved), sorted(saved)
    assert {tuple(v.shape) for k, v in saved.items() if "lora_A" in k} == {(8, 64)}, saved
    optimizer = torch.load(tmp_path / "run" / "checkpoint-2" / "optimizer.pt")
    moments = [s["exp_avg"] for s in optimizer["state"].values()]
    assert moments and all(type(m) is torch.Tensor for m in moments)  # full, not DTensor
    resumed = _recipe(
        "--fsdp", "--out", out, "--resume-from", str(tmp_path / "run" / "checkpoint-2")
    )
    assert resumed["losses"] == pytest.approx(sharded["losses"], rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_trl_sft_with_lora_under_ddp_matches_eager_with_one_subgraph():
    for package in ("trl", "peft", "datasets"):
        pytest.importorskip(package)
    compiled = _recipe(recipe="train_trl_sft.py")
    eager = _recipe("--eager", recipe="train_trl_sft.py")
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6, abs=1e-6)
    stats = compiled["aotdist"]
    assert stats["aotdist/LlamaDecoderLayer/instances"] == 4, stats
    # the first layer inline (torch 2.14+), or its own subgraph (2.11)
    layer = (
        stats["aotdist/LlamaDecoderLayer/call_sites"],
        stats["aotdist/LlamaDecoderLayer/subgraphs"],
    )
    assert layer in ((3, 1), (4, 2)), stats
