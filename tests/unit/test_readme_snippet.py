"""README.md is a first page: at most 170 lines, its attention block examples/attention_step.py
verbatim (tests/dist/test_examples.py runs the example), its Hugging Face block
examples/hf_training_step.py verbatim, run here as a world of one (gloo, in process)."""

from __future__ import annotations

import runpy
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 170

ATTENTION_STEP = ROOT / "examples" / "attention_step.py"
HF_STEP = ROOT / "examples" / "hf_training_step.py"


def test_readme_is_a_first_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


@pytest.mark.parametrize("example", [ATTENTION_STEP, HF_STEP], ids=lambda p: p.name)
def test_readme_snippets_are_the_examples(example):
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{example.read_text()}```" in readme, (
        f"README.md's block must be {example.relative_to(ROOT)} verbatim"
    )


def test_the_hf_snippet_runs(monkeypatch, capsys):
    pytest.importorskip("transformers")
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        runpy.run_path(str(HF_STEP), run_name="__main__")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "rank 0 step 2: loss" in out, out
