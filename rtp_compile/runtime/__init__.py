"""What runs inside the emitted graphs and around them, executing what the compiler hands it.

The ring: `groups` (process groups, peers, recovery of a broken ring), `packing` (flat
messages, the buffer pool), `ring` (hops as functional custom ops) and `collectives` (ring
all-gather, reduce-scatter, the travelling gradient accumulator). The units' autograd:
`rotated`, `fused`, `gathered`, `small` and `bucket`, with `events` (the schedule they follow),
`precision`, `recompute` (activation checkpoints) and `registry` (how traced custom ops find
their runtime module). Around a step: `job` (the check each forward starts with), `failure`
and `transaction` (a failed step leaves no hop in flight and every `.grad` as it was),
`replicas` (data-parallel replicas of a 2-D mesh), `unshard` (whole weights for the compile
backend) and `launch` (the local multi-process runner).

May import: `core` only."""
