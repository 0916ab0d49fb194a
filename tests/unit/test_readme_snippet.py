"""README.md's attention snippet is examples/attention_step.py verbatim (tests/dist/test_examples.py
runs the example)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


ATTENTION_STEP = ROOT / "examples" / "attention_step.py"


def test_readme_attention_snippet_is_the_example():
    readme = (ROOT / "README.md").read_text()
    source = ATTENTION_STEP.read_text()
    assert f"```python\n{source}```" in readme, (
        "README.md's attention block must be examples/attention_step.py verbatim"
    )
