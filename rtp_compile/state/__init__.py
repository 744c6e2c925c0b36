"""State of sharded models: DCP checkpoints (`dcp`, with its planners `dcp_planners`),
full state dicts and files read in pieces (`full_state`), the model's own state-dict keys and
hooks (`model_state`), meta-device initialisation (`materialize`, `rank_tensors`), what a rank
module keeps of its program (`program_state`), the record of sharded parameters
(`shard_registry`) and gradient clipping over shards (`clip`).

May import: `runtime` (ring collectives, the job of a module) and `core`."""
