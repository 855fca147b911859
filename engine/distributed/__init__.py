"""Tensor parallelism on torch.distributed (`tp_size > 1`).

- parallel_state.py: the group and its collectives (gloo on CPU, NCCL on CUDA);
- sharding.py: which slice of each weight a rank holds (column / row / vocab parallel);
- step_message.py: what rank 0 broadcasts before each forward;
- launcher.py: the ranks' layout over hosts, spawning and reaping worker processes;
- driver.py: rank 0's side (the Engine's), worker.py: every other rank's loop.
"""
