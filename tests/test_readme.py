"""README's quickstart runs as written and computes what it says."""

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path))  # use_policy("fastest") persists a ranking
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    q, out, lse, y = scope["q"], scope["out"], scope["lse"], scope["y"]
    assert out.shape == q.shape and out.dtype == q.dtype and np.isfinite(out).all()
    assert lse.shape == (1, 8, 128) and y.shape == (2, 256)
    w4 = scope["w4"]
    assert w4.shape == (256, 512)
    assert "chosen" in capsys.readouterr().out  # explain() printed its table


def test_command_line_examples_run(monkeypatch, capsys):
    """Every ``portakern ...`` line of README's "Command line" block runs and exits 0."""
    import shlex

    from portakern import cli

    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Command line\n\n```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("portakern ")]
    assert {c.split()[1] for c in commands} >= {"info", "explain", "conformance", "goldens", "support"}
    monkeypatch.chdir(ROOT)
    for command in commands:
        argv = shlex.split(command)[1:]
        assert cli.main(argv) == 0, (command, capsys.readouterr())
