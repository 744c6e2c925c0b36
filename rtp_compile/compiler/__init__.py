"""The compiler's facade: `transform` (options checked, then capture and the pass
pipeline) and `RTPProgram`, what it returns (rank modules, plan, cost, report, drawing).

May import: every layer below it (`state`, `inspect`, `codegen`, `cost`, `passes`, `capture`,
`runtime`, `core`); nothing of `compile_backend` or `apps`."""
