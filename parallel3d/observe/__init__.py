"""What a run shows of itself: metrics.jsonl, the console, wandb and TensorBoard; what a step measures;
profiler traces and memory snapshots; a run on one screen."""
