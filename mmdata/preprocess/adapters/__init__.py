"""Dataset adapters: list input units and yield raw records for one unit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mmdata.preprocess.adapters import infinity_mm, llava_json
from mmdata.preprocess.adapters.base import InputUnit, MediaRef, RawRecord

DATASETS = ("infinity-mm", "llava-json")


def list_units(dataset: str, inputs: list[Path], image_root: Path | None = None) -> list[InputUnit]:
    if dataset == "infinity-mm":
        return infinity_mm.list_units(inputs)
    if dataset == "llava-json":
        return llava_json.list_units(inputs, image_root)
    raise ValueError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")


def iter_records(dataset: str, unit: InputUnit) -> Iterator[RawRecord]:
    return infinity_mm.iter_records(unit) if dataset == "infinity-mm" else llava_json.iter_records(unit)


__all__ = ["DATASETS", "InputUnit", "MediaRef", "RawRecord", "iter_records", "list_units"]
