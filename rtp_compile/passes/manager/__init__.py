"""The pass manager: `context` (what a compilation carries from pass to pass: options, the
captured model, the plan, unit bodies and schedules) and `pipeline` (runs the passes in order,
checks each one's invariant, records what it changed).

May import: `runtime` (precision, events: what the schedule hands the runtime), `core`."""
