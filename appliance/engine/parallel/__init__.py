"""Tensor parallelism across the GPUs of one host (Megatron-style, as gpt-fast applies it).

The model file stays single-device math; this package applies parallelism afterwards:
- `sharding`: which slice of each weight a rank holds, and the module surgery (fewer heads per
  rank, all-reduces after the row-parallel projections, a vocab-parallel embedding and lm_head,
  a mixture of experts' experts split whole across the ranks);
- `step_broadcast`: how rank 0 (the engine's process) tells the other ranks what to run;
- `worker`: the loop a worker process runs, one per extra device;
- `group`: starting, watching and stopping the worker processes.
"""
