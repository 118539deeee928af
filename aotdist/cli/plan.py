"""``aotdist plan``: per-rank memory and per-step collectives of a job at N ranks,
simulated on this CPU from the compile the job runs (:func:`aotdist.simulate.plan`)."""

from __future__ import annotations

import argparse
import os
import sys

from aotdist.cli import parser as cli
from aotdist.cli.errors import UsageError, import_factory, user_code


def _builder(args: argparse.Namespace):
    """``build() -> (model, inputs)`` for the model the user named, sized as asked."""
    import torch

    def inputs(vocab: int) -> tuple:
        return (torch.randint(0, vocab, (args.batch, args.seq)),)

    if args.hf:
        import transformers

        if os.path.exists(args.hf):  # the model's own config.json (or its directory)
            config = transformers.AutoConfig.from_pretrained(args.hf)
        else:
            config = transformers.AutoConfig.for_model(args.hf)  # its default (real) sizes
        config.use_cache = False  # a training step
        for key, value in args.set or []:
            setattr(config, key, type(getattr(config, key, value))(value))

        def build():
            model = transformers.AutoModelForCausalLM.from_config(config)
            return model, inputs(config.vocab_size)

        return build
    if ":" in args.model:
        factory = import_factory(args.model)

        def build():
            with user_code(args.model):
                out = factory()
            return out if isinstance(out, tuple) else (out, inputs(getattr(out, "vocab", 64)))

        return build
    from aotdist.testing.models import build_model, example_inputs

    def build():
        model = build_model(args.model, depth=args.depth)
        (x,), _ = example_inputs(model, args.batch)
        return model, (x,)

    return build


def _mesh(text: str) -> tuple[int, ...]:
    """``64`` -> ``(64,)`` (every rank shards), ``8x8`` -> ``(8, 8)`` (HSDP)."""
    if text.isdigit() and int(text) >= 1:
        return (int(text),)
    try:
        return cli.mesh(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected SHARDS or REPLICASxSHARDS such as 64 or 8x8, got {text!r}"
        ) from None


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _run(args: argparse.Namespace) -> int:
    from aotdist.config import as_config
    from aotdist.simulate import plan

    config = as_config(args.config).to_dict()  # the job's config; the flags below win
    if args.pp > 1:
        config["pipeline"].update(enabled=True, degree=args.pp)
    if args.microbatches is not None:
        config["pipeline"]["microbatches"] = args.microbatches
    if args.schedule is not None:
        config["pipeline"]["schedule"] = args.schedule
    if args.stages_per_rank is not None:
        config["pipeline"]["stages_per_rank"] = args.stages_per_rank
    stages = config["pipeline"]["degree"] if config["pipeline"]["enabled"] else 1
    # the data-parallel ranks: a stage's, each cp group sharing one sequence
    ranks = args.world // max(stages, 1) // max(args.cp, 1)
    mesh = (max(ranks, 1),) if args.mesh is None else args.mesh
    if args.batch is None:  # one sequence per micro-batch
        args.batch = config["pipeline"]["microbatches"] if stages > 1 else 1
    if args.fsdp_mode is not None:
        config["fsdp"]["mode"] = args.fsdp_mode
    if args.expert_params:
        config["fsdp"]["expert_params"] = args.expert_params
    if args.hf and config["fsdp"]["expert_params"]:
        raise UsageError(
            f"--hf {args.hf} with expert parallelism (fsdp.expert_params): a "
            "transformers model's MoE layers hold every expert on each rank and route "
            "tokens without an all-to-all, so aotdist can only leave their experts whole "
            "on every rank, which is not expert parallelism. Fix: plan your own model whose "
            "experts are sharded over the ranks by an all-to-all dispatch, with --model "
            "module:factory and --expert-params (a worked example: --model "
            "aotdist.testing.moe:deepseek_v3 --expert-params 'model.layers.*.mlp.experts.*'), "
            "or drop --expert-params to plan FSDP over every expert"
        )
    if args.param_dtype is not None:
        config["fsdp"]["param_dtype"] = args.param_dtype
    if args.ac:
        config["ac"]["enabled"] = True
    if args.float8 or args.float8_all_gather:
        config["float8"]["enabled"] = True
    if args.float8_all_gather:
        config["float8"]["fsdp_all_gather"] = True
    result = plan(
        _builder(args),
        world=args.world,
        mesh=mesh,
        config=config,
        optimizer=args.optimizer,
        gpus_per_node=args.gpus_per_node,
        expert_imbalance=args.expert_imbalance,
        cp=args.cp,
        cp_rotate=args.cp_rotate,
    )
    print(result.to_json() if args.json else result.table())
    budget = int(args.gpu_memory * 2**30)
    if result.peak_bytes > budget:
        more = 2 * mesh[-1]  # the shard group doubled
        levers = [
            f"shard over more ranks (a shard group of {more}: --mesh "
            f"{max(ranks // more, 1)}x{more}, or --mesh {ranks} without HSDP)"
            if more <= ranks
            else "more ranks (--world)"
        ]
        if args.cp > 1:
            levers.append(f"a larger --cp ({2 * args.cp}, if it divides --world and --seq)")
        levers += [
            flag
            for flag, on in (
                ("--ac", config["ac"]["enabled"]),
                ("--param-dtype bfloat16", config["fsdp"]["param_dtype"]),
            )
            if not on
        ]
        print(
            f"aotdist plan: does not fit: the peak estimate "
            f"{result.peak_bytes / 2**30:.1f} GiB per rank is over --gpu-memory "
            f"{args.gpu_memory:g} GiB. Fix: {', '.join(levers)}, or a smaller --batch or "
            "--seq.",
            file=sys.stderr,
        )
        return 1
    return 0


