"""The compiler's vocabulary, shared by every layer above: the IR (`ir`: markers and node
labels), parameter layouts (`layout`), the op rules that say how each weight-bearing op
computes on a shard (`op_rules`), the graph ops the emitted programs call (`graph_ops`),
subgraph extraction, meta retargeting, user-input checks and plain-text tables.

May import: torch and the standard library only, nothing else of rtp_compile."""
