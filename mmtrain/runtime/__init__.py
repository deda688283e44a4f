"""The shared training runtime: one for every model family (it names none).

launcher.py      `mmtrain train RECIPE` (action: run): preflight, SLURM, run_dir lock, torchrun
                 workers, SIGTERM to them (the CLI actions: mmtrain/actions.py)
torchrun.py      the torchrun command line (the launcher's and auto-tune's trials')
worker.py        the torchrun worker entry (python -m mmtrain.runtime.worker)
training.py      train() in this process: one worker, or the whole job
torchrun.py      the torchrun command line (the launcher's and auto-tune's trials)
run_dir.py       who holds a run_dir; is its run finished
logs.py          log set-up, third-party warnings hidden unless --verbose
preflight.py     what a run will touch, checked before anything is built or written
distributed.py   process groups, megatron parallel state, ParallelContext, seeding
cpu_compat.py    every CPU adaptation of megatron (no-op with CUDA)
trainer.py       the train loop (megatron schedules, DDP, logging, evaluation, checkpoints)
step_metrics.py  a step's numbers over the ranks: counts, loss, per-sample losses, MFU/HFU FLOPs
train_data.py    a step's micro-batches from the family's loader; loader state
row_exchange.py  vision-aware balancing of a step's rows over DP ranks (data.balance)
evaluation.py    periodic evaluation without side effects on training
optimizer.py     the family's parts, freezing, per-part LRs, the optimizer
lr_schedule.py   warmup + cosine / linear / constant
loss.py          per-token loss reduction, per-sample losses
rng.py           every RNG stream as plain tensors
metrics.py       metrics.jsonl (+ TensorBoard), `mmtrain worst-samples`
throughput.py    MFU/HFU, packing and memory numbers for the step logs
checkpoint/      directory layout, model weights, the checkpoint manager
child_processes.py  nothing the training process starts outlives it (even after kill -9)
"""
