"""The feature x model-family matrix: its rows, its columns, and why a cell does not apply.

Pure data (no torch): tests/test_matrix.py runs the cells, docs/make_matrix.py draws the README
table from their results, and a fast test holds the README's table to exactly these rows and
columns.
"""

from __future__ import annotations

from dataclasses import dataclass

MESH = 4  # the 2-D mesh row's launch: 4 processes, a 2 x 2 (dp, rtp) mesh


@dataclass(frozen=True)
class Family:
    """A column: a model of the test zoo through one capture path."""

    id: str
    title: str
    path: str  # "fx": transform without example inputs; "export": with them
    source: str  # "zoo": tests/zoo.py ZOO name; "hf": tests/hf_zoo.py HF_ZOO name
    name: str
    float32_norms: bool = False  # RMSNorm's output rounded to float32 even in a float64 model
    # what else it computes in float32 in a float64 model: exact where both sides run the same
    # eager kernels, float32's accuracy where a compiler's kernels round it their own way
    float32_parts: str = ""

    @property
    def header(self) -> str:
        return f"{self.title} ({self.path})"


@dataclass(frozen=True)
class Feature:
    """A row: one user-facing feature, compared with an independent reference."""

    id: str
    title: str
    sizes: tuple[int, ...]  # world sizes it runs at (MESH: the 2 x 2 mesh launch)
    not_at_3: str = ""  # why it does not run at N = 3, for a row that runs at N = 2 only


FAMILIES = [
    Family("tinygpt-fx", "TinyGPT", "fx", "zoo", "gpt"),
    Family("tinygpt-export", "TinyGPT", "export", "zoo", "gpt"),
    Family("convnet-fx", "ConvNet", "fx", "zoo", "conv"),
    Family("gpt2", "GPT-2", "export", "hf", "gpt2"),
    Family(
        "llama",
        "Llama",
        "export",
        "hf",
        "llama",
        float32_norms=True,
        float32_parts="rotary cos/sin",
    ),
    Family("bert", "BERT", "export", "hf", "bert"),
    Family("opt", "OPT", "export", "hf", "opt"),
    Family("neox", "GPT-NeoX", "export", "hf", "neox", float32_parts="softmax, rotary cos/sin"),
    Family(
        "qwen2",
        "Qwen2",
        "export",
        "hf",
        "qwen2",
        float32_norms=True,
        float32_parts="rotary cos/sin",
    ),
    Family("t5", "T5", "export", "hf", "t5", float32_parts="RMSNorm's variance"),
    Family("vit", "ViT", "export", "hf", "vit"),
    Family(
        "mixtral",
        "Mixtral",
        "export",
        "hf",
        "mixtral",
        float32_norms=True,
        float32_parts="rotary cos/sin",
    ),
    Family("torch_encoder", "nn.TransformerEncoder", "export", "hf", "torch_encoder"),
]

_COMPILES = "compiles every model again per world size (the row's seconds are below the table)"
FEATURES = [
    Feature("plain", "training vs DDP", (2, 3)),
    Feature("full_state_dict", "full_state_dict round trip", (2, 3)),
    Feature("clip", "clip_grad_norm_ vs DDP's", (2, 3)),
    Feature(
        "accumulation",
        "accumulation (2 backward, 1 step) vs DDP",
        (2,),
        "accumulating adds into .grad whatever the shard sizes; uneven shards are the "
        "training row's at N = 3",
    ),
    Feature("checkpoint", "checkpoint save, load; reshard 2 -> 3", (2, 3)),
    Feature("mixed_precision", "mixed precision vs FSDP2 (same policy)", (2, 3)),
    Feature(
        "ac_model",
        "activation checkpointing: the model's switch",
        (2,),
        "the checkpointed regions re-run the training row's units; uneven shards are "
        "that row's at N = 3",
    ),
    Feature(
        "ac_user",
        "activation checkpointing: torch.utils.checkpoint",
        (2,),
        "the checkpointed regions re-run the training row's units; uneven shards are "
        "that row's at N = 3",
    ),
    Feature(
        "backend_a",
        "torch.compile backend, defaults: (a) shard first",
        (2,),
        "the backend plans with the transform the training row checks at N = 3; it " + _COMPILES,
    ),
    Feature(
        "backend_b",
        "torch.compile backend, defaults: (b) optimizer first",
        (2,),
        "the backend plans with the transform the training row checks at N = 3; it " + _COMPILES,
    ),
    Feature(
        "inductor",
        "rank program under torch.compile (inductor)",
        (2,),
        "inductor compiles the program the training row checks at N = 3; it " + _COMPILES,
    ),
    Feature(
        "memory",
        "memory held after a step <= 1.10 x the shards' state",
        (2,),
        "the bound is per rank whatever N; padding at N = 3 is in the training row's shard shapes",
    ),
    Feature("mesh", "2-D mesh (2 x 2) vs DDP over 4 ranks", (MESH,)),
]

