"""What the trainer knows of the run's length reaches ``compile.outer: auto``: Lightning's
``Trainer(max_steps=)`` and ``TrainingArguments(max_steps=)`` fill
``compile.expected_steps`` (an explicit value wins; an epoch-bound run leaves it unknown),
a run of at least ``LONG_RUN_STEPS`` steps runs the whole graph lowered and one under
``SHORT_RUN_STEPS`` each region as a frame of its own, which ``metrics`` reports (``outer
inductor``, ``mode frames``; a run between them ``outer fx``)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F

from aotdist import metrics
from aotdist.backends.regional import LONG_RUN_STEPS
from aotdist.testing import build_model

pl = pytest.importorskip("lightning.pytorch")

from aotdist.callbacks import RegionalCompile  # noqa: E402

_SCRATCH = tempfile.TemporaryDirectory(prefix="aotdist-test-runlen-")


class GPT(pl.LightningModule):
    """TinyGPT whose fit stops after ``steps`` optimizer steps, whatever ``max_steps``
    says; records the ``metrics`` of those steps."""

    def __init__(self, steps: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.model = build_model("gpt", depth=2)
        self.steps = steps
        self.window = None
        self.seen = None

    def on_train_start(self):
        self.window = metrics.Tracker(self.model)
        self.window.start()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step >= self.steps:
            self.seen = self.window.stop()
            self.trainer.should_stop = True

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 16), generator=g)
    return torch.utils.data.DataLoader(list(zip(x, x.roll(1, dims=1), strict=True)), batch_size=4)


def _fit(callback: RegionalCompile, steps: int = 1, **trainer_kwargs) -> GPT:
    module = GPT(steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=_SCRATCH.name,
        **trainer_kwargs,
    )
    trainer.fit(module, _loader())
    return module


def _expected_steps(callback) -> int:
    return callback.applied.config.compile.expected_steps


def test_lightning_max_steps_reaches_the_compile_config():
    aot = {"compile": {"backend": "aot_eager"}}
    callback = RegionalCompile(aot)
    _fit(callback, max_steps=20_000)
    assert _expected_steps(callback) == 20_000
    epochs = RegionalCompile(aot)  # max_steps -1: the length is the data's, unknown here
    _fit(epochs, max_epochs=1)
    assert _expected_steps(epochs) == 0
    explicit = RegionalCompile({"compile": {"backend": "aot_eager", "expected_steps": 7}})
    _fit(explicit, max_steps=20_000)
    assert _expected_steps(explicit) == 7


def test_trainer_max_steps_reaches_the_compile_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from aotdist.callbacks import TrainerRegionalCompile

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    callback = TrainerRegionalCompile(backend="aot_eager")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=LONG_RUN_STEPS,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    try:
        transformers.Trainer(
            model=model,
            args=args,
            train_dataset=[{"input_ids": r, "labels": r} for r in ids],
            callbacks=[callback],
        )  # the callback applies aotdist at the Trainer's init
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert _expected_steps(callback) == LONG_RUN_STEPS


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize(
    ("max_steps", "mode", "outer"),
    [(LONG_RUN_STEPS, "graph", "inductor"), (5_000, "graph", "fx"), (100, "frames", "")],
)
def test_the_run_length_chooses_what_compiles(max_steps, mode, outer):
    # Inductor with auto: the long run's graph lowered whole, a middling one's glue left
    # unlowered, a short one's regions compiled as frames of their own, the code between
    # them eager; metrics say which ran
    module = _fit(RegionalCompile(), max_steps=max_steps)
    summary = module.seen.summary()
    assert (str(module.seen.mode), module.seen.outer) == (mode, outer), summary
    assert f"mode {mode}" in summary and (not outer or f"outer {outer}" in summary)
    assert module.seen.regions["GPTBlock"].subgraphs == 1, summary
