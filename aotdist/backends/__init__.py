"""The ``torch.compile`` backends aotdist compiles with, and what they decide.

- :mod:`aotdist.backends.named`: a backend name or callable -> the backend to wrap.
- :mod:`aotdist.backends.aot`: ``aot_eager`` / ``inductor`` rebuilt on AOTAutograd with
  aotdist's graph repairs (storage resizes, the FSDP pattern) and a hook per graph.
- :mod:`aotdist.backends.recompute`: a joint-graph pass that lets regions recompute what
  they derive from boolean or integer inputs (attention masks) instead of saving it.
- :mod:`aotdist.backends.bucketing`: graph-mode FSDP's collectives merged per graph
  (``fsdp.bucket_mb``), in ``aot_eager``'s graph compilers or as an Inductor post-grad pass.
- :mod:`aotdist.backends.recording`: :class:`RecordingBackend`, which sees every graph
  Dynamo hands over, records region reuse, routes storage-resizing graphs to the repaired
  backend and turns a region's backend failure into ``RegionCaptureError``.
- :mod:`aotdist.compile.guard`: the compiled call that fixes (clones aliasing outputs)
  or demotes a region whose capture failed, reading torch's error to find which.
"""
