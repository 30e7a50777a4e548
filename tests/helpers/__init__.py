"""What the tests share: both families' model builders (`helpers.qwen4`, `helpers.inkling`), fault injection,
the Triton-interpreter runner and its server, and the repository's paths."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
