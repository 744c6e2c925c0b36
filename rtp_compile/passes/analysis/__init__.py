"""Graph analyses the planning passes ask, which change nothing: `match` (a node seen through
its op rule: the adapters, one per op target and capture level), `chains` (the ops a parameter
passes through before its use) and `cut_axis` (whether a block can be cut along its hidden axis,
and how each of its ops then changes).

May import: `passes.manager`, `core`."""
