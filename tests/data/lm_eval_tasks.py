"""Datasets of the local lm-eval tasks (`custom_dataset` in the YAMLs): read from the JSONL
files next to this one, so the tasks load offline from any working directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def _load(name: str) -> Any:
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**_: Any) -> Any:
    return _load("lm_eval_mc.jsonl")


def load_gen(**_: Any) -> Any:
    return _load("lm_eval_gen.jsonl")
