"""What runs inside the emitted graphs: ring ops, the autograd of units, the local launcher."""
