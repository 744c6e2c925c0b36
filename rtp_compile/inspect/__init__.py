"""Looking at a program or a run: `draw` (a rank's graph, units coloured), `traces`
(profiled steps as chrome traces) and `timeline` (compute against communication, per rank).

May import: `runtime` and `core`."""
