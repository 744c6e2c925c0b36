"""Codegen: the rank-generic program becomes one rank's GraphModule (`emit.RankEmitter`):
each marker lowered for the shard the rank holds, the runtime modules of its units attached.

May import: `passes` (the context it reads), `capture`, `runtime`, `core`."""
