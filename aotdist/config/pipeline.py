"""The ``pipeline`` config section (``aotdist.pipeline``): stages, schedule, micro-batches,
split points, and how many stages each rank holds (interleaved schedules)."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from aotdist.config.validation import Section, did_you_mean

# pipeline.schedule (aotdist.pipelining): torchtitan's names for torch.distributed.pipelining's
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS")
# the schedules that run several stages per rank (torch's PipelineScheduleMulti)
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(Section):
    """Pipeline parallelism (``aotdist.pipeline``): the model split into stages at region
    boundaries, ``stages_per_rank`` of them on each rank of the mesh's ``pp`` dimension,
    run by a schedule of ``torch.distributed.pipelining``; each stage is parallelized as
    ``aotdist.parallelize`` does (Float8, checkpointing, regions, FSDP2 over the other mesh
    dimensions, compile).

    Attributes:
        enabled: Split and pipeline the model (``aotdist.pipeline``; ``parallelize``
            refuses a config with this on).
        degree: Pipeline ranks; ``0``: the mesh's ``pp`` dimension, or every rank without
            a mesh.
        schedule: ``1F1B`` or ``GPipe`` (one stage per rank), ``Interleaved1F1B`` or
            ``LoopedBFS`` (several: rank ``r`` holds stages ``r``, ``r + degree``, ...);
            torchtitan's ``pipeline_parallel_schedule`` names.
        microbatches: Micro-batches per step; they must divide each step's batch.
        split_points: The first module of each stage after the first (torchtitan's
            ``pipeline_parallel_split_points``: ``[layers.4]``), each a region instance or
            a module outside the regions; empty: the region instances split evenly.
        stages_per_rank: Stages (torchtitan's virtual stages) per rank; ``0``: the
            schedule's, 1 for ``1F1B`` and ``GPipe``, 2 for the interleaved ones (as
            torchtitan's default).
    """

    _key: typing.ClassVar[str] = "pipeline"
    enabled: bool = False
    degree: int = 0
    schedule: str = "1F1B"
    microbatches: int = 2
    split_points: tuple[str, ...] = ()
    stages_per_rank: int = 0

    @property
    def local_stages(self) -> int:
        """The stages each rank holds."""
        if self.stages_per_rank:
            return self.stages_per_rank
        return 2 if self.schedule in MULTI_STAGE_SCHEDULES else 1

    def _rule_problems(self) -> list[str]:
        out = []
        if self.schedule not in PIPELINE_SCHEDULES:
            out.append(
                f"pipeline.schedule: unknown schedule {self.schedule!r}"
                f"{did_you_mean(self.schedule, PIPELINE_SCHEDULES)}; use one of "
                f"{list(PIPELINE_SCHEDULES)}"
            )
        if self.degree < 0 or self.degree == 1:
            out.append(
                f"pipeline.degree: must be 0 (the mesh's pp size) or at least 2, got "
                f"{self.degree}. Fix: set it to the number of stages"
            )
        if self.microbatches < 1:
            out.append(f"pipeline.microbatches: must be >= 1, got {self.microbatches}")
        out += self._stages_problems()
        return out

    def _stages_problems(self) -> list[str]:
        multi = self.schedule in MULTI_STAGE_SCHEDULES
        if self.stages_per_rank < 0:
            return [f"pipeline.stages_per_rank: must be >= 0, got {self.stages_per_rank}"]
        if self.stages_per_rank > 1 and not multi and self.schedule in PIPELINE_SCHEDULES:
            return [
                f"pipeline.stages_per_rank: {self.schedule} runs one stage per rank, got "
                f"{self.stages_per_rank}. Fix: pipeline.schedule: Interleaved1F1B (or "
                "LoopedBFS), or stages_per_rank: 1"
            ]
        if self.stages_per_rank == 1 and multi:
            return [
                f"pipeline.stages_per_rank: {self.schedule} interleaves several stages per "
                "rank, got 1. Fix: stages_per_rank: 2 or more, or pipeline.schedule: 1F1B"
            ]
        stages = self.degree * self.local_stages
        if self.split_points and self.degree and len(self.split_points) != stages - 1:
            per = f" x {self.local_stages} per rank" if self.local_stages > 1 else ""
            return [
                f"pipeline.split_points: {len(self.split_points)} split point(s) make "
                f"{len(self.split_points) + 1} stages, but pipeline.degree is "
                f"{self.degree}{per}. Fix: give {stages - 1} split points (stages - 1), "
                "or none (an even split)"
            ]
        return []
