"""A model whose experts are per rank (``fsdp.expert_params``) cannot be saved as one full
state dict (it would keep one rank's experts): the Lightning callback and the Hugging Face
Trainer callback refuse a run that would checkpoint, before anything is applied, naming
the fix. (Accelerate's ``save_state`` refusal is tested on 2 ranks in
``tests/distributed/test_expert_parallel.py``.)"""

from __future__ import annotations

import pytest

from aotdist.errors import ConfigError

EXPERTS = {"fsdp": {"enabled": True, "expert_params": ["layers.*.moe.experts.*"]}}


def test_lightning_refuses_checkpointing_per_rank_experts():
    pl = pytest.importorskip("lightning.pytorch")
    from aotdist.callbacks import RegionalCompile

    callback = RegionalCompile(EXPERTS)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False)
    with pytest.raises(ConfigError, match=r"Trainer\(enable_checkpointing=True\) saves") as err:
        callback.setup(trainer, pl.LightningModule(), "fit")
    assert "Fix" in str(err.value)


def test_hf_trainer_refuses_saving_per_rank_experts(tmp_path):
    transformers = pytest.importorskip("transformers")
    from aotdist.callbacks import TrainerRegionalCompile

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="save_strategy='steps'") as err:
        TrainerRegionalCompile(EXPERTS).on_init_end(args, None, None, model=None)
    assert "each rank holds its own experts" in str(err.value)
