"""The README's first Python example runs as written and prints what it says."""

import re
from pathlib import Path


def test_readme_example_runs_and_matches_its_comments():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    rec = scope["rec"]
    assert tuple(rec.get("frame", step=0, layer=1).shape) == (1, 1, 4, 4)
    assert rec.timesteps == [999.0, 749.0, 499.0, 249.0]
    assert (rec.layout.text_len, rec.layout.grid) == (8, (3, 3, 5))
    assert rec.layout.token_index(2, 1, 4) == 8 + (2 * 3 + 1) * 5 + 4
    assert len(scope["video"]) == 1 and len(scope["video"][0]) == 9  # one video of 9 frames
