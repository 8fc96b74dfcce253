"""README.md is the text of nbs/index.ipynb (the docs home page); regenerate with `python tests/test_readme.py`."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render() -> str:
    nb = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    parts = ["".join(c["source"]).strip() for c in nb["cells"] if c["cell_type"] == "markdown"]
    return "<!-- generated from nbs/index.ipynb by `python tests/test_readme.py`: edit the notebook -->\n\n" + "\n\n".join(parts) + "\n"


def test_readme_is_index():
    assert (ROOT / "README.md").read_text() == render(), "README.md is out of date: run `python tests/test_readme.py`"


if __name__ == "__main__":
    (ROOT / "README.md").write_text(render())
    print("wrote README.md")
