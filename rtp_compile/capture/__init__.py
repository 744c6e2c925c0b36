"""Capture: a model becomes one flat fx graph (`trace`: torch.fx, or torch.export with
example inputs), with its parameters read by their canonical names and its activation
checkpoints labelled; `activation_checkpoints` outlines those regions again for codegen.

May import: `core`, `runtime` (the recompute region an outlined checkpoint runs in)."""
