"""notebooks/inspect_dataset.ipynb: committed clean, and runs top to bottom headless (nbclient,
the venv's python3 kernel) on a real shards dir, producing its tables and pictures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat


NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_dataset.ipynb"


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    first = code[0].source
    assert "MMDATA_DATASET" in first and "DATASET =" in first  # parameters cell first
    assert "MMDATA_TOKENIZER" in first


def _outputs(nb, mime: str) -> list[str]:
    return [
        o["data"][mime]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})
    ]


def test_notebook_runs_headless_on_a_shards_dir(broken_dataset, monkeypatch, tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    shards, recs = broken_dataset
    spec = KernelSpecManager().get_kernel_spec("python3")
    # the kernel must be this interpreter (the project's venv), not some other python on PATH
    assert spec.argv[0] in ("python", "python3", sys.executable)
    monkeypatch.setenv("MMDATA_DATASET", str(shards))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    html = "\n".join(_outputs(nb, "text/html"))
    valid = sum(1 for r in recs if not r.broken)
    for needle in (
        "Dataset",
        "Sources",
        "Modality (sampled)",
        "Distributions (sampled)",
        "Packing",
        f"Quarantined records ({len(recs) - valid})",
        "image_empty",
        "loss applies",
    ):
        assert needle in html, needle
    assert f"<td>samples</td><td>{valid}</td>" in html
    assert 'style="background:#b8f0b8"' in html  # highlighted loss spans in the gallery
    pngs = _outputs(nb, "image/png")
    # 5 plot figures + the gallery/lookup images + the quarantine-reason chart
    assert len(pngs) >= 7, len(pngs)
    streams = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "stream"
    )
    assert f"{valid} samples" in streams and "key " in streams  # the lookup found its sample
    json.dumps(nb)  # outputs are plain JSON (no pickles, nothing unserialisable)