def register(sub) -> None:
    """Adds ``plan`` to the subcommands."""
    from aotdist.config.pipeline import PIPELINE_SCHEDULES
    from aotdist.simulate import OPTIMIZER_STATES, ROTATES

    p = cli.add_command(
        sub,
        "plan",
        summary="memory and collectives per rank at N ranks, simulated from the compile",
        description="Traces one training step "
        "of the job at --world ranks on this CPU (fake tensors, torch's fake "
        "process group, no weights) and prints per rank: parameter, gradient, "
        "optimizer and saved-activation bytes, a peak estimate, and per step "
        "the collectives by mesh dimension; with --expert-params, each rank's "
        "experts and the all-to-alls, under balanced routing; with --cp, "
        "torch's ring-attention transfers.",
    )
    p.add_argument("--model", default="gpt", help="gpt, vit or module:factory")
    p.add_argument("--depth", type=int, default=4, help="blocks of a built-in model")
    p.add_argument(
        "--hf",
        metavar="MODEL_TYPE|CONFIG",
        help="a transformers model type at "
        "its config's default sizes (llama: 7B), or a model's config.json (or its "
        "directory); built without weights",
    )
    p.add_argument(
        "--set",
        type=_key_value,
        action="append",
        metavar="KEY=VALUE",
        help="override a --hf config field (num_hidden_layers=80)",
    )
    p.add_argument("--world", type=int, required=True, help="ranks")
    p.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        metavar="[REPLICASx]SHARDS",
        help="8x8: HSDP, 8 replicas of 8 shards; 64: every rank shards (default)",
    )
    p.add_argument(
        "--config",
        metavar="YAML",
        help="the job's aotdist config (configs/aotdist/*.yaml); the flags below override it",
    )
    p.add_argument(
        "--fsdp-mode",
        choices=cli.fsdp_modes(),
        default=None,
        help="fsdp.mode (default: the config's)",
    )
    p.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="fsdp.param_dtype: mixed precision, the dtype weights are gathered in",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="STAGES",
        help="pipeline stages (aotdist.pipeline; the mesh's first dimension): --world is "
        "STAGES times the --mesh of each stage",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline.microbatches (default: the config's); they divide --batch",
    )
    p.add_argument(
        "--schedule",
        choices=PIPELINE_SCHEDULES,
        default=None,
        help="pipeline.schedule (default: the config's)",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        metavar="V",
        help="pipeline.stages_per_rank: an interleaved schedule's stages on each rank "
        "(default: the config's; 2 for Interleaved1F1B and LoopedBFS)",
    )
    p.add_argument(
        "--expert-params",
        action="append",
        metavar="PATTERN",
        help="expert parallelism (fsdp.expert_params; repeatable): glob patterns of the "
        "parameters of each rank's own experts, which the model's all-to-all dispatch "
        "shards over the ranks; FSDP2 shards the rest. The plan adds each rank's expert "
        "bytes and the all-to-alls per step, forward and backward, assuming balanced "
        "routing (every expert gets the same number of tokens from every rank)",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        metavar="F",
        help="with --expert-params: plan the hottest rank, which receives F times the mean "
        "tokens (F/world of every rank's router choices go to its experts; 1 to --world, "
        "default 1: balanced); its all-to-all bytes and activations",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        metavar="N",
        help="context parallelism: N ranks share each sequence (torch's context_parallel, "
        "the mesh's last dimension; --mesh is then the data-parallel part, times N to "
        "--world). Each rank is traced with --seq/N tokens, FSDP2 shards over dp_shard x "
        "cp, and the plan adds torch's ring-attention transfers per SDPA call",
    )
    p.add_argument(
        "--cp-rotate",
        choices=ROTATES,
        default="allgather",
        help="with --cp: how ring attention passes keys and values (torch's "
        "set_rotate_method): allgather (torch's default) or alltoall",
    )
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (ac.enabled)")
    cli.add_float8(p, help="Float8 training (float8.enabled)")
    p.add_argument(
        "--float8-all-gather",
        action="store_true",
        help="Float8 training with its weights all-gathered in float8 (float8.fsdp_all_gather)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per data-parallel rank and step (default 1; pipelined: one per "
        "micro-batch)",
    )
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (--hf, factory)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="ranks per node: a mesh dimension spanning nodes crosses the network",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        default=80.0,
        metavar="GiB",
        help="memory of one GPU: a peak estimate above it exits 1 with the fix",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_run)
