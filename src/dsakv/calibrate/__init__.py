"""IndexCache pattern calibration: which layers keep their indexer (`dsakv calibrate-pattern`)."""

from .data import calibration_sequences, read_jsonl
from .output import check_config_dir, check_plot_path, report_text, write_config, write_plot
from .search import (
    CalibrationResult,
    Pricing,
    Runner,
    Step,
    calibrate_pattern,
    greedy_search,
    reference_plan,
)

__all__ = [
    "CalibrationResult",
    "Pricing",
    "Runner",
    "Step",
    "calibrate_pattern",
    "check_config_dir",
    "check_plot_path",
    "calibration_sequences",
    "greedy_search",
    "read_jsonl",
    "reference_plan",
    "report_text",
    "write_config",
    "write_plot",
]
