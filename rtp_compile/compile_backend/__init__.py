"""The torch.compile backend: `backend` (dynamo's graphs compiled through `transform`),
`sharded_model` (`shard`, full state dicts of a sharded model) and `dynamo_graph` (what the
backend lifts out of dynamo's graph).

May import: `compiler` and everything below it; nothing of `apps`."""
