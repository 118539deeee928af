# Launch: torchrun --nproc_per_node 2 recipes/train_trl_sft.py
"""Supervised fine-tuning of a tiny Llama with TRL's ``SFTTrainer``, a LoRA config and aotdist.

The model and a word-level tokenizer are built from configs (random weights); the data is
synthetic token ids. ``SFTTrainer`` adds the LoRA adapters from ``peft_config``;
``TrainerRegionalCompile`` compiles the decoder layers once. On one process it trains as
is; under ``torchrun`` the Trainer runs DDP (gloo on CPU, NCCL on GPUs). ``--bf16`` turns
on TRL's default bf16 autocast (its rounding differs from eager's as any compile's does).
Rank 0 prints one JSON line at the end: ``{"losses": [...], "aotdist": {...}}``.

    python recipes/train_trl_sft.py --steps 5
    torchrun --nproc_per_node 2 recipes/train_trl_sft.py
    python recipes/train_trl_sft.py --eager                 # the same run without aotdist

Random weights and synthetic data: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

VOCAB = 128  # word-level: w0 .. w125, <pad>, <eos>


def build_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def build_model(layers: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        pad_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,
    )
    return transformers.LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> dict:
    """Trains; returns ``{"losses": [...], "aotdist": {...}}``."""
    return train(argv)[0]


def train(argv: list[str] | None = None) -> tuple[dict, object]:
    """Trains; returns the result and the trainer."""
    import peft
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="aot_eager", help="compile.backend")
    parser.add_argument("--eager", action="store_true", help="train without aotdist")
    parser.add_argument("--bf16", action="store_true", help="TRL's default bf16 autocast")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)

    from aotdist.callbacks import TrainerRegionalCompile

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB - 2, (4 * args.steps * 2, 16), generator=g)
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    callback = None if args.eager else TrainerRegionalCompile(backend=args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
            data_seed=0,
            bf16=args.bf16,
            gradient_checkpointing=args.gradient_checkpointing,
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_backend="gloo" if not torch.cuda.is_available() and world > 1 else None,
        )
        trainer = SFTTrainer(
            model=build_model(args.layers),
            args=config,
            train_dataset=data,
            processing_class=build_tokenizer(),
            peft_config=lora,
            callbacks=[callback] if callback else [],
        )
        trainer.train()
    history = trainer.state.log_history
    result = {
        "losses": [h["loss"] for h in history if "loss" in h],
        "aotdist": {k: v for k, v in history[0].items() if k.startswith("aotdist/")},
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    return result, trainer


if __name__ == "__main__":
    from aotdist.launch import exit_without_teardown

    # Keep the trainer alive until the process ends (freeing a DDP model can hang on
    # gloo), then exit without interpreter teardown (docs/guide/limits.md).
    result, trainer = train()
    exit_without_teardown()
