# Launch: torchrun --nproc_per_node 2 recipes/train_hf_lora.py
"""LoRA fine-tuning of a tiny Llama with the Hugging Face ``Trainer`` and aotdist.

The base model is built from its config (random weights) and frozen; peft adds LoRA
adapters to the attention projections; ``TrainerRegionalCompile`` compiles the decoder
layers as one reused subgraph, the first inline (its input, from the frozen embedding,
needs no gradient: aotdist names it in a warning, and it is the cheaper way). On one
process it trains as is; under ``torchrun`` the Trainer runs DDP (gloo on CPU, NCCL on
GPUs), or FSDP2 sharded by aotdist with ``--fsdp``. Rank 0 prints one JSON line at the
end: ``{"losses": [...], "aotdist": {...}}``.

    python recipes/train_hf_lora.py --steps 5
    torchrun --nproc_per_node 2 recipes/train_hf_lora.py --backend aot_eager
    torchrun --nproc_per_node 2 recipes/train_hf_lora.py --fsdp     # FSDP2, sharded by aotdist
    python recipes/train_hf_lora.py --eager                 # the same run without aotdist

Random weights and synthetic data: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def build(layers: int, vocab: int):
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, lora)
    return model


def main(argv: list[str] | None = None) -> dict:
    """Trains; returns ``{"losses": [...], "aotdist": {...}}``."""
    return train(argv)[0]


def train(argv: list[str] | None = None) -> tuple[dict, object]:
    """Trains; returns the result and the Trainer."""
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="aot_eager", help="compile.backend")
    parser.add_argument("--eager", action="store_true", help="train without aotdist")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (aotdist)")
    parser.add_argument("--out", default=None, help="output dir (default: a temporary one)")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume-from", default=None, help="a checkpoint-N folder")
    args = parser.parse_args(argv)
    if args.fsdp and args.eager:
        parser.error("--fsdp shards with aotdist; for eager's losses run --eager alone")

    from aotdist.callbacks import TrainerRegionalCompile

    vocab = 128
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, vocab, (4 * args.steps * 2, 16), generator=g)
    data = [{"input_ids": r, "labels": r} for r in rows]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"compile": {"backend": args.backend}, "fsdp": {"enabled": args.fsdp}}
    callback = None if args.eager else TrainerRegionalCompile(config=config)
    with tempfile.TemporaryDirectory() as tmp:
        targs = transformers.TrainingArguments(
            output_dir=args.out or tmp,
            max_steps=args.steps,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="steps" if args.save_steps else "no",
            save_steps=args.save_steps or 500,
            seed=0,
            data_seed=0,
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_backend="gloo" if not torch.cuda.is_available() and world > 1 else None,
        )
        trainer = transformers.Trainer(
            model=build(args.layers, vocab),
            args=targs,
            train_dataset=data,
            callbacks=[callback] if callback else [],
        )
        trainer.train(resume_from_checkpoint=args.resume_from)
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

    # Keep the Trainer alive until the process ends (freeing a DDP model can hang on
    # gloo), then exit without interpreter teardown (docs/guide/limits.md).
    result, trainer = train()
    exit_without_teardown()