# (feature, family) -> why the cell cannot apply
NOT_APPLICABLE = {
    **{
        ("ac_model", f): "no activation-checkpointing switch of its own (transformers' "
        "gradient_checkpointing_enable)"
        for f in ("tinygpt-fx", "tinygpt-export", "convnet-fx", "torch_encoder")
    },
    **{
        (b, "tinygpt-export"): "torch.compile captures with dynamo, not through fx or export: "
        "the TinyGPT (fx) column runs it"
        for b in ("backend_a", "backend_b")
    },
}

# the rows that compile every family with inductor: 13 of the full matrix's 16 minutes on 2
# cores, so CI runs every other row in full and of these the cells of CI_CELLS
COMPILED = ("backend_a", "backend_b", "inductor")

# of the COMPILED rows, the cells that failed once, each for a cause of its own, run in CI
# (test_matrix.test_ci_cells): inductor's conv layout past the job check (ConvNet), a gathered
# op's gradient that was its output gradient and one laid out unlike its input (ViT)
CI_CELLS = [("inductor", "convnet-fx"), ("backend_b", "vit")]

# capture paths that are no column, and why
PATHS_NOT_APPLICABLE = {
    "transformers models through fx": "torch.fx.symbolic_trace fails on them (e.g. GPT-2: "
    '"ValueError: code: co_varnames is too small"); '
    "transform exports them (with their dummy_inputs when "
    "given no example inputs)",
}


def size_label(size: int) -> str:
    return "2 x 2" if size == MESH else str(size)


def rows() -> list[tuple[Feature, int]]:
    """The table's rows: each feature at each world size it runs at."""
    return [(feature, size) for feature in FEATURES for size in feature.sizes]


def row_title(feature: Feature, size: int) -> str:
    return f"{feature.title}, N = {size_label(size)}"


def cells(size: int) -> list[tuple[str, str]]:
    """(feature id, family id) of every cell that runs at world size `size`."""
    return [
        (feature.id, family.id)
        for feature in FEATURES
        if size in feature.sizes
        for family in FAMILIES
        if (feature.id, family.id) not in NOT_APPLICABLE
    ]


FEATURE = {f.id: f for f in FEATURES}
FAMILY = {f.id: f for f in FAMILIES}


# --- verdicts: a cell's checks, per rank -> pass or fail (the test asserts them, the README
# table shows them) -------------------------------------------------------------------------


def _passes(value, op: str, bound) -> bool:
    return {
        "<=": lambda: value <= bound,
        ">=": lambda: value >= bound,
        "==": lambda: value == bound,
    }[op]()


def _show(value) -> str:
    return f"{value:.2e}" if isinstance(value, float) else str(value)


def show(value) -> str:
    """A check's value as the README table shows it."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def unmet(checks: list) -> list:
    """The checks ([what, value, op, bound]) that do not hold."""
    return [c for c in checks if not _passes(*c[1:])]


def failed_checks(result: dict) -> list[str]:
    """What one rank's cell result failed: its error, or each check not met."""
    if result["error"]:
        return [result["error"]]
    if not result["checks"]:
        return ["the cell checked nothing"]
    return [
        f"{what}: {_show(value)}, want {op} {_show(bound)}"
        for what, value, op, bound in unmet(result["checks"])
    ]


def verdict(per_rank: list[dict]) -> dict:
    """A cell over all ranks: "pass" when every rank's checks hold, else "fail" with the first
    failing rank's reasons; the slowest rank's seconds; each rank's checks."""
    for rank, result in enumerate(per_rank):
        failed = failed_checks(result)
        if failed:
            return {
                "status": "fail",
                "reason": "; ".join(failed),
                "rank": rank,
                "seconds": max(r["seconds"] for r in per_rank),
                "checks": [r["checks"] for r in per_rank],
                "trace": result.get("trace", ""),
            }
    return {
        "status": "pass",
        "reason": "",
        "seconds": max(r["seconds"] for r in per_rank),
        "checks": [r["checks"] for r in per_rank],
    }
